"""Moving cached blocks between a MemPool's tiers (device -> host -> disk): demotion
when a tier runs short, ``swap_out``, and ``swap_in`` whole or in two halves around an
asynchronous copy. A mixin of ``MemPool``: it works on the pool's block pools, index and
mover (``mempool.py`` states the invariants)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from memserve.kvcache.address import BLOCK_MASK, TIER_MASK, TIER_SHIFT, Tier, addr_str
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.events import MOVED, KVEvent
from memserve.kvcache.radix import RadixNode


class TierMoves:
    def swap_out(self, n: int) -> list[tuple[int, int]]:
        """Move up to ``n`` least recently used cached device blocks to the host tier;
        returns ``(old, new)`` addresses. Fewer move when fewer are idle or the host is
        full of blocks in use."""
        host = self._pool(Tier.HOST, "swap_out")
        self._need_mover("swap_out")
        room = host.num_free + self.index.idle_count(Tier.HOST)
        n = min(n, self.index.idle_count(Tier.DEVICE), room)
        if n <= 0:
            return []
        return self._move(self.index.select_evictable(Tier.DEVICE, n), Tier.HOST)

    def swap_in(self, addrs: Sequence[int]) -> list[int]:
        """Copy held blocks of slower tiers to new device blocks; returns the device
        addresses, each held once by the caller. The caller keeps its references to the
        old addresses (free them as usual). An indexed block is re-pointed to its device
        copy; pass a prompt's blocks parent first."""
        device_addrs = self.prepare_swap_in(addrs)
        mover = self._need_mover("swap_in")
        for tier, src, dst in self.swap_in_copies(addrs, device_addrs):
            mover.copy_blocks(tier, src, Tier.DEVICE, dst)
        self.commit_swap_in(addrs, device_addrs)
        return device_addrs

    def prepare_swap_in(self, addrs: Sequence[int]) -> list[int]:
        """First half of an asynchronous ``swap_in``: checks ``addrs`` and allocates their
        device blocks (held once by the caller), copying nothing. Copy them (the runs of
        ``swap_in_copies``) off the scheduling path, then ``commit_swap_in``. Both the
        sources (held by the caller) and the new device blocks (private) are safe from
        eviction meanwhile."""
        self._need_mover("swap_in")
        entries = self._held(addrs, "swap_in")
        promoted: set[RadixNode] = set()
        for e in entries:
            if e.tier == Tier.DEVICE:
                raise MemPoolError(f"swap_in: {addr_str(e.addr)} is already on the device")
            if e.node is not None:
                parent = e.node.parent
                if parent is not self.index.root and parent.tier != Tier.DEVICE and parent not in promoted:  # type: ignore[union-attr]
                    raise MemPoolError(f"swap_in: {addr_str(e.addr)}'s parent block is not on the device; pass it first")
                promoted.add(e.node)
        return self.alloc_mem(len(entries), Tier.DEVICE)

    @staticmethod
    def swap_in_copies(addrs: Sequence[int], device_addrs: Sequence[int]) -> list[tuple[Tier, list[int], list[int]]]:
        """(source tier, source blocks, device blocks) runs that a swap-in copies."""
        pairs = [((a >> TIER_SHIFT) & TIER_MASK, a & BLOCK_MASK, d & BLOCK_MASK) for a, d in zip(addrs, device_addrs)]
        return [(Tier(tier), [p[1] for p in run], [p[2] for p in run])
                for tier, run in ((t, list(g)) for t, g in itertools.groupby(pairs, key=lambda p: p[0]))]

    def commit_swap_in(self, addrs: Sequence[int], device_addrs: Sequence[int]) -> None:
        """Second half of an asynchronous ``swap_in``, once the copies are done: indexed
        sources are re-pointed to their device copies. A source another swap-in already
        promoted keeps that copy; this one's stays private to the caller."""
        moved = []
        for e, d in zip(self._held(addrs, "swap_in"), device_addrs):
            if e.node is not None and e.node.addr == e.addr:
                moved.append((e, d & BLOCK_MASK))
        if not moved:
            return
        self._pools[Tier.DEVICE].park([b for _, b in moved])  # type: ignore[union-attr]
        device_owner = self._node_of[Tier.DEVICE]
        for e, b in moved:
            holders = e.node.lock  # type: ignore[union-attr]
            self.index.move(e.node, self._addr(Tier.DEVICE, b), lock=1)  # type: ignore[arg-type]
            self._node_of[e.tier][e.block] = None
            device_owner[b] = e.node
            self._pools[e.tier].unpark([e.block], [holders])  # type: ignore[union-attr]
        nodes = [e.node for e, _ in moved]
        self._events.append(KVEvent(MOVED, [n.hash for n in nodes], None, [n.addr for n in nodes]))  # type: ignore[misc,union-attr]

    def _evict(self, tier: int, n: int) -> None:
        """Free ``n`` blocks of ``tier`` by giving up its LRU cached blocks: demote them
        to the next slower tier while it can take them, drop the rest."""
        victims = self.index.select_evictable(tier, n)
        nxt = self._next_tier(tier)
        room = 0
        if nxt is not None:
            room = self._pools[nxt].num_free + self.index.idle_count(nxt)  # type: ignore[union-attr]
        keep = min(len(victims), room)
        # Drop the oldest: victims come deepest first, so none of them is an ancestor of a
        # demoted one. A dropped block's slower descendants go with it.
        dropped = victims[: len(victims) - keep]
        if dropped:
            self._forget([gone for v in dropped for gone in self.index.remove_subtree(v)])
        if keep:
            self._move(victims[len(victims) - keep :], nxt)  # type: ignore[arg-type]

    def _move(self, nodes: list[RadixNode], dst: Tier) -> list[tuple[int, int]]:
        """Relocate idle indexed blocks of one tier to tier ``dst``."""
        src = nodes[0].tier
        dst_pool = self._pools[dst]
        short = len(nodes) - dst_pool.num_free  # type: ignore[union-attr]
        if short > 0:
            self._evict(dst, short)
        dst_blocks = dst_pool.alloc(len(nodes))  # type: ignore[union-attr]
        dst_pool.park(dst_blocks)  # type: ignore[union-attr]
        src_blocks = [n.addr & BLOCK_MASK for n in nodes]
        self.mover.copy_blocks(src, src_blocks, dst, dst_blocks)  # type: ignore[union-attr]
        src_owner, dst_owner = self._node_of[src], self._node_of[dst]
        pairs = []
        for node, sb, db in zip(nodes, src_blocks, dst_blocks):
            new = self._addr(dst, db)
            pairs.append((node.addr, new))
            self.index.move(node, new)
            src_owner[sb] = None
            dst_owner[db] = node
        self._pools[src].release(src_blocks)  # type: ignore[union-attr]
        self._events.append(KVEvent(MOVED, [n.hash for n in nodes], None, [new for _, new in pairs]))  # type: ignore[misc]
        return pairs

    def _next_tier(self, tier: int) -> Tier | None:
        if self.mover is None:
            return None
        return next((t for t in self.tiers if t > tier), None)
