"""Eviction policies: which idle cached block a tier gives up first.

The radix index keeps, per tier, a heap of the idle blocks that can go without breaking
the tree (its frontier) ordered by ``policy.priority(node)``, lowest first; the policy
is injected, the way SGLang's radix cache takes an eviction strategy, so tiers and the
simulator can compare policies without touching the index. A priority is read when a
node joins the heap and checked again when it leaves it, so a policy whose priorities
change must only depend on what the node records (its last access, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from memserve.registry import make

if TYPE_CHECKING:
    from memserve.kvcache.radix import RadixNode


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: RadixNode) -> float:
        """Lower goes first."""
        ...


class LRU:
    """Least recently used first (the time the node was last released or matched)."""

    name = "lru"

    def priority(self, node: RadixNode) -> float:
        return node.last_access


EVICTION_POLICIES: dict[str, type] = {"lru": LRU}


def make_eviction_policy(name: str) -> EvictionPolicy:
    return make(EVICTION_POLICIES, name, "eviction policy")
