"""CacheOpt §3.3.2 for waiting requests (workers/engine/policies/cacheopt/policy.py ``make_room``): a waiting
request about to miss its TTFT SLO, with no KV for its basic need, gets room by
preempting running requests in §3.4's order, and is admitted in the same step; a victim
yields to waiting requests at most once; a deadline already missed preempts nobody.

Hand-computed setup (blocks of 4 tokens, B = 0 so that an allocation is exactly the
blocks a request holds, no reserve, no proactive top-ups): 12 blocks; A, B, C each
prefill 12 tokens (3 blocks) at t = 0, leaving 3 free. W arrives at t = 5 ms with 16
prompt tokens (basic need D = 4 blocks > A' = 3) and a TTFT SLO of 8 ms: at the step of
t = 10 ms it has 3 ms left, below epsilon (5 ms), so W is critical and can still make it. The order (§3.4): A and
C have the loose TBT SLO (1000 ms, band 3) and B the tight one (100 ms, band 1); of A
and C, A has the longer remaining time (299 tokens: band 2, C 9: band 0). A holds 3
blocks >= the 1 short, so A alone is preempted."""

from __future__ import annotations

from helpers.cacheopt import add, make, policy
from helpers.scripted_engine import assert_no_block_held, chunk_sizes, run_to_end

OPTIONS = "reserve=0;b=0;disable=PA"


def start(ttft_ms: float, yielded: tuple[str, ...] = ()):
    engine, runner, clock = make(num_blocks=12, budget=64, options=OPTIONS)
    add(engine, "A", list(range(1, 13)), max_tokens=300, ttft_ms=10_000, tbt_ms=1000)
    add(engine, "B", list(range(20, 32)), max_tokens=300, ttft_ms=10_000, tbt_ms=100)
    add(engine, "C", list(range(40, 52)), max_tokens=10, ttft_ms=10_000, tbt_ms=1000)
    engine.step()
    assert chunk_sizes(runner.plans[0]) == {"A": 12, "B": 12, "C": 12}
    assert policy(engine).ledger.free_blocks() == 3
    policy(engine)._yielded.update(yielded)
    clock.now = 0.005
    add(engine, "W", list(range(60, 76)), max_tokens=2, ttft_ms=ttft_ms)
    clock.now = 0.01
    engine.step()
    return engine, runner, clock


def test_a_critical_waiting_request_preempts_in_band_order_and_runs_at_once():
    engine, runner, clock = start(ttft_ms=8)
    plan = runner.plans[-1]
    assert plan.preempted_ids == ["A"]
    assert chunk_sizes(plan) == {"B": 1, "C": 1, "W": 16}  # W admitted the same step
    assert engine.stats()["preemptions"] == {"recompute": 1, "swap": 0}
    assert engine.stats()["kv_allocation"]["room_preemptions_total"] == 1
    assert [s.request_id for s in engine.scheduler.policy] == ["A"]  # waits behind W
    finished = set()
    while engine.has_work:  # the pool is tight: later preemptions come from running requests' growth
        clock.now += 0.01
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"A", "B", "C", "W"}
    assert_no_block_held(engine)


def test_a_request_yields_to_waiting_ones_only_once():
    # A already yielded once: C, next in the order, goes instead (3 blocks, enough).
    engine, runner, _ = start(ttft_ms=8, yielded=("A",))
    assert runner.plans[-1].preempted_ids == ["C"]
    assert "W" in chunk_sizes(runner.plans[-1])
    run_to_end(engine)
    assert_no_block_held(engine)


def test_a_missed_deadline_preempts_nobody():
    engine, runner, _ = start(ttft_ms=4)  # due at 9 ms, it is 10 ms: nothing to save
    assert runner.plans[-1].preempted_ids == []
    assert engine.stats()["kv_allocation"]["room_preemptions_total"] == 0
    assert set(chunk_sizes(runner.plans[-1])) == {"A", "B", "C"}
    run_to_end(engine)
    assert_no_block_held(engine)


def test_fcfs_makes_no_room_for_waiting_requests():
    engine, runner, clock = make(num_blocks=12, budget=64, policy="fcfs")
    for rid, base in (("A", 1), ("B", 20), ("C", 40)):
        add(engine, rid, list(range(base, base + 12)), max_tokens=300)
    engine.step()
    clock.now = 0.005
    add(engine, "W", list(range(60, 76)), max_tokens=2, ttft_ms=8)
    clock.now = 0.01
    engine.step()
    assert runner.plans[-1].preempted_ids == [] and "W" not in chunk_sizes(runner.plans[-1])
