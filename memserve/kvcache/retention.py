"""Retention of cached conversations (``--cache-ttl``): a cached block nobody used for
the TTL is dropped from whichever tier holds it, as AttentionStore §4.3.5 keeps each
session's KV for a TTL since its last access. Capacity still evicts earlier; the TTL
bounds how long idle KV (and its disk files) outlive their conversation.

A request may ask for its own conversation to be kept longer (``cache_ttl_s`` in the
body): its blocks then expire after the longer of the two. Expiry never shortens the
server's TTL and never touches blocks in use, nor blocks a request pinned
(``pinning.py``: they expire with their pin, then age from their last use).

Expired blocks leave whole subtrees at a time (a child never outlives its parent in the
index), through ``MemPool.drop``: the gateway's mirrors get REMOVED events and disk
files are deleted. Sweeps run every sixteenth of the TTL on the injected clock, so a
block goes at most that late."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from memserve.kvcache.mempool import MemPool
from memserve.kvcache.radix import RadixNode


class Retention:
    def __init__(self, mempool: MemPool, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a cache TTL must be positive, got {ttl_s}")
        self.mempool = mempool
        self.ttl_s = ttl_s
        self.clock = clock
        self._extended: dict[int, float] = {}  # block name -> a longer TTL a request asked for
        self._next_sweep = clock() + ttl_s / 16
        self.num_expired = 0

    def extend(self, hashes: Iterable[int], ttl_s: float) -> None:
        """Keep these blocks at least ``ttl_s`` after their last use."""
        if ttl_s <= self.ttl_s:
            return
        ext = self._extended
        for h in hashes:
            if ext.get(h, 0.0) < ttl_s:
                ext[h] = ttl_s

    def ttl_of(self, node: RadixNode) -> float:
        return self._extended.get(node.hash, self.ttl_s)

    def sweep(self, force: bool = False) -> int:
        """Drop the expired idle blocks when a sweep is due; returns how many went."""
        now = self.clock()
        if not force and now < self._next_sweep:
            return 0
        self._next_sweep = now + self.ttl_s / 16
        index = self.mempool.index
        pins = self.mempool.pins
        expired = {n for n in index.nodes()
                   if n.idle and now - n.last_access > self.ttl_of(n) and (pins is None or n.hash not in pins)}
        dropped = 0
        for node in expired:
            if node.parent in expired or node.parent is None:
                continue  # goes with its parent's subtree (or already went)
            if all(n in expired for n in _subtree(node)):
                dropped += self.mempool.drop(node)
        if self._extended:
            self._extended = {h: t for h, t in self._extended.items() if h in index}
        self.num_expired += dropped
        return dropped


def _subtree(node: RadixNode) -> list[RadixNode]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out
