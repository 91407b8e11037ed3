"""MemPool: MemServe Table 1 on addresses, with tiers, eviction and events."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mempool import (
    BS,
    Clock,
    NumpyBlockMover,
    assert_accounting,
    cache,
    make_pool,
    prompt,
    random_workload,
)

from memserve.kvcache.address import (
    Tier,
    addr_block,
    addr_instance,
    addr_tier,
    make_addr,
)
from memserve.kvcache.events import MOVED, REMOVED, STORED
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mempool import KVFlags, MemPoolError, OutOfBlocks

# ------------------------------------------------------------------- memory


def test_alloc_and_free_speak_addresses_of_this_instance():
    pool = make_pool(device=8, instance=5)
    addrs = pool.alloc_mem(3)
    assert [(addr_instance(a), addr_tier(a), addr_block(a)) for a in addrs] == [(5, Tier.DEVICE, b) for b in range(3)]
    assert pool.stats()["device"] == {"total": 8, "free": 5, "cached": 0, "evictable": 0, "used": 3}
    pool.free_mem(addrs)
    assert pool.stats()["device"]["free"] == 8


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda a: a + a[:1], "held 1 times, released 2"),
        (lambda a: a[:1] + [make_addr(5, Tier.DEVICE, 7)], "i5/DEVICE/7 is not held"),
        (lambda a: [make_addr(1, Tier.DEVICE, 0)], "belongs to instance 1"),
        (lambda a: a[:1] + [make_addr(5, Tier.HOST, 0)], "not a block of this pool"),
        (lambda a: a[:1] + [make_addr(5, Tier.DEVICE, 40)], "not a block of this pool"),
    ],
)
def test_free_mem_misuse_raises_clearly_and_changes_nothing(bad, message):
    pool = make_pool(device=8, instance=5)
    addrs = pool.alloc_mem(2)
    before = pool.stats()
    with pytest.raises(MemPoolError, match=message):
        pool.free_mem(bad(addrs))
    assert pool.stats() == before
    pool.free_mem(addrs)
    with pytest.raises(MemPoolError, match="already freed"):
        pool.free_mem(addrs[:1])


def test_free_mem_of_indexed_blocks_is_all_or_nothing():
    pool = make_pool(device=8)
    tokens = prompt(1, 2)
    addrs = pool.alloc_mem(3)
    pool.insert(tokens, addrs)  # two indexed, one private
    with pytest.raises(MemPoolError, match="released 2 times"):
        pool.free_mem(addrs + addrs[:1])
    assert pool.stats()["device"]["used"] == 3
    pool.free_mem(addrs)
    assert pool.stats()["device"] == {"total": 8, "free": 6, "cached": 2, "evictable": 2, "used": 0}


def test_out_of_blocks_allocates_nothing():
    pool = make_pool(device=4)
    held = pool.alloc_mem(3)
    assert pool.can_alloc(1) and not pool.can_alloc(2) and not pool.can_alloc(1, Tier.HOST)
    with pytest.raises(OutOfBlocks):
        pool.alloc_mem(2)
    with pytest.raises(MemPoolError, match="no HOST tier"):
        pool.alloc_mem(1, Tier.HOST)
    assert pool.stats()["device"]["free"] == 1
    pool.free_mem(held)


# -------------------------------------------------------------------- index


def test_insert_then_match_shares_blocks_with_references():
    pool = make_pool(device=16)
    tokens = prompt(1, 3) + [7, 7]  # 3 full blocks and a partial one
    addrs = pool.alloc_mem(4)
    assert pool.insert(tokens, addrs) == 3
    [stored] = pool.drain_events()
    assert (stored.type, stored.hashes, stored.parent, stored.addrs) == (STORED, block_hashes(tokens, BS), None, addrs[:3])
    assert pool.insert(tokens, addrs) == 0 and pool.drain_events() == []
    pool.free_mem(addrs)
    assert pool.stats()["device"]["evictable"] == 3 and pool.stats()["device"]["free"] == 13
    hit = pool.match(tokens + [1, 2, 3])
    assert hit == addrs[:3]
    assert pool.stats()["device"]["evictable"] == 0
    pool.free_mem(hit)
    with pytest.raises(MemPoolError, match="not held"):
        pool.free_mem(hit[:1])
    assert pool.match(tokens, take_ref=False) == addrs[:3]
    assert pool.stats()["device"]["evictable"] == 3  # a peek takes nothing


def test_match_of_an_empty_or_short_prompt_is_empty():
    pool = make_pool()
    cache(pool, prompt(1, 2))
    assert pool.match([]) == []
    assert pool.match([1, 2, 3]) == []
    assert pool.stats()["query_tokens"] == 3


def test_insert_keeps_the_existing_copy_of_a_known_block():
    pool = make_pool(device=16)
    tokens = prompt(2, 4)
    first = cache(pool, tokens[: 2 * BS])  # blocks 0-1 cached
    mine = pool.alloc_mem(4)  # a second request computed all four itself
    assert pool.insert(tokens, mine) == 2
    assert pool.match(tokens, take_ref=False) == first + mine[2:]
    pool.free_mem(mine)  # its copies of blocks 0-1 were private: they go back to the free list
    assert pool.stats()["device"] == {"total": 16, "free": 12, "cached": 4, "evictable": 4, "used": 0}


def test_insert_rejects_blocks_the_caller_does_not_hold():
    pool = make_pool(device=16)
    cached = cache(pool, prompt(1, 2))
    with pytest.raises(MemPoolError, match="held by the caller"):
        pool.insert(prompt(3, 2), cached)  # indexed as other blocks
    freed = pool.alloc_mem(1)
    pool.free_mem(freed)
    with pytest.raises(MemPoolError, match="held by the caller"):
        pool.insert(prompt(4, 1), freed)
    assert len(pool.index) == 2


def test_hit_rate_counts_lookups_that_take_references():
    pool = make_pool()
    tokens = prompt(3, 2)
    cache(pool, tokens)
    pool.free_mem(pool.match(tokens + prompt(4, 2)))
    pool.match(tokens, take_ref=False)
    stats = pool.stats()
    assert (stats["hit_tokens"], stats["query_tokens"], stats["hit_rate"]) == (8, 16, 0.5)


def test_caching_disabled_indexes_nothing():
    pool = make_pool(enable_caching=False)
    tokens = prompt(1, 2)
    addrs = pool.alloc_mem(2)
    assert pool.insert(tokens, addrs, KVFlags.RELEASE) == 0
    assert pool.match(tokens) == [] and pool.drain_events() == []
    assert pool.stats()["device"]["free"] == 16


def test_delete_drops_only_the_prompts_own_blocks():
    pool = make_pool()
    base = prompt(1, 2)
    cache(pool, base + prompt(2, 2))
    cache(pool, base + prompt(3, 1))
    pool.drain_events()
    assert pool.delete(base + prompt(2, 2)) == 2
    assert pool.match(base, take_ref=False) != []
    assert pool.stats()["device"]["free"] == 16 - 3
    [event] = pool.drain_events()
    assert event.type == REMOVED and len(event.hashes) == 2


# ----------------------------------------------------------------- eviction


def test_alloc_evicts_least_recently_used_cached_blocks():
    clock = Clock()
    pool = make_pool(device=8, clock=clock)
    old, new = prompt(1, 3), prompt(2, 3)
    cache(pool, old)
    clock.now = 1
    cache(pool, new)
    clock.now = 2
    pool.free_mem(pool.match(old))  # used again: now the newer one
    pool.drain_events()
    addrs = pool.alloc_mem(4)  # 2 free + 2 evicted
    assert len(pool.match(new, take_ref=False)) == 1  # lost its two deepest blocks
    assert len(pool.match(old, take_ref=False)) == 3
    [event] = pool.drain_events()
    assert event.type == REMOVED and len(event.hashes) == 2
    with pytest.raises(OutOfBlocks):
        pool.alloc_mem(5)  # 0 free, 4 evictable
    assert len(pool.index) == 4 and pool.can_alloc(4)
    pool.free_mem(addrs)


def test_blocks_in_use_are_never_evicted():
    pool = make_pool(device=6)
    tokens = prompt(1, 3)
    cache(pool, tokens)
    held = pool.match(tokens)
    with pytest.raises(OutOfBlocks):
        pool.alloc_mem(4)
    assert pool.match(tokens, take_ref=False) == held
    pool.free_mem(held)
    pool.alloc_mem(6)
    assert pool.match(tokens, take_ref=False) == []


def test_eviction_demotes_to_slower_tiers_before_dropping():
    pool = make_pool(device=4, host=2)
    mover: NumpyBlockMover = pool.mover  # type: ignore[assignment]
    tokens = prompt(1, 4)
    addrs = cache(pool, tokens)
    mover.fill(Tier.DEVICE, [addr_block(a) for a in addrs], seed=1)
    want = mover.get(addrs)
    pool.drain_events()
    pool.free_mem(pool.alloc_mem(2))  # the two deepest blocks go to the host
    hit = pool.match(tokens, take_ref=False)
    assert [addr_tier(a) for a in hit] == [Tier.DEVICE] * 2 + [Tier.HOST] * 2
    assert mover.get(hit) == want
    pool.alloc_mem(4)  # host full: its LRU blocks make room by being dropped
    assert [addr_tier(a) for a in pool.match(tokens, take_ref=False)] == [Tier.HOST] * 2
    assert [e.type for e in pool.drain_events()] == [MOVED, REMOVED, MOVED]


def test_swap_out_and_swap_in_move_bytes_and_re_point_the_index():
    pool = make_pool(device=8, host=8)
    mover: NumpyBlockMover = pool.mover  # type: ignore[assignment]
    tokens = prompt(5, 3)
    addrs = cache(pool, tokens)
    mover.fill(Tier.DEVICE, [addr_block(a) for a in addrs], seed=5)
    want = mover.get(addrs)
    pool.drain_events()
    moved = pool.swap_out(10)  # only three are cached
    assert [old for old, _ in moved] == addrs[::-1]  # deepest first
    assert all(addr_tier(new) == Tier.HOST for _, new in moved)
    assert pool.stats()["device"]["free"] == 8 and pool.stats()["host"]["cached"] == 3
    hit = pool.match(tokens)
    assert mover.get(hit) == want and all(addr_tier(a) == Tier.HOST for a in hit)
    with pytest.raises(MemPoolError, match="parent block is not on the device"):
        pool.swap_in(hit[1:])
    back = pool.swap_in(hit)
    assert mover.get(back) == want
    assert pool.match(tokens, take_ref=False) == back
    pool.free_mem(hit)  # the old host copies were private to us: now free
    assert pool.stats()["host"] == {"total": 8, "free": 8, "cached": 0, "evictable": 0, "used": 0}
    pool.free_mem(back)
    assert pool.stats()["device"]["evictable"] == 3
    assert [e.type for e in pool.drain_events()] == [MOVED, MOVED]


def test_swap_in_of_private_host_blocks_for_a_preempted_request():
    pool = make_pool(device=4, host=4)
    mover: NumpyBlockMover = pool.mover  # type: ignore[assignment]
    host = pool.alloc_mem(2, Tier.HOST)
    mover.fill(Tier.HOST, [addr_block(a) for a in host], seed=9)
    device = pool.swap_in(host)
    assert mover.get(device) == mover.get(host)
    pool.free_mem(host + device)
    with pytest.raises(MemPoolError, match="not held"):
        pool.swap_in(host)
    with pytest.raises(MemPoolError, match="already on the device"):
        pool.swap_in(pool.alloc_mem(1))


def test_write_blocks_recuts_the_senders_runs_into_ours():
    pool = make_pool(device=8, host=4)
    mover: NumpyBlockMover = pool.mover  # type: ignore[assignment]
    held = pool.alloc_mem(6) + pool.alloc_mem(2, Tier.HOST)
    pool.free_mem(held[1:4])
    dst = [held[0], held[4], held[5], held[6], held[7]]  # runs: [0] [4 5] | host [0 1]
    data = np.random.default_rng(0).integers(0, 256, 5 * mover.block_nbytes, dtype=np.uint8).tobytes()
    sender_runs = [data[:40], data[40:70], data[70:]]  # cut anywhere, even inside a block
    pool.write_blocks(dst, sender_runs)
    assert mover.get(dst) == data
    with pytest.raises(MemPoolError, match="bytes expected"):
        pool.write_blocks(dst, [data[:-1]])


def test_swaps_need_a_host_tier_and_a_mover():
    with pytest.raises(MemPoolError, match="no HOST tier"):
        make_pool().swap_out(1)
    with pytest.raises(MemPoolError, match="needs a BlockMover"):
        make_pool(host=4, mover=None).swap_out(1)


def test_no_block_is_indexed_below_a_parent_on_a_slower_tier():
    pool = make_pool(device=8, host=8)
    tokens = prompt(6, 3)
    cache(pool, tokens[: 2 * BS])
    pool.swap_out(2)
    addrs = pool.alloc_mem(3)
    assert pool.insert(tokens, addrs, KVFlags.RELEASE) == 0
    assert len(pool.match(tokens, take_ref=False)) == 2


def test_random_workload_keeps_every_block_accounted_for():
    clock = Clock()
    pool = make_pool(device=24, host=12, disk=12, clock=clock)
    for running in random_workload(pool, clock, seed=3, steps=400):
        assert_accounting(pool, running)
    stats = pool.stats()
    for t in ("device", "host", "disk"):
        assert stats[t]["used"] == 0 and stats[t]["free"] + stats[t]["cached"] == stats[t]["total"]
        assert stats[t]["cached"] > 0


