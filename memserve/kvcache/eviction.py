"""Eviction policies: which idle cached block a tier gives up first.

The radix index keeps, per tier, a heap of the idle blocks that can go without breaking
the tree (its frontier) ordered by ``policy.priority(node)``, lowest first; the policy
is injected, the way SGLang's radix cache takes an eviction strategy, so tiers and the
simulator can compare policies without touching the index. A priority is read when a
node joins the heap and checked again when it leaves it: a policy whose priorities
change for other reasons than what the node records (its last access, ...) must hand
the nodes concerned to ``RadixIndex.requeue`` (``SchedulerAware`` does, through
``prefetch.LookAhead``).

Policies (``--eviction-policy``), after AttentionStore §4.3.3's comparison:
``lru`` (least recently used), ``fifo`` (first cached, first out) and
``scheduler-aware`` (§3.3.2: the blocks that queued requests need go last, the farthest
next use first). In every policy a conversation's tail goes before its prefix: the index
only offers frontier blocks (no child in the tier), so a chain is shed from its end and a
shorter cached prefix stays usable."""

from __future__ import annotations

from typing import Protocol

from memserve.registry import make

#: Lower goes first; one policy's priorities must compare with each other.
Priority = float | tuple[float, float] | tuple[bool, "Priority"]  # the last: pinning.PinnedLast's


class CachedBlock(Protocol):
    """What a policy reads of a cached block (``radix.RadixNode`` is one)."""

    @property
    def hash(self) -> int: ...

    @property
    def last_access(self) -> float: ...

    @property
    def born(self) -> float: ...


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: CachedBlock) -> Priority:
        """Lower goes first."""
        ...


class LRU:
    """Least recently used first (the time the node was last released or matched)."""

    name = "lru"

    def priority(self, node: CachedBlock) -> float:
        return node.last_access


class FIFO:
    """First cached, first out (the time the block entered the cache), whatever its use:
    AttentionStore's second history-only baseline."""

    name = "fifo"

    def priority(self, node: CachedBlock) -> float:
        return node.born


class SchedulerAware:
    """AttentionStore §3.3.2: use the future the scheduler already knows. The waiting
    queue's look-ahead window (``prefetch.LookAhead``) tells this policy, for each
    cached block a queued request will read, the queue position of the first such
    request (its next use). Blocks no queued request needs go first, least recently
    used first; then the blocks of the window, the farthest next use first, so the
    request about to run keeps its KV the longest."""

    name = "scheduler-aware"

    def __init__(self) -> None:
        self._next_use: dict[int, int] = {}  # block name -> queue position of its next use

    def priority(self, node: CachedBlock) -> tuple[float, float]:
        rank = self._next_use.get(node.hash)
        return (0, node.last_access) if rank is None else (1, -rank)

    def next_use(self, block_hash: int) -> int | None:
        return self._next_use.get(block_hash)

    def set_next_use(self, next_use: dict[int, int]) -> set[int]:
        """Replace the window's next uses; returns the names whose priority changed
        (their nodes must be requeued in the index)."""
        old, self._next_use = self._next_use, next_use
        if old == next_use:
            return set()
        return {h for h in old.keys() | next_use.keys() if old.get(h) != next_use.get(h)}


EVICTION_POLICIES: dict[str, type] = {"lru": LRU, "fifo": FIFO, "scheduler-aware": SchedulerAware}


def make_eviction_policy(name: str) -> EvictionPolicy:
    return make(EVICTION_POLICIES, name, "eviction policy")
