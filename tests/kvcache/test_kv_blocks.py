"""Addresses, block names and the per-tier block pool."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash

from memserve.kvcache.address import (
    Tier,
    addr_block,
    addr_instance,
    addr_str,
    addr_tier,
    make_addr,
    make_addrs,
)
from memserve.kvcache.blocks import (
    FREE,
    BlockPool,
    MemPoolError,
    OutOfBlocks,
    contiguous_runs,
)
from memserve.kvcache.hashing import ROOT_SEED, block_hashes

# ------------------------------------------------------------------ addresses


@pytest.mark.parametrize("instance,tier,block", [(0, Tier.DEVICE, 0), (3, Tier.HOST, 17), (1023, Tier.DISK, 2**32 - 1)])
def test_address_round_trip(instance, tier, block):
    a = make_addr(instance, tier, block)
    assert (addr_instance(a), addr_tier(a), addr_block(a)) == (instance, tier, block)
    assert isinstance(addr_tier(a), Tier)
    assert make_addrs(instance, tier, [block]) == [a]


def test_addresses_of_different_places_differ_and_print_readably():
    addrs = {make_addr(i, t, b) for i in range(3) for t in Tier for b in range(4)}
    assert len(addrs) == 3 * len(Tier) * 4
    assert addr_str(make_addr(2, Tier.HOST, 9)) == "i2/HOST/9"


# --------------------------------------------------------------------- names


def test_block_names_are_chained_xxh3_of_little_endian_uint32_tokens():
    tokens = list(range(1000, 1010))
    first = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[:4]), ROOT_SEED)
    second = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[4:8]), first)
    assert block_hashes(tokens, 4) == [first, second]  # the partial block (2 tokens) has no name


def test_names_depend_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parents
    assert len(set(block_hashes(list(range(64)) * 4, 16))) == 16


def test_names_can_be_computed_incrementally():
    tokens = list(range(50_000, 50_100))
    whole = block_hashes(tokens, 8)
    head = block_hashes(tokens[:40], 8)
    tail = block_hashes(tokens[40:], 8, parent=head[-1])
    assert head + tail == whole
    assert block_hashes(array("I", tokens), 8) == whole


def test_names_reject_bad_input():
    assert block_hashes([1, 2, 3], 4) == []
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(OverflowError):
        block_hashes([-1, 2, 3, 4], 4)


# ---------------------------------------------------------------- block pool


def test_alloc_hands_out_ascending_runs_and_free_returns_them():
    pool = BlockPool(8)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 5
    assert all(pool.refcount(b) == 1 for b in a)
    b = pool.alloc(2)
    assert b == [3, 4]
    pool.free(a)
    assert pool.num_free == 6 and pool.refcount(0) == FREE
    assert pool.alloc(3) == [0, 1, 2]  # freed blocks come back in order


def test_alloc_of_too_many_raises_and_allocates_nothing():
    pool = BlockPool(4)
    pool.alloc(3)
    with pytest.raises(OutOfBlocks):
        pool.alloc(2)
    assert pool.num_free == 1
    assert pool.alloc(0) == []
    with pytest.raises(ValueError):
        pool.alloc(-1)


@pytest.mark.parametrize(
    "bad,message",
    [
        ([0, 5], "block 5 is free"),  # never allocated
        ([0, 0], "freed 2 times"),  # twice in one call
        ([0, 99], "out of range"),
        ([0, -1], "out of range"),  # must not wrap around to the last block
        ([0, -9], "out of range"),
    ],
)
def test_free_misuse_raises_and_changes_nothing(bad, message):
    pool = BlockPool(8)
    pool.alloc(2)
    with pytest.raises(MemPoolError, match=message):
        pool.free(bad)
    assert pool.num_free == 6
    assert [pool.refcount(b) for b in range(8)] == [1, 1] + [FREE] * 6
    pool.free([0])  # still usable and consistent
    with pytest.raises(MemPoolError, match="already freed"):
        pool.free([0])


def test_negative_ids_never_reach_a_held_block():
    pool = BlockPool(4)
    ids = pool.alloc(4)
    for op in (pool.free, pool.park, pool.incref):
        with pytest.raises(MemPoolError, match="out of range"):
            op([-5])  # -5 would index block 3 of the padded table
    assert [pool.refcount(b) for b in ids] == [1, 1, 1, 1] and pool.num_free == 0


def test_shared_blocks_are_freed_at_the_last_reference():
    pool = BlockPool(4)
    ids = pool.alloc(2)
    pool.incref(ids)
    pool.free(ids)
    assert pool.num_free == 2 and pool.refcount(ids[0]) == 1
    pool.free([ids[1], ids[0]])
    assert pool.num_free == 4
    with pytest.raises(MemPoolError, match="free"):
        pool.incref(ids)


def test_parked_blocks_belong_to_another_owner_until_released():
    pool = BlockPool(4)
    ids = pool.alloc(3)
    pool.incref(ids[:1])
    assert pool.park(ids) == [2, 1, 1]
    assert pool.num_free == 1 and pool.refcount(ids[0]) == 0
    with pytest.raises(MemPoolError, match="parked"):
        pool.free(ids[:1])
    with pytest.raises(MemPoolError, match="parked"):
        pool.park(ids[:1])
    pool.unpark(ids[:2], [1, 0])  # back to one holder, and free
    assert pool.refcount(ids[0]) == 1 and pool.refcount(ids[1]) == FREE and pool.num_free == 2
    pool.release(ids[2:])
    assert pool.num_free == 3
    with pytest.raises(MemPoolError):
        pool.release(ids[2:])


def test_park_of_a_repeated_or_unheld_id_changes_nothing():
    pool = BlockPool(4)
    ids = pool.alloc(2)
    with pytest.raises(MemPoolError, match="repeated"):
        pool.park([ids[0], ids[1], ids[0]])
    with pytest.raises(MemPoolError, match="free"):
        pool.park([ids[0], 3])
    assert [pool.refcount(b) for b in ids] == [1, 1]


def test_contiguous_runs():
    assert contiguous_runs([]) == []
    assert contiguous_runs([4]) == [(4, 1)]
    assert contiguous_runs([0, 1, 2, 7, 8, 3]) == [(0, 3), (7, 2), (3, 1)]
