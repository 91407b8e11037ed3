"""The TBT-bounded step budget of cacheopt (workers/cacheopt_budget.py and
``CacheOpt._tbt_budget``) against hand-computed values: a long prompt is chunked so
that the decoding requests' next tokens still come within their TBT SLO."""

from __future__ import annotations

from test_cacheopt_policy import add, make, policy
from test_scheduler import chunk_sizes

from memserve.gateway.cost_model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)
from memserve.workers.cacheopt_budget import prefill_tokens_within

# A step: decode 5 ms + 1 ms a sequence; prefill 2 ms + 1 ms a token.
COST = CostModel(CostKey("m", "float32", "hw"), 4, 8, {"linear": OperatorCost(per_token=1e-3, per_step=2e-3)},
                 AttentionCost(0.0, 0.0, 0.0, 0.0), DecodeCost(5e-3, 1e-3, 0.0), BandwidthCost(0.0, 1e9),
                 BandwidthCost(0.0, 1e9))


def test_prefill_tokens_that_fit_beside_the_decodes():
    assert prefill_tokens_within(COST, 0.050, 2, 10, 5) == 41  # (50 - 7 - 2) ms / 1 ms
    assert prefill_tokens_within(COST, 0.008, 2, 10, 5) == 0  # 1 ms left: not even the prefill's fixed cost


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
    engine, runner, _ = make(budget=128)  # min_prefill 256: 41 tokens is too few to bother
    policy(engine).cost = COST
    add(engine, "a", [1, 2, 3, 4], max_tokens=50, tbt_ms=50)
    engine.step()
    add(engine, "long", list(range(10, 110)), max_tokens=2)
    engine.step()
    assert chunk_sizes(runner.plans[-1]) == {"a": 1, "long": 100}
