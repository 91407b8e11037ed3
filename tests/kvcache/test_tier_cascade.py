"""The tier cascade device -> host -> disk -> dropped on a pure MemPool over real files:
saves run on a background thread and never hold up ``alloc_mem``; a block being saved
stays readable where it is and is freed only once its copy is written; bytes come back
bit-exact; every block is accounted for after each test."""

from __future__ import annotations

import threading
import time

import pytest
from test_mempool import (
    BS,
    Clock,
    NumpyBlockMover,
    assert_accounting,
    prompt,
    random_workload,
)

from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.disk_store import HEADER_NBYTES, DiskStore
from memserve.kvcache.events import MOVED, REMOVED
from memserve.kvcache.mempool import KVFlags, MemPool, OutOfBlocks
from memserve.kvcache.saver import ThreadSaver
from memserve.kvcache.tiered_mover import TieredMover

BLOCK_NBYTES = 64


class SlowMover:
    """Wraps a mover: copies out of ``slow_tier`` wait until ``release`` is set, so a
    test can hold a save in flight for as long as it likes."""

    def __init__(self, inner, slow_tier: Tier) -> None:
        self.inner = inner
        self.block_nbytes = inner.block_nbytes
        self.slow_tier = slow_tier
        self.release = threading.Event()

    def copy_blocks(self, src_tier, src_blocks, dst_tier, dst_blocks) -> None:
        if src_tier == self.slow_tier:
            assert self.release.wait(10), "the test never released the save"
        self.inner.copy_blocks(src_tier, src_blocks, dst_tier, dst_blocks)

    def read_blocks(self, tier, blocks):
        return self.inner.read_blocks(tier, blocks)

    def write_blocks(self, tier, blocks, buffers) -> None:
        self.inner.write_blocks(tier, blocks, buffers)


def tiered_pool(tmp_path, device=4, host=4, disk_blocks=8, watermark=1.0, slow: Tier | None = None,
                instance=0) -> tuple[MemPool, NumpyBlockMover]:
    """A MemPool with numpy device/host tiers, a real disk store and a background saver."""
    memory = NumpyBlockMover({Tier.DEVICE: device, Tier.HOST: host}, BLOCK_NBYTES)
    store = DiskStore(tmp_path, disk_blocks * (BLOCK_NBYTES + HEADER_NBYTES), BLOCK_NBYTES, fingerprint=1234)
    mover = TieredMover(memory, store)
    saver_mover = SlowMover(mover, slow) if slow is not None else mover
    tiers = {Tier.DEVICE: device, Tier.HOST: host, Tier.DISK: store.num_blocks}
    pool = MemPool(instance, tiers, BS, mover=mover, saver=ThreadSaver(saver_mover), disk=store,
                   save_watermark=watermark)
    pool.slow = saver_mover  # type: ignore[attr-defined]
    return pool, memory


def cache_filled(pool: MemPool, memory: NumpyBlockMover, tokens: list[int], seed: int) -> bytes:
    """Compute a prompt (random KV bytes), index it, release it; returns its bytes."""
    addrs = pool.alloc_mem(len(tokens) // BS)
    memory.fill(Tier.DEVICE, [addr_block(a) for a in addrs], seed)
    want = memory.get(addrs)
    pool.insert(tokens, addrs, KVFlags.RELEASE)
    return want


def tiers_of(pool: MemPool, tokens: list[int]) -> list[Tier]:
    return [addr_tier(a) for a in pool.match(tokens, take_ref=False)]


def settle(pool: MemPool) -> None:
    """Kick and flush until the cascade stops moving."""
    for _ in range(10):
        pool.kick_saves()
        if not pool.saver.pending():
            return
        pool.flush_saves()
    raise AssertionError("the cascade never settles")


def assert_no_leaks(pool: MemPool) -> None:
    pool.flush_saves()
    stats = pool.stats()
    for tier in pool.tiers:
        s = stats[tier.name.lower()]
        assert s["used"] == 0 and s["free"] + s["cached"] == s["total"], (tier, s)
        assert stats["tier_io"][tier.name.lower()]["saving"] == 0
    assert stats["save_queue"] == 0


def test_round_trip_device_host_disk_device_is_bit_exact(tmp_path):
    pool, memory = tiered_pool(tmp_path)
    tokens = prompt(1, 4)
    want = cache_filled(pool, memory, tokens, seed=1)
    pool.kick_saves()  # watermark 100%: every idle block leaves the device...
    pool.flush_saves()
    assert tiers_of(pool, tokens) == [Tier.HOST] * 4
    settle(pool)  # ...and the host, for the disk
    assert tiers_of(pool, tokens) == [Tier.DISK] * 4
    files = sorted(p.name for p in pool.disk.dir.iterdir())
    assert files == sorted(f"{n.hash:016x}.kv" for n in pool.index.nodes())
    hit = pool.match(tokens)
    back = pool.swap_in(hit)
    pool.free_mem(hit)
    assert memory.get(back) == want
    assert tiers_of(pool, tokens) == [Tier.DEVICE] * 4
    pool.free_mem(back)
    io = pool.stats()["tier_io"]
    assert io["disk"]["write_bytes"] == io["disk"]["read_bytes"] == 4 * BLOCK_NBYTES
    assert io["disk"]["hits"] == 4
    assert_no_leaks(pool)
    pool.close()


def test_alloc_mem_never_waits_for_a_save(tmp_path):
    pool, memory = tiered_pool(tmp_path, device=8, host=8, watermark=0.5, slow=Tier.DEVICE)
    first, second = prompt(1, 4), prompt(2, 4)
    cache_filled(pool, memory, first, seed=1)
    want = cache_filled(pool, memory, second, seed=2)
    pool.drain_events()
    pool.kick_saves()  # starts saving the 4 LRU blocks (the first prompt); the copy hangs
    assert pool.stats()["tier_io"]["device"]["saving"] == 4
    started = time.perf_counter()
    got = pool.alloc_mem(4)  # takes the idle blocks (the second prompt, dropped), not the pinned ones
    assert time.perf_counter() - started < 0.5
    assert tiers_of(pool, second) == []
    with pytest.raises(OutOfBlocks):
        pool.alloc_mem(1)  # what is left is being saved: never taken, never waited for
    assert tiers_of(pool, first) == [Tier.DEVICE] * 4  # still readable where it is
    pool.slow.release.set()
    pool.flush_saves()
    assert tiers_of(pool, first) == [Tier.HOST] * 4
    assert [e.type for e in pool.drain_events()] == [REMOVED, MOVED]
    pool.free_mem(got)
    assert_no_leaks(pool)
    assert want  # the dropped prompt's bytes are gone with it; nothing else to compare
    pool.close()


def test_a_block_used_while_saving_stays_where_it_is(tmp_path):
    pool, memory = tiered_pool(tmp_path, slow=Tier.DEVICE)
    tokens = prompt(3, 4)
    want = cache_filled(pool, memory, tokens, seed=3)
    pool.kick_saves()
    hit = pool.match(tokens)  # a request reads the blocks being saved
    assert [addr_tier(a) for a in hit] == [Tier.DEVICE] * 4 and memory.get(hit) == want
    pool.slow.release.set()
    pool.flush_saves()
    assert tiers_of(pool, tokens) == [Tier.DEVICE] * 4  # hot: the copies are given back
    assert pool.stats()["host"]["free"] == 4
    pool.free_mem(hit)
    assert_no_leaks(pool)
    pool.close()


def test_a_block_swapped_in_while_saving_down_is_freed_once(tmp_path):
    pool, memory = tiered_pool(tmp_path, slow=Tier.HOST)
    tokens = prompt(4, 4)
    want = cache_filled(pool, memory, tokens, seed=4)
    pool.kick_saves()
    pool.flush_saves()  # device -> host done; host -> disk now starts and hangs
    pool.kick_saves()
    assert tiers_of(pool, tokens) == [Tier.HOST] * 4
    hit = pool.match(tokens)
    back = pool.prepare_swap_in(hit)
    for tier, src, dst in pool.swap_in_copies(hit, back):
        memory.copy_blocks(tier, src, Tier.DEVICE, dst)
    assert pool.commit_swap_in(hit, back) == 4
    pool.free_mem(hit)
    pool.slow.release.set()
    pool.flush_saves()
    assert memory.get(back) == want and tiers_of(pool, tokens) == [Tier.DEVICE] * 4
    pool.free_mem(back)
    assert_no_leaks(pool)
    assert pool.stats()["host"]["free"] == 4 and pool.stats()["disk"]["free"] == pool.disk.num_blocks
    pool.close()


def test_full_disk_drops_its_least_recently_used_chains(tmp_path):
    pool, memory = tiered_pool(tmp_path, device=4, host=4, disk_blocks=4)
    prompts = [prompt(10 + i, 2) for i in range(6)]
    for i, tokens in enumerate(prompts):
        cache_filled(pool, memory, tokens, seed=i)
        settle(pool)
    assert len(list(pool.disk.dir.iterdir())) <= pool.disk.num_blocks  # the budget holds
    assert tiers_of(pool, prompts[0]) == []  # the oldest were dropped at the end of the cascade
    assert tiers_of(pool, prompts[-1]) in ([Tier.HOST] * 2, [Tier.DISK] * 2)
    assert_no_leaks(pool)
    pool.close()


def test_per_tier_figures_reach_the_metrics(tmp_path):
    from memserve.gateway.metrics import EngineStatsCollector

    pool, memory = tiered_pool(tmp_path)
    tokens = prompt(6, 2)
    cache_filled(pool, memory, tokens, seed=6)
    settle(pool)
    stats = pool.stats()
    worker = {"instance_id": 0, "kv_tiers": stats["tier_io"], "kv_save_queue": stats["save_queue"]}
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in EngineStatsCollector(lambda: {"workers": [worker]}).collect() for s in family.samples}
    assert samples[("memserve_kv_tier_bytes_used", "disk")] == 2 * BLOCK_NBYTES
    assert samples[("memserve_kv_tier_write_bytes_total", "disk")] == 2 * BLOCK_NBYTES
    assert samples[("memserve_kv_tier_read_bytes_total", "device")] == 2 * BLOCK_NBYTES
    assert samples[("memserve_kv_tier_saving_blocks", "host")] == 0
    assert samples[("memserve_kv_save_queue", None)] == 0
    pool.close()


def test_random_workload_with_saves_in_flight_keeps_every_block_accounted_for(tmp_path):
    """Requests, swaps and deletes while the background saver moves blocks down: after
    each flush every block is indexed or held, and no child sits above its parent."""
    clock = Clock()
    pool, _ = tiered_pool(tmp_path, device=24, host=12, disk_blocks=12, watermark=0.25)
    pool._clock = pool.index._clock = clock  # the workload's clock drives LRU
    for step, running in enumerate(random_workload(pool, clock, seed=5, steps=300)):
        pool.kick_saves()
        if step % 3 == 0:
            pool.flush_saves()
            assert_accounting(pool, running)
    assert_no_leaks(pool)
    io = pool.stats()["tier_io"]
    assert io["host"]["write_bytes"] > 0 and io["disk"]["write_bytes"] > 0
    pool.close()
