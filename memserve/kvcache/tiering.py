"""Moving cached blocks between a MemPool's tiers (device -> host -> disk -> dropped): the
capacity-driven cascade, ``swap_out``, ``swap_in`` whole or in two halves around an
asynchronous copy, and the disk tier's re-indexing at start-up. A mixin of ``MemPool``:
it works on the pool's block pools, index, mover and saver (``mempool.py`` states the
invariants).

Saving down. With an asynchronous saver (``saver.ThreadSaver``) a tier is demoted ahead
of need: ``kick_saves`` (after every engine step) keeps each tier that has a slower one
at ``watermark`` blocks free or on their way out, by starting saves of its least
valuable idle blocks. A block being saved is *pinned* (one index reference, no use of
the block): it stays readable and matchable on its source tier and cannot be evicted;
``poll_saves`` moves it to its copy once the copy is written, unless it was used
meanwhile (then the copy is given back and the block stays where it is hot).

Evicting never drops what a slower tier could keep. When ``alloc_mem`` finds too few
free blocks (the saver fell behind, or the watermark was too small for the step), it
waits for the saves in flight out of that tier, then demotes idle blocks on demand,
copying inside the call, as the synchronous saver (``saver.InlineSaver``, the baseline
and the simulator's choice) always does. A block is dropped only at the end of the
cascade, or when every slower tier is full of blocks in use; ``dropped_unsaved`` counts
the latter, which the tiers exist to avoid."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from memserve.kvcache.address import (
    BLOCK_MASK,
    TIER_MASK,
    TIER_SHIFT,
    Tier,
    addr_str,
    make_addrs,
)
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.events import MOVED, STORED, KVEvent
from memserve.kvcache.pool_state import Held, PoolState
from memserve.kvcache.radix import RadixNode
from memserve.kvcache.saver import SaveJob

log = logging.getLogger("memserve.kvcache")


class TierMoves(PoolState):
    # ------------------------------------------------------------- saving down

    def kick_saves(self) -> None:
        """Commit the saves that finished, then start demotions so that every tier with
        a slower one has ``watermark`` blocks free or being saved (slowest tier first:
        its saves make room for the faster tier's). Never waits for a copy."""
        self.poll_saves()
        if self.saver.inline:
            return  # a synchronous saver demotes on demand, in alloc_mem
        for tier in reversed(self.tiers):
            self.demote(tier, self._watermark[tier] - self._pool(tier, "kick_saves").num_free - self._saving[tier])

    def demote(self, tier: Tier, n: int) -> int:
        """Start saving up to ``n`` of ``tier``'s least valuable idle blocks to the next
        slower tier, as far as it has room without waiting; returns how many."""
        nxt = self._next_tier(tier)
        if nxt is None:
            return 0
        n = min(n, self.index.idle_count(tier), self._room(nxt))
        if n > 0:
            self._save(self.index.select_evictable(tier, n), nxt)
        return max(n, 0)

    def poll_saves(self) -> None:
        """Move the blocks whose saves finished to their copies; forget corrupt disk
        blocks nobody holds any more. Cheap and I/O-free: call it before scheduling."""
        self._finish_saves()
        self._drop_corrupt()

    def flush_saves(self) -> None:
        """Wait for every save in flight and commit it (tests, shutdown)."""
        self.saver.wait()
        self.poll_saves()

    def persist(self) -> None:
        """Save every idle cached block of the faster tiers to the disk tier, as far as
        it holds them (a graceful shutdown: the next run re-indexes them). Slower tiers
        go first, so a block never lands below a child of a faster tier."""
        if self._pools[Tier.DISK] is None or self.mover is None:
            return
        self.flush_saves()
        for tier in (Tier.HOST, Tier.DEVICE):
            if self._pools[tier] is None:
                continue
            if tier == Tier.DEVICE and self._pools[Tier.HOST] is not None and self.index.cached_count(Tier.HOST):
                return  # a device block could end up on disk above a child left on the host
            n = min(self.index.idle_count(tier), self._room(Tier.DISK))
            if n > 0:
                self._save(self.index.select_evictable(tier, n), Tier.DISK)
                self.flush_saves()

    def swap_out(self, n: int) -> list[tuple[int, int]]:
        """Move up to ``n`` least recently used cached device blocks to the host tier,
        waiting for the copies; returns ``(old, new)`` addresses. Fewer move when fewer
        are idle or the host is full of blocks in use."""
        host = self._pool(Tier.HOST, "swap_out")
        self._need_mover("swap_out")
        room = host.num_free + self.index.idle_count(Tier.HOST)
        n = min(n, self.index.idle_count(Tier.DEVICE), room)
        if n <= 0:
            return []
        job = self._save(self.index.select_evictable(Tier.DEVICE, n), Tier.HOST)
        self.saver.wait()
        mine = {addr for _, addr, _ in job.owner}
        return [pair for pair in self._finish_saves() if pair[0] in mine]

    def _evict(self, tier: int, n: int) -> None:
        """Free ``n`` blocks of ``tier`` now, keeping their bytes wherever a slower tier can
        hold them: first the saves in flight out of ``tier`` are waited for (they free
        their sources), then its least valuable idle blocks are demoted to the next slower
        tier, waiting for the copies, as far as that tier can take them (making room down
        the cascade in turn). Only what no slower tier can hold is dropped; from a tier
        that has a slower one that is counted as ``dropped_unsaved``."""
        pool = self._pool(tier, "evict")
        target = pool.num_free + n
        if self._saving[tier] and not self.saver.inline:
            self.saver.wait()
            self._finish_saves()
        victims = self.index.select_evictable(tier, target - pool.num_free)
        if not victims:
            return
        nxt = self._next_tier(tier)
        keep = 0
        if nxt is not None:
            keep = min(len(victims), self._pool(nxt, "evict").num_free + self.index.idle_count(nxt))
        # Drop the oldest: victims come deepest first, so none of them is an ancestor of a
        # demoted one (and pinned blocks come last, so they are the ones kept). A dropped
        # block's slower descendants go with it.
        dropped = victims[: len(victims) - keep]
        if dropped:
            if nxt is not None:
                self._dropped_unsaved[tier] += len(dropped)
            self._forget([gone for v in dropped for gone in self.index.remove_subtree(v)])
        if keep:
            assert nxt is not None  # only a slower tier keeps any
            self._save(victims[len(victims) - keep :], nxt)
            self.saver.wait()
            self._finish_saves()

    def _room(self, tier: Tier) -> int:
        """Blocks a save into ``tier`` can get without waiting: free ones, plus idle ones
        when ``tier`` is the last (they are dropped; a middle tier saves its own down)."""
        room = self._pool(tier, "save").num_free
        if self._next_tier(tier) is None:
            room += self.index.idle_count(tier)
        return room

    def _save(self, nodes: list[RadixNode], dst: Tier) -> SaveJob:
        """Start copying idle indexed blocks of one tier to new blocks of ``dst``: the
        copies are parked, the sources pinned until ``_finish_saves``."""
        src = nodes[0].tier
        dst_pool = self._pool(dst, "save")
        short = len(nodes) - dst_pool.num_free
        if short > 0:
            self._evict(dst, short)
        dst_blocks = dst_pool.alloc(len(nodes))
        dst_pool.park(dst_blocks)
        self.index.lock(nodes)
        if dst == Tier.DISK and self.disk is not None:
            for node, slot in zip(nodes, dst_blocks):
                parent = node.parent
                assert parent is not None  # an indexed node
                self.disk.name(slot, node.hash, parent.hash)
        self._saving[src] += len(nodes)
        self._incoming[dst] += len(nodes)
        job = SaveJob(src, [n.addr & BLOCK_MASK for n in nodes], dst, dst_blocks,
                      owner=[(n, n.addr, n.last_access) for n in nodes])
        self.saver.submit(job)
        return job

    def _finish_saves(self) -> list[tuple[int, int]]:
        """Commit every finished save; returns the ``(old, new)`` addresses moved."""
        pairs: list[tuple[int, int]] = []
        for job in self.saver.completed():
            pairs += self._finish_save(job)
        return pairs

    def _finish_save(self, job: SaveJob) -> list[tuple[int, int]]:
        src, dst = job.src_tier, job.dst_tier
        n = len(job.src_blocks)
        self._saving[src] -= n
        self._incoming[dst] -= n
        src_pool, dst_pool = self._pool(src, "save"), self._pool(dst, "save")
        moved: list[tuple[RadixNode, int, int]] = []
        unpin: list[RadixNode] = []
        unused: list[int] = []
        landing: set[RadixNode] = set()
        unread = self.disk.failed(job.src_blocks) if src == Tier.DISK and self.disk is not None else set()
        for (node, addr, stamp), sb, db in zip(job.owner, job.src_blocks, job.dst_blocks):
            if node.addr != addr:  # swapped in meantime: the pin went with the old block, now private
                src_pool.free([sb])
                unused.append(db)
            elif sb in unread:  # a prefetch found the file missing or corrupt: forgotten once idle
                self._corrupt.append(node)
                unpin.append(node)
                unused.append(db)
            elif (job.error is None and node.lock == 1 and node.last_access == stamp
                  and self._may_land(node, dst, landing)):
                landing.add(node)
                moved.append((node, sb, db))
            else:  # used while saving (or the copy failed): it stays where it is
                unpin.append(node)
                unused.append(db)
        if job.error is not None:
            log.warning("saving %d blocks %s -> %s failed: %r", n, Tier(src).name, Tier(dst).name, job.error)
        else:
            nbytes = self._need_mover("save").block_nbytes
            self._io_bytes[src][0] += n * nbytes
            self._io_bytes[dst][1] += n * nbytes
        dst_pool.release(unused)
        if unpin:
            self.index.unlock(unpin, touch=False)
        if not moved:
            return []
        src_owner, dst_owner = self._node_of[src], self._node_of[dst]
        pairs = []
        for node, sb, db in moved:
            new = self._addr(dst, db)
            pairs.append((node.addr, new))
            self.index.move(node, new)
            src_owner[sb] = None
            dst_owner[db] = node
        src_pool.release([sb for _, sb, _ in moved])
        nodes = [node for node, _, _ in moved]
        self.index.unlock(nodes, touch=False)
        self._events.append(KVEvent(MOVED, [node.hash for node in nodes], None, [new for _, new in pairs]))
        return pairs

    def _may_land(self, node: RadixNode, dst: Tier, landing: set[RadixNode]) -> bool:
        """Whether a saved block's parent allows it in ``dst``: the parent is the root, in
        ``dst`` or a faster tier, or moving to ``dst`` with it (a prefetch moves a block up
        only with or after its parent: never a child above it)."""
        parent = node.parent
        assert parent is not None  # a block being saved is pinned: in the tree
        return parent is self.index.root or parent.tier <= dst or parent in landing

    # -------------------------------------------------------------- prefetching

    def prefetch_window(self) -> int:
        """Host blocks the look-ahead window may claim for prefetches: the host tier less
        the free blocks kept for device demotions (its watermark, at most half of it);
        0 without a disk and a host tier."""
        host = self._pools[Tier.HOST]
        if host is None or self._pools[Tier.DISK] is None or self.mover is None:
            return 0
        return host.num_blocks - self._prefetch_reserve()

    def prefetch_room(self) -> int:
        """Host blocks a prefetch may fill now: the free ones beyond that reserve
        (negative when the host must first save that many down)."""
        if not self.prefetch_window():
            return 0
        return self._pool(Tier.HOST, "prefetch").num_free - self._prefetch_reserve()

    def _prefetch_reserve(self) -> int:
        return min(self._watermark[Tier.HOST], self._pool(Tier.HOST, "prefetch").num_blocks // 2)

    def prefetch(self, nodes: list[RadixNode]) -> int:
        """Start copying idle disk blocks up to the host tier through the saver
        (AttentionStore §3.3.1), parents before children, as far as ``prefetch_room``
        allows; returns how many started. Like a save, the block stays readable on disk
        meanwhile and moves only if nobody used it (then a load reads it from the host)."""
        nodes = [n for n in nodes if n.tier == Tier.DISK and n.idle][: max(0, self.prefetch_room())]
        if not nodes:
            return 0
        self._save(nodes, Tier.HOST)
        self._prefetched.update(n.hash for n in nodes)
        self._prefetch_blocks += len(nodes)
        return len(nodes)

    # -------------------------------------------------------------- loading up

    def swap_in(self, addrs: Sequence[int]) -> list[int]:
        """Copy held blocks of slower tiers to new device blocks; returns the device
        addresses, each held once by the caller. The caller keeps its references to the
        old addresses (free them as usual). An indexed block is re-pointed to its device
        copy; pass a prompt's blocks parent first. Raises when a disk block was missing or
        corrupt (the blocks before it are swapped in)."""
        device_addrs = self.prepare_swap_in(addrs)
        mover = self._need_mover("swap_in")
        for tier, src, dst in self.swap_in_copies(addrs, device_addrs):
            mover.copy_blocks(tier, src, Tier.DEVICE, dst)
        intact = self.commit_swap_in(addrs, device_addrs)
        if intact < len(addrs):
            self.free_mem(device_addrs)
            raise MemPoolError(f"swap_in: {addr_str(addrs[intact])} could not be read (missing or corrupt)")
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
                assert parent is not None  # a held indexed node is in the tree
                if parent is not self.index.root and parent.tier != Tier.DEVICE and parent not in promoted:
                    raise MemPoolError(f"swap_in: {addr_str(e.addr)}'s parent block is not on the device; pass it first")
                promoted.add(e.node)
        return self.alloc_mem(len(entries), Tier.DEVICE)

    @staticmethod
    def swap_in_copies(addrs: Sequence[int], device_addrs: Sequence[int]) -> list[tuple[Tier, list[int], list[int]]]:
        """(source tier, source blocks, device blocks) runs that a swap-in copies."""
        pairs = [((a >> TIER_SHIFT) & TIER_MASK, a & BLOCK_MASK, d & BLOCK_MASK) for a, d in zip(addrs, device_addrs)]
        return [(Tier(tier), [p[1] for p in run], [p[2] for p in run])
                for tier, run in ((t, list(g)) for t, g in itertools.groupby(pairs, key=lambda p: p[0]))]

    def commit_swap_in(self, addrs: Sequence[int], device_addrs: Sequence[int]) -> int:
        """Second half of an asynchronous ``swap_in``, once the copies are done: indexed
        sources are re-pointed to their device copies. A source another swap-in already
        promoted keeps that copy; this one's stays private to the caller. Returns how
        many leading blocks arrived: a disk block whose file was missing or corrupt, and
        every block after it, are not committed (their device blocks stay private to the
        caller, to recompute) and the bad blocks are forgotten once nobody holds them."""
        entries = self._held(addrs, "swap_in")
        intact = self._intact_prefix(entries)
        nbytes = self._need_mover("swap_in").block_nbytes
        for e in entries[:intact]:
            self._io_bytes[e.tier][0] += nbytes
        self._io_bytes[Tier.DEVICE][1] += intact * nbytes
        moved: list[tuple[RadixNode, Held, int]] = []
        for e, d in zip(entries[:intact], device_addrs):
            if e.node is not None and e.node.addr == e.addr:
                moved.append((e.node, e, d & BLOCK_MASK))
        if not moved:
            return intact
        self._pool(Tier.DEVICE, "swap_in").park([b for _, _, b in moved])
        device_owner = self._node_of[Tier.DEVICE]
        for node, e, b in moved:
            holders = node.lock
            self.index.move(node, self._addr(Tier.DEVICE, b), lock=1)
            self._node_of[e.tier][e.block] = None
            device_owner[b] = node
            self._pool(e.tier, "swap_in").unpark([e.block], [holders])
        nodes = [node for node, _, _ in moved]
        self._events.append(KVEvent(MOVED, [n.hash for n in nodes], None, [n.addr for n in nodes]))
        return intact

    def _intact_prefix(self, entries: list[Held]) -> int:
        """How many leading entries' bytes a load delivered (all but disk misses)."""
        if self.disk is None:
            return len(entries)
        bad = self.disk.failed(e.block for e in entries if e.tier == Tier.DISK)
        if not bad:
            return len(entries)
        first = len(entries)
        for i, e in enumerate(entries):
            if e.tier == Tier.DISK and e.block in bad:
                first = min(first, i)
                if e.node is not None and e.node.addr == e.addr:
                    self._corrupt.append(e.node)
        return first

    def _drop_corrupt(self) -> None:
        """Forget disk blocks whose file was found bad (and their descendants) once no
        request holds them: a later request then misses instead of failing again."""
        if not self._corrupt:
            return
        waiting = []
        for node in self._corrupt:
            if node.parent is None or node.tier != Tier.DISK:
                continue  # already gone
            if node.idle:
                self._forget(self.index.remove_subtree(node))
            else:
                waiting.append(node)
        self._corrupt = waiting

    # --------------------------------------------------------------- start-up

    def _adopt_disk(self, entries: list[tuple[int, int | None]]) -> None:
        """Index the valid blocks an earlier run left on disk (``DiskStore.scan``: parents
        first, entry i in slot i) as cached disk blocks, one STORED event per chain run."""
        if not entries:
            return
        pool = self._pool(Tier.DISK, "adopt")
        slots = pool.alloc(len(entries))
        if slots != list(range(len(entries))):
            raise MemPoolError("the disk tier must be adopted before any allocation")
        pool.park(slots)
        owners = self._node_of[Tier.DISK]
        i = 0
        while i < len(entries):
            j = i + 1
            while j < len(entries) and entries[j][1] == entries[j - 1][0]:
                j += 1
            hashes = [h for h, _ in entries[i:j]]
            addrs = make_addrs(self.instance_id, Tier.DISK, slots[i:j])
            for slot, node in zip(slots[i:j], self.index.add_chain(entries[i][1], hashes, addrs)):
                owners[slot] = node
            self._events.append(KVEvent(STORED, hashes, entries[i][1], addrs))
            i = j

    def _next_tier(self, tier: int) -> Tier | None:
        if self.mover is None:
            return None
        return next((t for t in self.tiers if t > tier), None)
