"""The TBT-bounded step budget of cacheopt (workers/engine/policies/cacheopt/budget.py and
``CacheOpt._tbt_budget``) against hand-computed values: a long prompt is chunked so
that the decoding requests' next tokens still come within their TBT SLO, a deadline no
useful chunk can meet is given up rather than stalling prefills, a prefill progresses
by at least the minimum chunk every step under continuous decode load, and a prefill
due soon takes what its TTFT deadline needs over the TBT bound."""

from __future__ import annotations

import pytest
from helpers.cacheopt import add, make, policy
from helpers.scripted_engine import chunk_sizes

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)
from memserve.workers.engine.policies.cacheopt.budget import (
    prefill_tokens_within,
    step_prefill_tokens,
    ttft_chunk,
)

# A step: decode 5 ms + 1 ms a sequence; prefill 7 ms + 1 ms a token, of which the 5 ms
# shared with a decode batch are paid once: beside decodes a prefill adds 2 ms + 1 ms a
# token. The test clock stands still, so a request that just decoded has its whole TBT
# SLO as slack.
COST = CostModel(CostKey("m", "float32", "hw"), 4, 8, {"linear": OperatorCost(per_token=1e-3, per_step=7e-3)},
                 AttentionCost(0.0, 0.0, 0.0, 0.0), DecodeCost(5e-3, 1e-3, 0.0), BandwidthCost(0.0, 1e9),
                 BandwidthCost(0.0, 1e9))


def test_prefill_tokens_that_fit_beside_the_decodes():
    assert prefill_tokens_within(COST, 0.050, 2, 10, 5) == 41  # (50 - 7 - 2) ms / 1 ms; 36 paying 7 ms twice
    assert COST.step_s([(41, 0.0)], 2, 10) == pytest.approx(0.007 + 0.048 - 0.005)  # so that step takes 50 ms
    assert prefill_tokens_within(COST, 0.008, 2, 10, 5) == 0  # 1 ms left: not even the prefill's fixed cost


def test_the_step_budget_keeps_the_tightest_deadline_a_useful_chunk_can_meet():
    two = [4, 4]  # two decodes: 7 ms; slack s allows s - 9 ms of tokens
    assert step_prefill_tokens(COST, [0.050, 0.080], two, [], 500, 16) == 41  # 50 ms binds
    assert step_prefill_tokens(COST, [0.050, 0.080], two, [], 500, 50) == 71  # 41 < 50: 50 ms given up, 80 binds
    assert step_prefill_tokens(COST, [0.050, 0.080], two, [], 60, 50) == 60  # never past the configured budget
    assert step_prefill_tokens(COST, [0.005, 0.030], two, [], 500, 16) == 21  # 5 ms: lost even decoding only
    assert step_prefill_tokens(COST, [0.050, 0.080], two, [], 500, 100) == 500  # none keepable: unbounded
    assert step_prefill_tokens(COST, [0.050], [], [], 500, 16) == 500  # nothing decodes: nothing to protect
    # A prompt due soon takes what its TTFT deadline needs over the TBT bound (below).
    assert step_prefill_tokens(COST, [0.050], two, [(0.2, 100)], 500, 16) == 41
    assert step_prefill_tokens(COST, [0.050], two, [(0.11, 100)], 500, 16) == 100


def test_the_ttft_chunk_is_the_smallest_that_finishes_each_prompt_by_its_deadline():
    one = 0.006  # one decode; a step with T prompt tokens takes 8 ms + T ms
    assert ttft_chunk(COST, [(0.11, 100)], one, 500) == 100  # one step of 108 ms fits 110 ms; two do not
    assert ttft_chunk(COST, [(0.2, 100)], one, 500) == 10  # 11 steps of 8 + 10 ms = 198 ms (12 x 17: 204)
    assert ttft_chunk(COST, [(0.05, 100)], one, 500) == 500  # late even in one step: as soon as possible
    assert ttft_chunk(COST, [(0.11, 100)], one, 60) == 60  # never past the limit
    # Served in order: the second is done after both, 150 tokens in 6 steps of 8 + 25 ms = 198 ms.
    assert ttft_chunk(COST, [(1.0, 100), (0.2, 50)], one, 500) == 25
    assert ttft_chunk(COST, [], one, 500) == 0


def test_a_long_prompt_is_chunked_to_keep_the_tightest_tbt_deadline():
    engine, runner, _ = make(budget=128, options="min_prefill=16")
    policy(engine).cost = COST
    add(engine, "a", [1, 2, 3, 4], max_tokens=50, tbt_ms=50)
    add(engine, "b", [5, 6, 7, 8], max_tokens=50, tbt_ms=80)
    engine.step()  # both prefill and sample their first token
    add(engine, "long", list(range(10, 110)), max_tokens=2)
    engine.step()
    # a's next token is due in 50 ms: 2 decodes + 41 prompt tokens (b's 80 ms allows 71).
    assert chunk_sizes(runner.plans[-1]) == {"a": 1, "b": 1, "long": 41}


def test_a_deadline_no_useful_step_can_meet_does_not_stall_prefills():
    engine, runner, _ = make(budget=128)  # min_prefill 64: 41 tokens is too few to bother
    policy(engine).cost = COST
    add(engine, "a", [1, 2, 3, 4], max_tokens=50, tbt_ms=50)
    engine.step()
    add(engine, "long", list(range(10, 110)), max_tokens=2)
    engine.step()
    assert chunk_sizes(runner.plans[-1]) == {"a": 1, "long": 100}


def test_a_prefill_progresses_by_the_minimum_chunk_under_continuous_decode_load():
    """No starvation: decodes with a 25 ms TBT SLO allow 25 - 7 - 2 = 16 tokens a step,
    exactly the minimum chunk, so the 100-token prompt takes ceil(100 / 16) = 7 steps,
    every one of them decoding both requests too."""
    engine, runner, _ = make(budget=128, options="min_prefill=16")
    policy(engine).cost = COST
    add(engine, "a", [1, 2, 3, 4], max_tokens=50, tbt_ms=25)
    add(engine, "b", [5, 6, 7, 8], max_tokens=50, tbt_ms=25)
    engine.step()
    add(engine, "long", list(range(10, 110)), max_tokens=2)
    chunks = []
    for _ in range(7):
        engine.step()
        sizes = chunk_sizes(runner.plans[-1])
        assert (sizes["a"], sizes["b"]) == (1, 1)
        chunks.append(sizes["long"])
    assert chunks == [16, 16, 16, 16, 16, 16, 4]
    engine.step()
    assert chunk_sizes(runner.plans[-1]) == {"a": 1, "b": 1, "long": 1}  # decoding: its first token came


def test_decodes_are_served_before_a_running_prefill_chunk():
    """Whatever order the running requests are in, a prefill chunk does not take the
    token a decode needs: the budget is 1 decode + 41 prompt tokens."""
    engine, runner, _ = make(budget=128, options="min_prefill=16")
    policy(engine).cost = COST
    add(engine, "z", [1, 2, 3, 4], max_tokens=50, tbt_ms=50)
    engine.step()
    add(engine, "long", list(range(10, 210)), max_tokens=2)
    engine.step()
    assert chunk_sizes(runner.plans[-1]) == {"z": 1, "long": 42}  # 50 ms, one decode: 50 - 6 - 2
    engine.scheduler.running.reverse()  # the prefill first
    engine.step()
    assert chunk_sizes(runner.plans[-1]) == {"z": 1, "long": 42}


def test_a_prefill_due_soon_takes_what_it_needs_over_the_tbt_bound():
    """Critical requests first: one decode (50 ms SLO) allows 42 prompt tokens a step,
    but a 100-token prompt due in 110 ms needs them all in this step (108 ms)."""
    for ttft_ms, chunk in ((110, 100), (10_000, 42)):
        engine, runner, _ = make(budget=128, options="min_prefill=16")
        policy(engine).cost = COST
        add(engine, "a", [1, 2, 3, 4], max_tokens=50, tbt_ms=50)
        engine.step()
        add(engine, "p", list(range(10, 110)), max_tokens=2, ttft_ms=ttft_ms)
        engine.step()
        assert chunk_sizes(runner.plans[-1]) == {"a": 1, "p": chunk}, ttft_ms
