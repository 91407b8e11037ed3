"""The scheduler's look-ahead window over a MemPool: scheduler-aware fetching from disk to
host (AttentionStore §3.3.1) and the next uses that scheduler-aware eviction ranks by
(§3.3.2, ``eviction.SchedulerAware``).

The job queue is the worker's waiting queue, in the order its scheduling policy admits.
Routing hints from the gateway need no message of their own: the gateway routes a
request and sends its ``AddRequest`` at once (it holds nothing back; admission rejects
instead of queueing), so every request routed to this worker is in the waiting queue
from the moment it was routed, and the window sees it there.

After each engine step ``update`` walks the queued requests' cached prefixes in order:

- *eviction window*: the leading requests whose cached prefixes fit the whole cache
  ((C_mem + C_disk) / S_kv in the paper; here every tier's blocks). Each of their blocks
  gets as next use the queue position of the first request that reads it; the index
  requeues the blocks whose priority changed.
- *prefetch window*: the leading requests whose blocks outside the device fit the host
  tier less its watermark (C_mem / S_kv). Their disk blocks are copied up through the
  saver (asynchronously: a step never waits), parents first. When the host has no room,
  its least valuable blocks (outside the window first) are saved down to disk to make
  it: the paper's host buffer, refilled by eviction.

The walk costs a lookup per queued block, so it runs only when the queue changed (the
caller's ``queue_version``) or prefetches are still owed: between, the ranks stay right
(a block keeps its name across tier moves; new blocks belong to running requests).

Pure Python, no clock: it only reads the index and starts tier moves."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memserve.kvcache.address import Tier
from memserve.kvcache.eviction import SchedulerAware
from memserve.kvcache.mempool import MemPool
from memserve.kvcache.radix import RadixNode


class LookAhead:
    def __init__(self, mempool: MemPool, policy: SchedulerAware) -> None:
        self.mempool = mempool
        self.policy = policy
        stats = mempool.stats()
        self.capacity = sum(stats[t.name.lower()]["total"] for t in mempool.tiers)  # the eviction window's limit
        self.host_window = mempool.prefetch_window()
        self._seen_version: object = None
        self._owed = False  # the last walk left window blocks on disk

    def update(self, waiting: Iterable[Sequence[int]], queue_version: object = None) -> int:
        """``waiting``: the block names of each queued request's prompt, in the order the
        requests will run (consumed only as far as the window reaches). Returns how many
        blocks started moving up from disk. With a ``queue_version`` equal to the last
        one's and no prefetch owed, nothing is done."""
        if queue_version is not None and queue_version == self._seen_version and not self._owed:
            return 0
        self._seen_version = queue_version
        index = self.mempool.index
        next_use: dict[int, int] = {}
        fetch: list[RadixNode] = []
        seen = 0  # blocks of the eviction window
        claimed = 0  # blocks outside the device claimed by the prefetch window
        prefetching = self.host_window > 0
        for rank, hashes in enumerate(waiting):
            nodes = index.match_hashes(hashes)
            fresh = [n for n in nodes if n.hash not in next_use]
            seen += len(fresh)
            if seen > self.capacity:
                break
            for n in fresh:
                next_use[n.hash] = rank
            if prefetching:
                slow = [n for n in fresh if n.tier != Tier.DEVICE]
                claimed += len(slow)
                if claimed > self.host_window:
                    prefetching = False
                else:
                    fetch += [n for n in slow if n.tier == Tier.DISK and n.idle]
        changed = self.policy.set_next_use(next_use)
        if changed:
            index.requeue(node for node in map(index.get, changed) if node is not None)
        if not fetch:
            self._owed = False
            return 0
        short = len(fetch) - self.mempool.prefetch_room()
        if short > 0:
            self.mempool.demote(Tier.HOST, short)
        started = self.mempool.prefetch(fetch)
        self._owed = started < len(fetch)
        return started
