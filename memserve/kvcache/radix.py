"""Radix index of cached prompts: token-based, block-granular (MemServe §4.2).

A node stands for one full block of some cached prompt and is named by the block's
chained hash (``hashing.block_hashes``). Because a name fixes the whole prefix, the tree
is kept as one dict ``name -> node`` plus parent/children links: matching a prompt walks
the dict block by block, and hashing stops at the first miss (names are computed in
growing chunks), so a prompt that shares nothing costs one chunk of hashing, not the
whole prompt.

Each node carries the address of its block (instance, tier, block: ``address.py``), so
the same tree indexes device, host and disk blocks and, in the gateway's mirrors, blocks
of other instances.

Locks and eviction. ``lock`` counts the references running requests hold on the node's
block. A node is *busy* while it or any descendant is locked (``busy_children`` counts
busy children; the state propagates up only on transitions, so locking a chain costs
O(1) per node). Idle nodes are what a tier can give up; per tier the index keeps their
count (exact, so the scheduler can ask "can I allocate n?") and a lazy heap of its
*frontier* (idle nodes with no child in the same tier) ordered by the injected eviction
policy (``eviction.py``; LRU by default). Evicting frontier nodes first
keeps the tree a tree (a parent never goes before its children) and, with the MemPool's
rule that children live in the same or a slower tier than their parent, lets a tier
shed its blocks one level at a time: device -> host -> disk -> dropped.

The clock is injected (any callable returning a number); by default a logical counter.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from types import MappingProxyType
from typing import cast

from memserve.kvcache.address import Tier, addr_block, addr_instance, addr_str, addr_tier
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.eviction import LRU, EvictionPolicy, Priority
from memserve.kvcache.hashing import block_hashes

# Shared by every leaf until it gets a child (then a dict of its own replaces it): typed as
# the dict it stands in for, read-only so that a write to it raises.
_NO_CHILDREN = cast("dict[int, RadixNode]", MappingProxyType({}))
_FIRST_CHUNK_BLOCKS = 16  # match hashes 16 blocks, then 32, 64, ... until the first miss
_NUM_TIERS = len(Tier)


class TreeNode:
    """A place in the prefix tree: the index's root, or a cached block (``RadixNode``)."""

    __slots__ = ("hash", "parent", "children", "addr", "tier", "lock", "busy_children", "last_access", "born")

    hash: int | None  # the block's name; None for the root, which names no block
    parent: TreeNode | None  # None for the root and for a node taken out of the tree
    children: dict[int, RadixNode]
    # ``addr_tier(addr)``, set with ``addr`` (here and in ``RadixIndex.move``): the index's
    # loops over many nodes read it instead of decoding the address. The root has none.
    tier: Tier

    def __init__(self, block_hash: int | None, parent: TreeNode | None, addr: int, tier: Tier | None, lock: int,
                 busy_children: int, now: float) -> None:
        self.hash = block_hash
        self.parent = parent
        self.children = _NO_CHILDREN
        self.addr = addr
        if tier is not None:
            self.tier = tier
        self.lock = lock
        self.busy_children = busy_children
        self.last_access = now
        self.born = now  # when the block entered the cache (FIFO eviction)

    @property
    def block(self) -> int:
        return addr_block(self.addr)

    @property
    def instance(self) -> int:
        return addr_instance(self.addr)

    @property
    def idle(self) -> bool:
        return self.lock == 0 and self.busy_children == 0

    def __repr__(self) -> str:
        return f"RadixNode({self.hash:#x} @ {addr_str(self.addr)}, lock={self.lock})"


class RadixNode(TreeNode):
    """One cached full block."""

    __slots__ = ()

    hash: int


class RadixIndex:
    """Prefix tree of cached blocks, shared by the worker's MemPool and the gateway."""

    def __init__(self, block_size: int, clock: Callable[[], float] | None = None,
                 eviction: EvictionPolicy | None = None, evicts: bool = True) -> None:
        """``evicts=False``: an index that never gives up blocks on its own (a gateway
        mirror replays its worker's) keeps no eviction order, so ``select_evictable`` is
        not for it."""
        self.block_size = block_size
        self._evicts = evicts
        self._clock = clock if clock is not None else itertools.count().__next__
        self._eviction = eviction if eviction is not None else LRU()
        # The root is locked for good, so busy/idle propagation stops below it.
        self.root = TreeNode(None, None, -1, None, 1, 0, 0)
        self._nodes: dict[int, RadixNode] = {}
        self._count = [0] * _NUM_TIERS
        self._idle = [0] * _NUM_TIERS
        self._heaps: list[list[tuple[Priority, int, RadixNode]]] = [[] for _ in range(_NUM_TIERS)]
        self._seq = itertools.count()

    # ----------------------------------------------------------------- lookup

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._nodes

    def get(self, block_hash: int) -> RadixNode | None:
        return self._nodes.get(block_hash)

    def nodes(self) -> Iterable[RadixNode]:
        return self._nodes.values()

    def cached_count(self, tier: int) -> int:
        """Blocks of ``tier`` the index holds."""
        return self._count[tier]

    def idle_count(self, tier: int) -> int:
        """Blocks of ``tier`` that eviction could take (unlocked, no locked descendant)."""
        return self._idle[tier]

    def match(self, tokens: Sequence[int]) -> list[RadixNode]:
        """Nodes of the longest cached prefix of ``tokens`` (full blocks only)."""
        bs = self.block_size
        num_full = len(tokens) // bs
        nodes = self._nodes
        out: list[RadixNode] = []
        append = out.append
        parent = None
        start = 0
        chunk = _FIRST_CHUNK_BLOCKS
        while start < num_full:
            end = min(num_full, start + chunk)
            hashes = block_hashes(tokens[start * bs : end * bs], bs, parent)
            for h in hashes:
                node = nodes.get(h)
                if node is None:
                    return out
                append(node)
            parent = hashes[-1]
            start = end
            chunk *= 2
        return out

    def match_hashes(self, hashes: Sequence[int]) -> list[RadixNode]:
        """Like ``match`` for a prompt whose block names are already known."""
        nodes = self._nodes
        out: list[RadixNode] = []
        append = out.append
        for h in hashes:
            node = nodes.get(h)
            if node is None:
                break
            append(node)
        return out

    def known_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading names of ``hashes`` are already indexed."""
        nodes = self._nodes
        for i, h in enumerate(hashes):
            if h not in nodes:
                return i
        return len(hashes)

    def entries(self) -> set[tuple[int, int | None, int]]:
        """``(name, parent name, tier)`` of every node: what a mirror must agree on."""
        out: set[tuple[int, int | None, int]] = set()
        for n in self._nodes.values():
            parent = n.parent
            assert parent is not None  # an indexed node hangs below the root or another node
            out.add((n.hash, parent.hash, n.tier))
        return out

    # ------------------------------------------------------------- structure

    def add_chain(
        self,
        parent_hash: int | None,
        hashes: Sequence[int],
        addrs: Sequence[int],
        locks: Sequence[int] | None = None,
    ) -> list[RadixNode]:
        """Index a chain of new blocks below ``parent_hash`` (None: the root).

        ``locks`` gives each new node's initial reference count (default 0: cached only).
        """
        nodes = self._nodes
        parent = self.root if parent_hash is None else nodes.get(parent_hash)
        if parent is None:
            raise ValueError(f"parent block {parent_hash:#x} is not indexed")
        if len(addrs) != len(hashes) or (locks is not None and len(locks) != len(hashes)):
            raise ValueError(f"{len(hashes)} names need as many addresses and locks")
        n = len(hashes)
        if not n:
            return []
        # Names chain, so only the first can collide with an indexed block (unless a
        # 64-bit hash collides); checking it catches a stream that stores a chain twice.
        if hashes[0] in nodes:
            raise ValueError(f"block {hashes[0]:#x} is already indexed")
        if n == 1:  # a decode step's block, or a mirror's copy of it: the loops below in short
            return [self._add_one(parent, hashes[0], addrs[0], locks[0] if locks is not None else 0)]
        if locks is None:
            locks = [0] * n
        # A new node is busy when it or a deeper new node is locked: nodes 0..last_busy.
        last_busy = n - 1
        while last_busy >= 0 and not locks[last_busy]:
            last_busy -= 1
        now = self._clock()
        tiers = [addr_tier(a) for a in addrs]
        created: list[RadixNode] = []
        append = created.append
        node: TreeNode = parent
        for h, a, t, lock in zip(hashes, addrs, tiers, locks):
            child = RadixNode(h, node, a, t, lock, 1, now)
            if node is not parent:
                node.children = {h: child}
            append(child)
            node = child
        if parent.children is _NO_CHILDREN:
            parent.children = {}
        parent.children[hashes[0]] = created[0]
        nodes.update(zip(hashes, created))
        for i in range(max(last_busy, 0), n):  # no busy child below these
            created[i].busy_children = 0
        if tiers.count(tiers[0]) == n:
            self._count[tiers[0]] += n
        else:
            for t in tiers:
                self._count[t] += 1
        for i in range(last_busy + 1, n):  # idle nodes: count them, list the frontier
            tier = tiers[i]
            self._idle[tier] += 1
            if i == n - 1 or tiers[i + 1] != tier:
                self._push(tier, created[i])
        if last_busy >= 0:
            parent.busy_children += 1
            if parent.busy_children == 1 and not parent.lock:
                self._became_busy(parent)
        return created

    def _add_one(self, parent: TreeNode, block_hash: int, addr: int, lock: int) -> RadixNode:
        """``add_chain`` of one block."""
        tier = addr_tier(addr)
        node = RadixNode(block_hash, parent, addr, tier, lock, 0, self._clock())
        if parent.children is _NO_CHILDREN:
            parent.children = {}
        parent.children[block_hash] = node
        self._nodes[block_hash] = node
        self._count[tier] += 1
        if lock:
            parent.busy_children += 1
            if parent.busy_children == 1 and not parent.lock:
                self._became_busy(parent)
        else:
            self._idle[tier] += 1
            self._push(tier, node)
        return node

    def remove(self, node: RadixNode) -> None:
        """Unindex an idle leaf."""
        parent = node.parent
        tier = self._unlink(node)
        assert parent is not None  # _unlink raises for a node out of the tree
        self._left_tier(parent, tier)

    def remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        """Unindex an idle node and everything below it; returns them deepest first."""
        if not node.children and node.idle:  # a leaf, the common case of an eviction
            self.remove(node)
            return [node]
        order: list[RadixNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            if not n.idle:
                raise MemPoolError(f"cannot remove {n!r}: it is in use")
            order.append(n)
            stack.extend(n.children.values())
        order.reverse()
        for n in order[:-1]:
            self._unlink(n)
        self.remove(node)
        return order

    def _unlink(self, node: RadixNode) -> int:
        """Take an idle leaf out of the tree and the counts; returns its tier. Its parent
        may become a frontier node: the caller decides whether to list it (``_left_tier``)."""
        parent = node.parent
        if node.children or node.lock or node.busy_children or parent is None:
            raise MemPoolError(f"cannot remove {node!r}: only idle leaves can be removed")
        tier = node.tier
        del self._nodes[node.hash]
        del parent.children[node.hash]
        node.parent = None
        self._count[tier] -= 1
        self._idle[tier] -= 1
        return tier

    def move(self, node: RadixNode, addr: int, lock: int | None = None) -> None:
        """Re-point ``node`` to a block elsewhere (tier move); optionally reset its lock
        count (a busy node stays busy)."""
        old_tier, new_tier = node.tier, addr_tier(addr)
        if lock is not None:
            if lock < 1 or node.lock < 1:
                raise MemPoolError(f"move of {node!r}: only the holders of a locked node can change")
            node.lock = lock
        node.addr = addr
        node.tier = new_tier
        if old_tier == new_tier:
            return
        self._count[old_tier] -= 1
        self._count[new_tier] += 1
        if node.idle:
            self._idle[old_tier] -= 1
            self._idle[new_tier] += 1
            if self._frontier(node, new_tier):
                self._push(new_tier, node)
        parent = node.parent
        assert parent is not None  # an indexed node: the root and removed nodes do not move
        self._left_tier(parent, old_tier)

    def delete(self, tokens: Sequence[int], hashes: Sequence[int] | None = None) -> list[RadixNode]:
        """Unindex the blocks only this prompt needs: walk its cached path bottom-up and
        remove idle leaves, stopping at a block that is in use or shared with another
        cached prompt. Returns the removed nodes, deepest first. ``hashes``: the prompt's
        block names, when known (a salted prompt's must be given)."""
        path = self.match_hashes(hashes) if hashes is not None else self.match(tokens)
        removed = []
        for node in reversed(path):
            if node.children or not node.idle:
                break
            parent = node.parent
            tier = self._unlink(node)
            removed.append(node)
        if removed:
            assert parent is not None  # _unlink took the last removed node out of it
            self._left_tier(parent, tier)
        return removed

    @property
    def eviction(self) -> EvictionPolicy:
        return self._eviction

    def set_eviction(self, policy: EvictionPolicy) -> None:
        """Order eviction by ``policy`` from now on (``pinning.Pins`` wraps the policy at
        its first pin): every tier's frontier is listed again under the new priorities."""
        self._eviction = policy
        for tier in range(_NUM_TIERS):
            self._rebuild_heap(tier)

    def requeue(self, nodes: Iterable[RadixNode]) -> None:
        """The eviction policy changed these nodes' priorities (a dynamic policy, e.g. the
        scheduler's look-ahead window moved): list the idle frontier ones again under
        their new priority; their stale heap entries are skipped when popped."""
        for node in nodes:
            if node.parent is not None and node.idle:
                tier = node.tier
                if self._frontier(node, tier):
                    self._push(tier, node)

    # ------------------------------------------------------------------ locks

    def lock(self, nodes: Iterable[RadixNode]) -> None:
        """Take one reference on each node."""
        idle = self._idle
        for node in nodes:
            if not node.lock and not node.busy_children:  # idle -> busy
                idle[node.tier] -= 1
                parent = node.parent
                assert parent is not None  # an idle node is in the tree, below the root
                parent.busy_children += 1
                if parent.busy_children == 1 and not parent.lock:
                    self._became_busy(parent)
            node.lock += 1

    def unlock(self, nodes: Sequence[RadixNode], touch: bool = True) -> None:
        """Drop one reference on each node; all or nothing. ``touch=False`` leaves the
        last-access times alone (a tier move's pin is no use of the block)."""
        now = self._clock() if touch else None
        k = 0
        for k, node in enumerate(nodes):  # noqa: B007 - k is read below
            lock = node.lock
            if lock <= 0:
                break
            node.lock = lock - 1
            if now is not None:
                node.last_access = now
            if lock == 1 and not node.busy_children:
                self._became_idle(node, now)
        else:
            return
        self.lock(nodes[:k])
        drops = Counter(nodes)
        bad = next(n for n, c in drops.items() if n.lock < c)
        raise MemPoolError(f"{addr_str(bad.addr)} is not held (lock {bad.lock}, released {drops[bad]} times)")

    def _became_busy(self, node: TreeNode) -> None:
        """``node`` was idle and now has a busy child: so do its idle ancestors."""
        idle = self._idle
        while True:
            idle[node.tier] -= 1
            parent = node.parent
            assert parent is not None  # the walk ends at the root at the latest (locked for good)
            node = parent
            node.busy_children += 1
            if node.busy_children > 1 or node.lock:
                return

    def _became_idle(self, node: RadixNode, now: float | None) -> None:
        """``node`` just lost its last lock and has no busy child; ancestors kept busy
        only by it become idle too (and are stamped ``now`` unless it is None)."""
        idle = self._idle
        child_tier = -1  # tier of the child we came up from
        while True:
            tier = node.tier
            idle[tier] += 1
            if now is not None:
                node.last_access = now
            # A child in this tier that just went idle means: not a frontier node.
            if tier != child_tier and self._frontier(node, tier):
                self._push(tier, node)
            child_tier = tier
            parent = node.parent
            assert parent is not None  # the walk ends at the root at the latest (locked for good)
            parent.busy_children -= 1
            if parent.busy_children or parent.lock:
                return
            assert isinstance(parent, RadixNode)  # not the root: it is locked
            node = parent

    # --------------------------------------------------------------- eviction

    def select_evictable(self, tier: int, n: int) -> list[RadixNode]:
        """The ``n`` idle blocks of ``tier`` the eviction policy gives up first, deepest first:
        each one's descendants in this tier come before it. The caller must then remove
        or move every returned node out of ``tier``."""
        if n > self._idle[tier]:
            raise MemPoolError(f"only {self._idle[tier]} idle blocks in tier {Tier(tier).name}, asked for {n}")
        heap = self._heaps[tier]
        selected: set[RadixNode] = set()
        out: list[RadixNode] = []
        priority_of, pop = self._eviction.priority, heapq.heappop
        while len(out) < n:
            if not heap:
                raise AssertionError(f"tier {tier}: {self._idle[tier]} idle blocks counted but none listed")
            priority, _, node = pop(heap)
            # Stale entries are skipped: gone, reprioritised, moved, busy, or no longer on the frontier.
            if (
                node in selected
                or node.parent is None
                or priority != priority_of(node)
                or node.tier != tier
                or node.lock
                or node.busy_children
                or (node.children and not self._frontier(node, tier, selected))
            ):
                continue
            selected.add(node)
            out.append(node)
            parent = node.parent
            if (isinstance(parent, RadixNode) and parent.tier == tier and not parent.lock
                    and not parent.busy_children and self._frontier(parent, tier, selected)):
                # No compaction here: it would not know about ``selected``.
                heapq.heappush(heap, (priority_of(parent), next(self._seq), parent))
        return out

    def _frontier(self, node: RadixNode, tier: int, gone: set[RadixNode] | frozenset = frozenset()) -> bool:
        """True when no child of ``node`` (other than those in ``gone``) is in ``tier``."""
        for child in node.children.values():
            if child.tier == tier and child not in gone:
                return False
        return True

    def _left_tier(self, parent: TreeNode, tier: int) -> None:
        """A child of ``parent`` left ``tier``: the parent may now be on that tier's frontier."""
        if (self._evicts and not parent.lock and not parent.busy_children and isinstance(parent, RadixNode)
                and parent.tier == tier and self._frontier(parent, tier)):
            self._push(tier, parent)

    def _push(self, tier: int, node: RadixNode) -> None:
        if not self._evicts:
            return
        heap = self._heaps[tier]
        heapq.heappush(heap, (self._eviction.priority(node), next(self._seq), node))
        if len(heap) > 2 * self._count[tier] + 64:
            self._rebuild_heap(tier)

    def _rebuild_heap(self, tier: int) -> None:
        """Drop stale entries: one entry per current frontier node."""
        heap = [
            (self._eviction.priority(n), next(self._seq), n)
            for n in self._nodes.values()
            if n.tier == tier and n.idle and self._frontier(n, tier)
        ]
        heapq.heapify(heap)
        self._heaps[tier] = heap
