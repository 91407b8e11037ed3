"""Eviction policies (``kvcache/eviction.py``) with hand-computed expectations: LRU by
last use, FIFO by caching time, scheduler-aware by the waiting queue's next uses
(blocks no queued request needs first, then the farthest next use), and a
conversation's tail before its prefix under every policy. Then the look-ahead window
(``kvcache/prefetch.py``) over a MemPool: next uses by queue position, prefetch of
disk blocks to the host, parents first, only inside the host's window."""

from __future__ import annotations

import pytest
from helpers.mempool import BS, Clock, make_pool, prompt

from memserve.kvcache.address import Tier, addr_tier
from memserve.kvcache.eviction import FIFO, LRU, SchedulerAware, make_eviction_policy
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.kvcache.prefetch import LookAhead
from memserve.kvcache.radix import RadixIndex

DEVICE = int(Tier.DEVICE)


def index_with_chains(policy, clock: Clock, lengths: dict[str, int]) -> tuple[RadixIndex, dict[str, list]]:
    """One chain per name, cached at times 1, 2, 3, ... in the given order."""
    index = RadixIndex(BS, clock, policy)
    chains = {}
    for i, (name, n) in enumerate(lengths.items()):
        clock.now = i + 1
        hashes = block_hashes(prompt(100 + i, n), BS)
        chains[name] = index.add_chain(None, hashes, [(DEVICE << 40) | (10 * i + k) for k in range(n)])
    return index, chains


def use(index: RadixIndex, clock: Clock, at: float, nodes: list) -> None:
    clock.now = at
    index.lock(nodes)
    index.unlock(nodes)


def names(chains: dict[str, list], nodes: list) -> list[str]:
    where = {id(n): f"{name}{k}" for name, chain in chains.items() for k, n in enumerate(chain)}
    return [where[id(n)] for n in nodes]


def test_policies_are_chosen_by_name():
    assert isinstance(make_eviction_policy("lru"), LRU)
    assert isinstance(make_eviction_policy("fifo"), FIFO)
    assert isinstance(make_eviction_policy("scheduler-aware"), SchedulerAware)
    with pytest.raises(ValueError, match="scheduler-aware"):
        make_eviction_policy("random")


def test_lru_takes_the_least_recently_used_and_fifo_the_first_cached():
    for policy, want in ((LRU(), ["B0", "C0", "A0"]), (FIFO(), ["A0", "B0", "C0"])):
        clock = Clock()
        index, chains = index_with_chains(policy, clock, {"A": 1, "B": 1, "C": 1})
        use(index, clock, 4, chains["A"])  # A: cached first, used last
        assert names(chains, index.select_evictable(DEVICE, 3)) == want, policy.name


def test_a_conversations_tail_goes_before_its_prefix():
    """A three-block conversation older than another: its blocks go deepest first, and
    only then the newer one, under every policy."""
    for policy in (LRU(), FIFO(), SchedulerAware()):
        clock = Clock()
        index, chains = index_with_chains(policy, clock, {"A": 3, "B": 2})
        assert names(chains, index.select_evictable(DEVICE, 4)) == ["A2", "A1", "A0", "B1"], policy.name


def test_scheduler_aware_spares_the_queue_and_evicts_the_farthest_next_use_first():
    """Four one-block conversations used at times 1..4. The queue needs C first, then A:
    B and D (not needed) go first, least recently used first; then A (needed later),
    then C (needed next)."""
    clock = Clock()
    policy = SchedulerAware()
    index, chains = index_with_chains(policy, clock, {"A": 1, "B": 1, "C": 1, "D": 1})
    changed = policy.set_next_use({chains["C"][0].hash: 0, chains["A"][0].hash: 1})
    assert changed == {chains["C"][0].hash, chains["A"][0].hash}
    index.requeue(index.get(h) for h in changed)
    assert names(chains, index.select_evictable(DEVICE, 4)) == ["B0", "D0", "A0", "C0"]


def test_scheduler_aware_follows_the_window_as_it_moves():
    """Priorities change with the queue: the index must list the changed blocks again
    (``requeue``), or a block whose heap entry went stale could never be evicted."""
    clock = Clock()
    policy = SchedulerAware()
    index, chains = index_with_chains(policy, clock, {"A": 1, "B": 1, "C": 1})
    index.requeue(index.get(h) for h in policy.set_next_use({chains["A"][0].hash: 0}))
    index.requeue(index.get(h) for h in policy.set_next_use({chains["B"][0].hash: 0}))  # A ran; B queued now
    assert policy.set_next_use({chains["B"][0].hash: 0}) == set()  # nothing moved: nothing to requeue
    assert names(chains, index.select_evictable(DEVICE, 3)) == ["A0", "C0", "B0"]


# ------------------------------------------------------------- look-ahead window

def cached_on(pool: MemPool, tokens: list[int], tier: Tier) -> list[int]:
    """Cache a prompt straight into ``tier`` (as if it had cascaded there)."""
    addrs = pool.alloc_mem(len(tokens) // BS, tier)
    pool.insert(tokens, addrs, KVFlags.RELEASE)
    return addrs


def tiers_of(pool: MemPool, tokens: list[int]) -> list[Tier]:
    return [addr_tier(a) for a in pool.match(tokens, take_ref=False)]


def lookahead_pool(host: int = 8, disk: int = 16) -> tuple[MemPool, SchedulerAware, LookAhead]:
    policy = SchedulerAware()
    pool = make_pool(device=8, host=host, disk=disk, eviction=policy, clock=Clock(), save_watermark=0.25)
    return pool, policy, LookAhead(pool, policy)


def test_lookahead_ranks_blocks_by_the_first_queued_request_that_reads_them():
    pool, policy, window = lookahead_pool()
    shared = prompt(1, 2)
    first, second = shared + prompt(2, 1), shared + prompt(3, 2)
    cached_on(pool, first, Tier.DEVICE)
    pool.insert(second, pool.match(second) + pool.alloc_mem(2), KVFlags.RELEASE)
    other = prompt(4, 2)
    cached_on(pool, other, Tier.DEVICE)
    window.update([block_hashes(second, BS), block_hashes(first, BS)])
    ranks = [policy.next_use(h) for h in block_hashes(second, BS)] + [policy.next_use(block_hashes(first, BS)[2])]
    assert ranks == [0, 0, 0, 0, 1]  # the shared prefix is next used by the first request
    assert [policy.next_use(h) for h in block_hashes(other, BS)] == [None, None]


def test_lookahead_prefetches_disk_blocks_of_the_window_parents_first():
    pool, _, window = lookahead_pool(host=8)
    queued = prompt(5, 2) + prompt(6, 3)
    cached_on(pool, queued[: 2 * BS], Tier.HOST)
    path = pool.match(queued[: 2 * BS])
    tail = pool.alloc_mem(3, Tier.DISK)
    pool.insert(queued, path + tail, KVFlags.RELEASE)
    assert tiers_of(pool, queued) == [Tier.HOST] * 2 + [Tier.DISK] * 3
    assert window.update([block_hashes(queued, BS)]) == 3  # 8 host blocks - 2 watermark: room for 6
    pool.poll_saves()
    assert tiers_of(pool, queued) == [Tier.HOST] * 5
    io = pool.stats()["tier_io"]
    assert io["host"]["prefetched"] == 3 and io["host"]["prefetch_hits"] == 0
    hit = pool.match(queued)  # the request runs: its blocks come from the host
    assert pool.stats()["tier_io"]["host"]["prefetch_hits"] == 3
    pool.free_mem(hit)


def test_prefetch_stays_within_the_hosts_window():
    """Two queued requests, each with 4 disk blocks; the host (8 blocks, watermark 2) can
    hold 6 for the window: only the first request's blocks come up, and nothing else
    on the host is pushed down for them."""
    pool, _, window = lookahead_pool(host=8)
    first, second = prompt(7, 4), prompt(8, 4)
    for tokens in (first, second):
        cached_on(pool, tokens, Tier.DISK)
    window.update([block_hashes(first, BS), block_hashes(second, BS)])
    pool.poll_saves()
    assert tiers_of(pool, first) == [Tier.HOST] * 4
    assert tiers_of(pool, second) == [Tier.DISK] * 4


def test_a_full_host_saves_its_least_needed_blocks_down_to_make_room():
    pool, policy, window = lookahead_pool(host=8)
    idle = prompt(9, 6)  # fills the host to its watermark; no queued request needs it
    cached_on(pool, idle, Tier.HOST)
    queued = prompt(10, 2)
    cached_on(pool, queued, Tier.DISK)
    assert window.update([block_hashes(queued, BS)]) == 0  # no room yet: two idle blocks go down
    pool.poll_saves()
    assert tiers_of(pool, idle) == [Tier.HOST] * 4 + [Tier.DISK] * 2  # its tail first
    assert window.update([block_hashes(queued, BS)]) == 2
    pool.poll_saves()
    assert tiers_of(pool, queued) == [Tier.HOST] * 2
    assert policy.next_use(block_hashes(queued, BS)[0]) == 0
