"""Scheduler-aware prefetching in the real engine (scheduler, KV manager, MemPool) on a
scripted runner and a fake clock: a conversation whose KV cascaded to disk, queued
behind a running request, has its blocks copied up to the host before it runs and is
served from there; under LRU the same request reads them from disk. Also the same
comparison at cluster scale in the simulator: scheduler-aware never hits less."""

from __future__ import annotations

from helpers.mempool import NumpyBlockMover
from helpers.scripted_engine import BS, Clock, ScriptedRunner, add, run_to_end

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier, addr_tier
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.sequence import SequenceStatus

DEVICE_BLOCKS, HOST_BLOCKS, DISK_BLOCKS = 8, 8, 64


class TieredScriptedRunner(ScriptedRunner):
    """The scripted runner with a disk tier (numpy, like the others), whose loads are
    done by the next step."""

    def __init__(self) -> None:
        super().__init__(DEVICE_BLOCKS, HOST_BLOCKS)
        self.num_disk_blocks = DISK_BLOCKS
        self.mover = NumpyBlockMover({Tier.DEVICE: DEVICE_BLOCKS, Tier.HOST: HOST_BLOCKS, Tier.DISK: DISK_BLOCKS})

    def start_loads(self, loads) -> None:
        super().start_loads(loads)
        self.complete_loads()


def make_engine(policy: str) -> tuple[Engine, Clock]:
    cfg = EngineConfig(block_size=BS, num_blocks=DEVICE_BLOCKS, num_host_blocks=HOST_BLOCKS, max_num_seqs=1,
                       max_num_batched_tokens=64, eviction_policy=policy)
    clock = Clock()
    return Engine(cfg, TieredScriptedRunner(), {999}, clock=clock), clock


def tiers_of(engine: Engine, tokens: list[int]) -> list[Tier]:
    return [addr_tier(a) for a in engine.mempool.match(tokens, take_ref=False)]


def conversation(i: int) -> list[int]:
    return [100 * (i + 1) + k for k in range(12)]  # 3 blocks; with 3 answer tokens still 3 full blocks


def queued_turn(policy: str) -> tuple[Engine, list[Tier]]:
    """Cache conversation 0, push it down to disk with six others, then queue its next
    turn behind a long request; returns the engine once that turn was admitted and the
    tiers its history was in right before."""
    engine, clock = make_engine(policy)
    for i in range(7):
        clock.now += 1
        add(engine, f"c{i}", conversation(i))
        run_to_end(engine)
    first = conversation(0) + [7, 7, 7]  # its answer: the scripted runner samples 7
    assert tiers_of(engine, first) == [Tier.DISK] * 3
    add(engine, "long", [5] * 8, max_tokens=12)
    add(engine, "next", first + [1, 2, 3, 4, 5])
    before: list[Tier] = []
    while engine.scheduler._requests["next"].status is SequenceStatus.WAITING:
        before = tiers_of(engine, first)
        clock.now += 0.01
        engine.step()
    run_to_end(engine)
    return engine, before


def test_a_queued_request_finds_its_disk_blocks_on_the_host_when_it_runs():
    engine, before = queued_turn("scheduler-aware")
    assert before == [Tier.HOST] * 3  # prefetched while the long request ran
    io = engine.mempool.stats()["tier_io"]
    assert io["host"]["prefetched"] == 3 and io["host"]["prefetch_hits"] == 3
    assert io["disk"]["hits"] == 0
    assert engine.stats()["num_swapped_in"] >= 3


def test_without_scheduler_awareness_the_same_request_reads_disk():
    engine, before = queued_turn("lru")
    assert before == [Tier.DISK] * 3
    io = engine.mempool.stats()["tier_io"]
    assert "prefetched" in io["host"] and io["host"]["prefetched"] == 0
    assert io["disk"]["hits"] == 3


def test_prefetch_figures_reach_the_metrics():
    from memserve.gateway.metrics import EngineStatsCollector

    engine, _ = queued_turn("scheduler-aware")
    stats = engine.mempool.stats()
    worker = {"instance_id": 0, "kv_tiers": stats["tier_io"], "kv_save_queue": stats["save_queue"]}
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in EngineStatsCollector(lambda: {"workers": [worker]}).collect() for s in family.samples}
    assert samples[("memserve_kv_prefetched_blocks_total", None)] == 3
    assert samples[("memserve_kv_prefetch_hit_blocks_total", None)] == 3
    assert samples[("memserve_kv_tier_queue_depth", "host")] == 0  # every copy committed


def test_the_gateway_mirror_follows_every_prefetch_and_load():
    from memserve.kvcache.events import MOVED, KVEvents
    from memserve.kvcache.mirror import PromptTreeMirror

    engine, _ = queued_turn("scheduler-aware")
    events = engine.drain_kv_events()
    mirror = PromptTreeMirror(0, BS)
    mirror.apply(KVEvents(0, events))
    assert mirror.entries() == engine.mempool.index.entries()  # every block, in the tier it is in
    assert any(e.type == MOVED and set(e.tiers) == {Tier.HOST} for e in events)  # the prefetch was told


def test_at_cluster_scale_scheduler_aware_hits_far_more_than_lru(tmp_path):
    """``memserve simulate`` with a paper preset, a disk tier and a deep queue (every
    session starts at once): LRU evicts the conversation that waited longest, the one
    about to run; scheduler-aware keeps it. Same seed, same capacity."""
    import json
    import subprocess
    import sys

    from helpers.paths import SHARED_DATA

    def cached_ratio(policy: str) -> float:
        out = tmp_path / f"{policy}.json"
        subprocess.run([sys.executable, "-m", "memserve.cli", "simulate", "--cost-model", "llama2-13b-h800",
                        "--dataset", str(SHARED_DATA / "sharegpt-sample.jsonl"), "--num-sessions", "30",
                        "--max-turns", "4", "--num-blocks", "64", "--num-host-blocks", "64",
                        "--num-disk-blocks", "192", "--eviction-policy", policy, "--no-progress",
                        "--output", str(out)], check=True, capture_output=True)
        return json.loads(out.read_text())["cached_token_ratio"]

    lru, aware = cached_ratio("lru"), cached_ratio("scheduler-aware")
    assert aware > lru + 0.2, (lru, aware)
