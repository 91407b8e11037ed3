"""A MemPool over numpy device/host tiers, a real disk store and a background saver, and the checks that go with it."""

from __future__ import annotations

import threading

from helpers.mempool import (
    BS,
    NumpyBlockMover,
)
from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.disk_store import HEADER_NBYTES, DiskStore
from memserve.kvcache.mempool import KVFlags, MemPool
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
                instance=0, max_pinned_fraction=0.0) -> tuple[MemPool, NumpyBlockMover]:
    """A MemPool with numpy device/host tiers, a real disk store and a background saver."""
    memory = NumpyBlockMover({Tier.DEVICE: device, Tier.HOST: host}, BLOCK_NBYTES)
    store = DiskStore(tmp_path, disk_blocks * (BLOCK_NBYTES + HEADER_NBYTES), BLOCK_NBYTES, fingerprint=1234)
    mover = TieredMover(memory, store)
    saver_mover = SlowMover(mover, slow) if slow is not None else mover
    tiers = {Tier.DEVICE: device, Tier.HOST: host, Tier.DISK: store.num_blocks}
    pool = MemPool(instance, tiers, BS, mover=mover, saver=ThreadSaver(saver_mover), disk=store,
                   save_watermark=watermark, max_pinned_fraction=max_pinned_fraction)
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
