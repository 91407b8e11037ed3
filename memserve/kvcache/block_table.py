"""Where a MemPool's blocks are: per tier a ``BlockPool`` (free list and reference counts),
per block the radix node that owns it, and the log of ownership changes (the KV events).

Invariants, kept here (the MemPool's other parts change ownership only through
``own``, ``moved`` and ``forget``):

- ``owner(t, b)`` is node ``n`` only while ``n`` is indexed at address (this instance,
  ``t``, ``b``), and every indexed node is the owner of its address. A block a node owns
  is parked in its pool: the index counts its references. A parked block with no owner
  is the destination of a save in flight; any other block is free or private (held by
  its owners, counted by its pool).
- Every change of ownership is logged, in order: ``own`` (STORED), ``moved`` (MOVED),
  ``forget`` (REMOVED). Replaying the log on a ``PromptTreeMirror`` reproduces the index.
- Addresses are checked here: one of another instance, of a tier this pool lacks, or past
  a tier's last block raises ``MemPoolError`` naming it, before anything changes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from memserve.kvcache.address import Tier, addr_block, addr_instance, addr_str, addr_tier, make_addr
from memserve.kvcache.blocks import BlockPool, MemPoolError
from memserve.kvcache.events import MOVED, REMOVED, STORED, KVEvent
from memserve.kvcache.radix import RadixNode


class Held(NamedTuple):
    """A held local block, decoded (``BlockTable.held``)."""

    addr: int
    tier: Tier
    block: int
    node: RadixNode | None  # None: a private block


class BlockTable:
    def __init__(self, instance_id: int, num_blocks: dict[Tier, int]) -> None:
        self.instance_id = instance_id
        self._pools: list[BlockPool | None] = [None] * len(Tier)
        for tier, n in num_blocks.items():
            if n > 0:
                self._pools[Tier(tier)] = BlockPool(n)
        self.tiers = [Tier(t) for t, p in enumerate(self._pools) if p is not None]  # fastest first
        if not self.tiers:
            raise ValueError("a MemPool needs blocks in at least one tier")
        # The address of block 0 of each tier here -> that tier and its pool: one dict
        # lookup tells a local address of a tier this pool has from any other.
        self._local = {make_addr(instance_id, t, 0): (Tier(t), p) for t, p in enumerate(self._pools) if p is not None}
        self._node_of: list[list[RadixNode | None]] = [[None] * (p.num_blocks if p else 0) for p in self._pools]
        self._events: list[KVEvent] = []

    # ----------------------------------------------------------------- pools

    def find(self, tier: int) -> BlockPool | None:
        """``tier``'s pool; None when this MemPool has no such tier."""
        return self._pools[tier] if 0 <= tier < len(self._pools) else None

    def pool(self, tier: int, op: str) -> BlockPool:
        """``tier``'s pool; raises (naming ``op``) when this MemPool has no such tier."""
        pool = self.find(tier)
        if pool is None:
            raise MemPoolError(f"{op}: this pool has no {Tier(tier).name if tier < len(Tier) else tier} tier")
        return pool

    def addr(self, tier: int, block: int) -> int:
        return make_addr(self.instance_id, tier, block)

    # ------------------------------------------------------------- addresses

    def split(self, addrs: Sequence[int], op: str) -> list[tuple[Tier, list[int]]]:
        """``(tier, blocks)`` groups of local addresses; raises on foreign or unknown ones."""
        if not addrs:
            return []
        first = addrs[0]
        base = first - addr_block(first)
        local = self._local.get(base)
        if local is not None:  # the common case: blocks of one tier
            tier, pool = local
            blocks = [a - base for a in addrs]
            if min(blocks) >= 0 and max(blocks) < pool.num_blocks:
                return [(tier, blocks)]
        groups: dict[Tier, list[int]] = {}
        for a in addrs:
            if addr_instance(a) != self.instance_id:
                raise MemPoolError(f"{op}: {addr_str(a)} belongs to instance {addr_instance(a)}, this is {self.instance_id}")
            block = addr_block(a)
            local = self._local.get(a - block)
            if local is None or block >= local[1].num_blocks:
                raise MemPoolError(f"{op}: {addr_str(a)} is not a block of this pool")
            groups.setdefault(local[0], []).append(block)
        return list(groups.items())

    def held(self, addrs: Sequence[int], op: str) -> list[Held]:
        """Each address decoded; raises unless it is a local block someone holds."""
        self.split(addrs, op)
        if len(set(addrs)) != len(addrs):
            raise MemPoolError(f"{op}: repeated addresses")
        out = []
        for a in addrs:
            tier, block = addr_tier(a), addr_block(a)
            node = self._node_of[tier][block]
            held = node.lock if node is not None else self.pool(tier, op).refcount(block)
            if held < 1:
                raise MemPoolError(f"{op}: {addr_str(a)} is not held by anyone")
            out.append(Held(a, tier, block, node))
        return out

    def runs_by_tier(self, addrs: Sequence[int], op: str) -> list[tuple[Tier, list[int]]]:
        """Maximal runs of consecutive same-tier held addresses, in order."""
        return [
            (tier, [e.block for e in group])
            for tier, group in itertools.groupby(self.held(addrs, op), key=lambda e: e.tier)
        ]

    def check_release(self, tier: int, blocks: list[int]) -> None:
        """Raise, naming the address, when releasing ``blocks`` once each would drop a
        reference nobody holds."""
        owners = self._node_of[tier]
        pool = self.pool(tier, "free_mem")
        for b, n in Counter(blocks).items():
            node = owners[b]
            held = node.lock if node is not None else pool.refcount(b)
            if held < n:
                where = addr_str(self.addr(tier, b))
                if held < 1:
                    raise MemPoolError(f"free_mem: {where} is not held (already freed, or never allocated)")
                raise MemPoolError(f"free_mem: {where} is held {held} times, released {n} times")

    # ------------------------------------------------------------- ownership

    def owners(self, tier: int) -> Sequence[RadixNode | None]:
        """Per block of ``tier``, its owner (read-only: change it through the methods below)."""
        return self._node_of[tier]

    def own(self, tier: int, blocks: Sequence[int], nodes: Sequence[RadixNode], parent: int | None,
            hashes: Sequence[int], addrs: Sequence[int]) -> None:
        """``nodes`` (names ``hashes``, at ``addrs``) were just indexed below ``parent``
        as a chain, holding ``blocks`` of ``tier``."""
        owners = self._node_of[tier]
        for b, node in zip(blocks, nodes):
            owners[b] = node
        self._events.append(KVEvent(STORED, list(hashes), parent, list(addrs)))

    def moved(self, moves: Sequence[tuple[RadixNode, int, int]]) -> None:
        """Each ``(node, old tier, old block)``: the index just re-pointed ``node`` from
        that block to its current address."""
        owners = self._node_of
        for node, tier, block in moves:
            owners[tier][block] = None
            owners[node.tier][addr_block(node.addr)] = node
        self._events.append(KVEvent(MOVED, [n.hash for n, _, _ in moves], None, [n.addr for n, _, _ in moves]))

    def forget(self, removed: list[RadixNode]) -> None:
        """Return the blocks of nodes just removed from the index to their free lists."""
        if not removed:
            return
        for tier, group in itertools.groupby(removed, key=lambda n: n.tier):
            blocks = [addr_block(n.addr) for n in group]
            owners = self._node_of[tier]
            for b in blocks:
                owners[b] = None
            self.pool(tier, "forget").release(blocks)
        self._events.append(KVEvent(REMOVED, [n.hash for n in removed]))

    def drain_events(self) -> list[KVEvent]:
        """Ownership changes since the last call, in order."""
        events, self._events = self._events, []
        return events
