"""``--schedule-policy cacheopt`` in the real Engine, Scheduler, KV manager and MemPool,
driven by the scripted runner and fake clock of helpers/scripted_engine.py: deadline-first
admission, predicted-demand allocation, embedding, the global reserve, swap through
the host tier, the starvation bound of workers/engine/policies/cacheopt/policy.py, and no leaked block."""

from __future__ import annotations

import random

import pytest
from helpers.cacheopt import add, make, policy
from helpers.scripted_engine import (
    BS,
    VOCAB,
    assert_no_block_held,
    chunk_sizes,
    run_to_end,
)

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)
from memserve.workers.engine.policies.cacheopt.policy import CacheOpt


def test_the_earliest_ttft_deadline_is_admitted_first_fcfs_keeps_arrival_order():
    for name, first in (("cacheopt", "tight"), ("fcfs", "loose")):
        engine, runner, clock = make(max_num_seqs=1, policy=name)
        add(engine, "loose", [1, 2, 3], max_tokens=1, ttft_ms=5000)
        clock.now = 0.01
        add(engine, "tight", [4, 5, 6], max_tokens=1, ttft_ms=100)
        engine.step()
        assert list(chunk_sizes(runner.plans[0])) == [first], name


def test_a_request_is_allocated_its_predicted_demand_and_grows_inside_it():
    engine, _, _ = make(options="disable=PA")
    add(engine, "r", list(range(1, 11)), max_tokens=20, predicted=20)  # 10 + 20 tokens: 8 blocks of 4
    engine.step()
    a = policy(engine).ledger.allocations["r"]
    assert (a.allocated, a.held) == (8, 3)  # 10 prompt tokens hold 3 blocks
    assert engine.stats()["kv_allocation"]["unheld_blocks"] == 5
    for _ in range(8):
        engine.step()
    assert policy(engine).ledger.allocations["r"].allocated == 8  # 18 tokens: still inside
    run_to_end(engine)
    assert_no_block_held(engine)
    assert engine.stats()["kv_allocation"]["unheld_blocks"] == 0


def test_a_new_request_is_embedded_in_a_running_requests_unused_allocation():
    engine, _, _ = make()
    add(engine, "host", [1, 2, 3, 4], max_tokens=100, predicted=100)  # 104 tokens: 26 blocks
    engine.step()
    # Guest: 4 prompt + 8 predicted. a - (u + s_o) - (s_p + s_o) = 104 - (5 + 8) - (4 + 8) = 79 >= b = 8.
    add(engine, "guest", [5, 6, 7, 8], max_tokens=8, predicted=8)
    engine.step()
    ledger = policy(engine).ledger
    assert ledger.num_embedded == 1 and ledger.allocations["guest"].lender == "host"
    assert ledger.allocations["host"].allocated == 26 - 3  # the guest's 12 tokens: 3 blocks
    run_to_end(engine)
    assert_no_block_held(engine)


def test_growth_past_the_allocation_with_nothing_free_uses_the_global_reserve():
    # 16 blocks, 8 reserved: 8 for allocations. Predicted 4 of 30 tokens: demand 8 + 8 tokens
    # (4 blocks); it grows block by block from the free part up to 8 blocks, then takes 2
    # reserve blocks for its 37 computed tokens (10 blocks): the 9th is seen in use
    # between steps, the 10th is taken by the last step and returned as the request ends.
    engine, _, _ = make(num_blocks=16, options="disable=PA")
    add(engine, "r", list(range(1, 9)), max_tokens=30, predicted=4)
    peak = 0
    while engine.has_work:
        engine.step()
        peak = max(peak, engine.stats()["kv_allocation"]["reserve_in_use_blocks"])
    alloc = engine.stats()["kv_allocation"]
    assert (peak, alloc["reserve_grants_total"], alloc["reserve_in_use_blocks"]) == (1, 2, 0)
    assert engine.stats()["preemptions"] == {"recompute": 0, "swap": 0}
    assert_no_block_held(engine)


def test_proactive_allocation_tops_up_a_request_about_to_run_out():
    engine, _, _ = make(num_blocks=64)
    add(engine, "r", list(range(1, 9)), max_tokens=30, predicted=4)  # allocated 4 blocks (16 tokens)
    for _ in range(8):
        engine.step()
    # m = 2: once fewer than 2 tokens are left in its 4 blocks, it gets its demand (B more) ahead.
    assert engine.stats()["kv_allocation"]["proactive_top_ups_total"] >= 1
    run_to_end(engine)
    assert engine.stats()["kv_allocation"]["reserve_grants_total"] == 0
    assert_no_block_held(engine)


def swap_always() -> CostModel:
    """Recompute costs 1 s a token, copying is free: the sweet spot is 1 token."""
    return CostModel(CostKey("m", "float32", "hw"), BS, 8, {"linear": OperatorCost(per_token=1.0)},
                     AttentionCost(0.0, 0.0, 0.0, 0.0), DecodeCost(0.0, 0.0, 0.0), BandwidthCost(0.0, 1e15),
                     BandwidthCost(0.0, 1e15))


@pytest.mark.parametrize("with_cost", [True, False])
def test_a_victim_longer_than_the_sweet_spot_is_swapped_through_the_host_tier(with_cost):
    engine, runner, _ = make(num_blocks=12, budget=64, num_host_blocks=32, options="reserve=0;disable=PA")
    policy(engine).sweet_spot = 1 if with_cost else None  # as attach() computes from swap_always()
    add(engine, "a", list(range(1, 13)), max_tokens=20, predicted=4)  # both under-predicted: they collide
    add(engine, "b", list(range(20, 32)), max_tokens=20, predicted=4)
    while engine.has_work:
        engine.step()
        runner.complete_loads()
    kinds = engine.stats()["preemptions"]
    assert (kinds["swap"] > 0, kinds["recompute"] > 0) == (with_cost, not with_cost)
    if with_cost:  # swapped back in (a recompute's freed blocks may come back too: the prefix cache)
        assert engine.stats()["num_swapped_in"] > 0
    assert_no_block_held(engine)


def test_attach_finds_the_sweet_spot_from_the_cost_model():
    engine, _, _ = make(num_blocks=12)
    co = CacheOpt(policy(engine).opt, swap_always())
    co.attach(engine.scheduler.kv)
    assert co.sweet_spot == 1


def test_a_loose_request_under_a_stream_of_tighter_ones_is_served_within_the_bound():
    """Bound (workers/engine/policies/cacheopt/policy.py): nothing arriving after d - S_min overtakes a request
    with deadline d. Here d = 0.2 s, S_min = 0.03 s, one request served per 10 ms step and
    one arriving per step: the loose one goes at step 17 or 18 (a tie at 0.2 s), after
    16-17 later arrivals overtook it, never later."""
    engine, runner, clock = make(max_num_seqs=1, budget=64)
    add(engine, "loose", [1, 2, 3], max_tokens=1, ttft_ms=200)
    served_at = None
    for step in range(40):
        clock.now = step * 0.01
        add(engine, f"t{step}", [4, 5, step + 6], max_tokens=1, ttft_ms=30)
        engine.step()
        if "loose" in chunk_sizes(runner.plans[-1]):
            served_at = step
            break
    assert served_at in (17, 18)


def test_random_workload_finishes_every_request_without_leaks():
    rng = random.Random(1)
    engine, runner, clock = make(num_blocks=24, num_host_blocks=48, budget=24, max_num_seqs=4)
    policy(engine).sweet_spot = 8
    finished = set()
    for i in range(60):
        n = rng.randrange(2, 30)
        predicted = rng.choice([None, rng.randrange(1, 12)])
        add(engine, f"r{i}", [rng.randrange(1, VOCAB - 1) for _ in range(n)], max_tokens=rng.randrange(1, 10),
            predicted=predicted, ttft_ms=rng.choice([None, 20.0, 500.0]), tbt_ms=rng.choice([None, 10.0, 100.0]))
        for _ in range(rng.randrange(0, 4)):
            clock.now += 0.01
            finished |= {o.request_id for o in engine.step() if o.finished}
            if rng.random() < 0.5:
                runner.complete_loads()
    while engine.has_work:
        clock.now += 0.01
        runner.complete_loads()
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"r{i}" for i in range(60)}
    assert_no_block_held(engine)
    assert not policy(engine).ledger.allocations and policy(engine).ledger.unheld_blocks == 0
    assert engine.stats()["kv_allocation"]["room_preemptions_total"] > 0  # make_room ran in the mix too
    assert not policy(engine).ledger.shortfalls


def test_options_name_the_ablation_components():
    with pytest.raises(ValueError, match="unknown component"):
        make(options="disable=XYZ")
    with pytest.raises(ValueError, match="takes no options"):
        make(options="reserve=4", policy="fcfs")
    engine, _, _ = make(options="disable=/GR,pss;reserve=16")
    assert policy(engine).ledger.reserve_blocks == 0 and policy(engine).sweet_spot is None


def test_reserve_and_padding_in_use_reach_the_gateways_metrics():
    from memserve.gateway.metrics import EngineStatsCollector

    engine, _, _ = make(options="disable=PA")
    add(engine, "r", list(range(1, 11)), max_tokens=20, predicted=20)  # 8 blocks allocated, 3 held
    engine.step()
    worker = {"instance_id": 0, "alive": True, "kv_allocation": engine.stats()["kv_allocation"]}
    samples = {s.name: s.value for family in EngineStatsCollector(lambda: {"workers": [worker]}).collect()
               for s in family.samples}
    assert samples["memserve_kv_unheld_blocks"] == 5 and samples["memserve_kv_reserve_blocks_in_use"] == 0
    fcfs, _, _ = make(policy="fcfs")
    assert "kv_allocation" not in fcfs.stats() and fcfs.stats()["preemptions"] == {"recompute": 0, "swap": 0}
