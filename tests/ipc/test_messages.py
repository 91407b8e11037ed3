"""The message codec: dataclasses nested in a message (a field, list items, dict values,
optional) come back from msgpack as the types their fields declare; a worker's stats
report, typed, covers every figure the engine and its MemPool report, and a figure it does
not know fails in the worker rather than reading as 0 at the gateway."""

from __future__ import annotations

import pytest
from helpers import cacheopt
from helpers.mempool import prompt
from helpers.tiers import cache_filled, settle, tiered_pool

from memserve.ipc.messages import (
    AddRequest,
    Heartbeat,
    KVAllocationStats,
    MemPoolStats,
    PDStats,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    TierIO,
    TierStats,
    WorkerReady,
    WorkerStats,
    decode,
    encode,
)


def full_stats() -> WorkerStats:
    mempool = MemPoolStats(8, 16, 0.5, 1, {"device": TierStats(16, 4, 6, 3, 9, 2), "host": TierStats(32, 30, 2, 2)},
                           {"device": TierIO(1024, 3, 2048, 512, 1, 0, 2),
                            "host": TierIO(0, 1, 0, 4096, prefetched=5, prefetch_hits=2)})
    return WorkerStats(num_running=2, num_waiting=1, preemptions={"swap": 1, "recompute": 0}, cache_hit_rate=0.25,
                       kv_allocation=KVAllocationStats(reserve_blocks=4, unheld_blocks=2), max_step_ms=50.0,
                       mempool=mempool, num_steps=7, pd=PDStats(handoffs=3, transfer_s=0.5), loop_age_s=0.1)


@pytest.mark.parametrize("msg", [
    Heartbeat(1, 2.5, full_stats()),
    Heartbeat(-1, 2.5),
    WorkerReady(0, "prefill", 64, 16, 1024, full_stats(), "tcp://127.0.0.1:5555"),
    AddRequest("r", [1, 2, 3], SamplingParams(logit_bias={7: -1.5}, stop_token_ids=[2])),
    StepOutputs(0, [RequestOutput("r", [4], finished=True, finish_reason="stop"), RequestOutput("s", [])]),
])
def test_nested_dataclasses_round_trip(msg):
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


def test_typed_fields_come_back_as_their_types():
    stats = decode(encode(Heartbeat(1, 0.0, full_stats()))).stats
    assert isinstance(stats.mempool, MemPoolStats) and isinstance(stats.pd, PDStats)
    assert isinstance(stats.kv_allocation, KVAllocationStats)
    assert isinstance(stats.mempool.tiers["device"], TierStats) and isinstance(stats.mempool.tier_io["host"], TierIO)
    assert decode(encode(Heartbeat(1, 0.0, WorkerStats()))).stats.kv_allocation is None


def test_a_tiered_pools_report_is_typed_whole(tmp_path):
    """Every tier, pins and the host tier's prefetch figures (a disk tier below it)."""
    pool, memory = tiered_pool(tmp_path, max_pinned_fraction=0.5)
    cache_filled(pool, memory, prompt(3, 2), seed=3)
    settle(pool)
    report = pool.stats()
    typed = MemPoolStats.from_report(report)
    assert list(typed.tiers) == list(typed.tier_io) == ["device", "host", "disk"]
    for tier, blocks in typed.tiers.items():
        assert blocks == TierStats(**report[tier])
    assert typed.tier_io["host"].prefetched is not None and typed.tier_io["device"].prefetched is None
    assert (typed.hit_tokens, typed.query_tokens, typed.save_queue) == (report["hit_tokens"], report["query_tokens"],
                                                                        report["save_queue"])
    pool.close()


def test_a_cacheopt_engines_report_is_typed_whole():
    engine, _, _ = cacheopt.make()
    cacheopt.add(engine, "a", list(range(20)))
    engine.step()
    report = engine.stats()
    typed = WorkerStats.from_report(report, PDStats(handoffs=1))
    assert typed.num_running == report["num_running"] and typed.num_steps == report["num_steps"] == 1
    assert typed.kv_allocation == KVAllocationStats(**report["kv_allocation"])
    assert typed.mempool.tiers["device"].total == report["mempool"]["device"]["total"]
    assert decode(encode(Heartbeat(0, 0.0, typed))).stats == typed


def test_a_figure_the_types_do_not_know_fails_in_the_worker():
    engine, _, _ = cacheopt.make(policy="fcfs")
    report = engine.stats()
    assert WorkerStats.from_report(report, PDStats()).kv_allocation is None
    with pytest.raises(TypeError):
        WorkerStats.from_report({**report, "num_runing": 1}, PDStats())
    report["mempool"]["device"]["idle"] = 0
    with pytest.raises(TypeError):
        WorkerStats.from_report(report, PDStats())
