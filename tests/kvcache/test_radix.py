"""The radix index: matching, locks, LRU eviction order, tiers."""

from __future__ import annotations

import random

import pytest

from memserve.kvcache.address import Tier, make_addr
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.radix import RadixIndex, RadixNode

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def new_index() -> tuple[RadixIndex, Clock]:
    clock = Clock()
    return RadixIndex(BS, clock), clock


def add(index: RadixIndex, tokens: list[int], tier: Tier = Tier.DEVICE, lock: int = 0, first_block: int = 0) -> list[RadixNode]:
    """Index the blocks of ``tokens`` not yet indexed, at made-up block ids."""
    hashes = block_hashes(tokens, BS)
    start = index.known_prefix(hashes)
    parent = hashes[start - 1] if start else None
    addrs = [make_addr(0, tier, first_block + i) for i in range(start, len(hashes))]
    return index.add_chain(parent, hashes[start:], addrs, [lock] * len(addrs))


def brute_idle(index: RadixIndex, tier: Tier) -> int:
    def busy(n: RadixNode) -> bool:
        return n.lock > 0 or any(busy(c) for c in n.children.values())

    return sum(1 for n in index.nodes() if n.tier == tier and not busy(n))


def test_match_returns_the_longest_cached_prefix_of_full_blocks():
    index, _ = new_index()
    prompt = list(range(100, 120))  # 5 blocks
    created = add(index, prompt)
    assert len(created) == 5 and len(index) == 5
    assert index.match(prompt) == created
    assert index.match(prompt[:11]) == created[:2]  # partial third block does not count
    assert index.match(prompt[:8] + [0, 0, 0, 0] + prompt[12:]) == created[:2]
    assert index.match([]) == [] and index.match(prompt[:3]) == []
    assert index.match_hashes(block_hashes(prompt, BS)) == created


@pytest.mark.parametrize("miss_at", [0, 15, 16, 17, 47, 48, 100, 200])
def test_match_across_hashing_chunks_agrees_with_a_full_walk(miss_at):
    index, _ = new_index()
    prompt = [random.Random(miss_at).randrange(50_000) for _ in range(200 * BS)]
    add(index, prompt[: miss_at * BS])
    assert len(index.match(prompt)) == miss_at
    assert len(index.match_hashes(block_hashes(prompt, BS))) == miss_at


def test_shared_prefixes_form_a_tree():
    index, _ = new_index()
    a = add(index, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    b = add(index, [1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4], first_block=10)
    assert len(b) == 1 and b[0].parent is a[1]
    assert set(a[1].children.values()) == {a[2], b[0]}
    assert index.entries() == {(n.hash, n.parent.hash, 0) for n in a + b}
    assert index.entries() >= {(a[0].hash, None, 0)}


def test_add_chain_rejects_unknown_parents_and_known_blocks():
    index, _ = new_index()
    created = add(index, list(range(8)))
    with pytest.raises(ValueError, match="not indexed"):
        index.add_chain(12345, [1], [0])
    with pytest.raises(ValueError, match="already indexed"):
        index.add_chain(None, [created[0].hash], [make_addr(0, 0, 9)])


def test_locks_make_a_node_and_its_ancestors_busy():
    index, _ = new_index()
    chain = add(index, list(range(16)))
    other = add(index, list(range(8)) + [9] * 8, first_block=10)  # branches after block 1
    assert index.idle_count(Tier.DEVICE) == 6
    index.lock([chain[3]])
    assert [n.idle for n in chain] == [False] * 4
    assert all(n.idle for n in other)
    assert index.idle_count(Tier.DEVICE) == 2 == brute_idle(index, Tier.DEVICE)
    index.lock([chain[1], chain[3]])
    index.unlock([chain[3], chain[3]])
    assert index.idle_count(Tier.DEVICE) == 4 == brute_idle(index, Tier.DEVICE)
    index.unlock([chain[1]])
    assert index.idle_count(Tier.DEVICE) == 6


def test_unlock_misuse_raises_and_changes_nothing():
    index, _ = new_index()
    chain = add(index, list(range(12)), lock=1)
    with pytest.raises(MemPoolError, match="not held"):
        index.unlock([chain[0], chain[1], chain[1]])
    assert [n.lock for n in chain] == [1, 1, 1]
    assert index.idle_count(Tier.DEVICE) == 0
    index.unlock(chain)
    with pytest.raises(MemPoolError, match="not held"):
        index.unlock(chain[:1])


def test_eviction_is_lru_and_deepest_first():
    index, clock = new_index()
    old = add(index, [1] * 12, lock=1)
    new = add(index, [2] * 12, lock=1, first_block=10)
    clock.now = 1
    index.unlock(new)  # released first ...
    clock.now = 2
    index.unlock(old)  # ... so older than `old`
    picked = index.select_evictable(Tier.DEVICE, 4)
    assert picked == [new[2], new[1], new[0], old[2]]
    for n in picked:
        index.remove(n)
    assert index.match([1] * 12) == old[:2]


class MostRecentlyUsed:
    """A policy unlike the default, to show the index takes whatever it is given."""

    name = "mru"

    def priority(self, node: RadixNode) -> float:
        return -node.last_access


def test_the_eviction_policy_is_injected():
    clock = Clock()
    index = RadixIndex(BS, clock, MostRecentlyUsed())
    old = add(index, [1] * 12, lock=1)
    new = add(index, [2] * 12, lock=1, first_block=10)
    clock.now = 1
    index.unlock(new)
    clock.now = 2
    index.unlock(old)
    assert index.select_evictable(Tier.DEVICE, 4) == [old[2], old[1], old[0], new[2]]


def test_a_locked_descendant_protects_its_ancestors_from_eviction():
    index, clock = new_index()
    trunk = add(index, [5] * 8)  # idle, older
    clock.now = 1
    leaf = add(index, [5] * 8 + [6] * 4, lock=1, first_block=10)
    other = add(index, [7] * 4, first_block=20)
    assert index.idle_count(Tier.DEVICE) == 1
    assert index.select_evictable(Tier.DEVICE, 1) == other
    with pytest.raises(MemPoolError, match="only 1 idle"):
        index.select_evictable(Tier.DEVICE, 2)
    with pytest.raises(MemPoolError, match="idle leaves"):
        index.remove(trunk[1])
    with pytest.raises(MemPoolError, match="in use"):
        index.remove_subtree(trunk[0])
    assert leaf[0].parent is trunk[1]


def test_delete_removes_only_what_the_prompt_alone_uses():
    index, _ = new_index()
    shared = add(index, [1] * 8)
    mine = add(index, [1] * 8 + [2] * 8, first_block=10)
    theirs = add(index, [1] * 8 + [3] * 4, first_block=20)
    assert index.delete([1] * 8) == []  # a prefix of other cached prompts
    assert index.delete([1] * 8 + [2] * 8) == [mine[1], mine[0]]
    assert index.match([1] * 8 + [3] * 4) == shared + theirs
    index.lock(theirs)
    assert index.delete([1] * 8 + [3] * 4) == []


def test_moves_between_tiers_keep_counts_and_frontiers_per_tier():
    index, _ = new_index()
    chain = add(index, list(range(12)))
    index.move(chain[2], make_addr(0, Tier.HOST, 0))
    assert chain[2].tier == Tier.HOST and chain[2].block == 0
    assert index.cached_count(Tier.DEVICE) == 2 and index.cached_count(Tier.HOST) == 1
    assert index.idle_count(Tier.DEVICE) == 2 and index.idle_count(Tier.HOST) == 1
    # chain[1] has no device child any more: it is the device tier's first victim.
    assert index.select_evictable(Tier.DEVICE, 2) == [chain[1], chain[0]]
    assert index.select_evictable(Tier.HOST, 1) == [chain[2]]
    index.lock([chain[2]])
    index.move(chain[2], make_addr(0, Tier.DEVICE, 7), lock=1)
    assert index.cached_count(Tier.HOST) == 0 and index.idle_count(Tier.DEVICE) == 0
    with pytest.raises(MemPoolError):
        index.move(chain[0], make_addr(0, Tier.HOST, 3), lock=1)  # not locked: nobody to hand over


def test_idle_counts_and_eviction_order_survive_random_operations():
    rng = random.Random(7)
    index, clock = new_index()
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(4, 40))] for _ in range(60)]
    locked: list[RadixNode] = []
    next_block = 0
    for step in range(600):
        clock.now = step
        op = rng.random()
        if op < 0.35:
            nodes = add(index, rng.choice(prompts), lock=rng.randrange(2), first_block=next_block)
            next_block += len(nodes)
            locked += [n for n in nodes if n.lock]
        elif op < 0.55:
            nodes = index.match(rng.choice(prompts))
            index.lock(nodes)
            locked += nodes
        elif op < 0.75 and locked:
            rng.shuffle(locked)
            k = rng.randrange(1, len(locked) + 1)
            index.unlock(locked[:k])
            del locked[:k]
        elif index.idle_count(Tier.DEVICE):
            n = rng.randrange(1, index.idle_count(Tier.DEVICE) + 1)
            leaves = {node for node in index.nodes() if node.idle and not node.children}
            picked = index.select_evictable(Tier.DEVICE, n)
            assert len(set(picked)) == n and all(p.idle for p in picked)
            for p in picked:
                index.remove(p)  # raises unless p is a leaf by then: deepest first
            # LRU: every idle leaf taken was released no later than every idle leaf left
            taken, left = leaves & set(picked), leaves - set(picked)
            if taken and left:
                assert max(p.last_access for p in taken) <= min(p.last_access for p in left)
        assert index.idle_count(Tier.DEVICE) == brute_idle(index, Tier.DEVICE)
        assert index.cached_count(Tier.DEVICE) == len(index)
