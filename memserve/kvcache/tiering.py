"""The index side of moving cached blocks between a MemPool's tiers (device -> host ->
disk -> dropped): the capacity-driven cascade, saves, prefetches, the commit of a swap-in
and the disk tier's re-indexing at start-up. ``TierMoves`` decides which blocks move
where and what a finished copy means for the index; the bytes move through the
``TierController`` (``tier_controller.py``), ownership changes through the
``BlockTable`` (``block_table.py``).

Saving down. With an asynchronous saver (``saver.ThreadSaver``) a tier is demoted ahead
of need: ``kick_saves`` (after every engine step) keeps each tier that has a slower one
at ``watermark`` blocks free or on their way out, by starting saves of its least
valuable idle blocks. A block being saved is *pinned* (one index reference, no use of
the block): it stays readable and matchable on its source tier and cannot be evicted;
``poll_saves`` moves it to its copy once the copy is written, unless it was used
meanwhile (then the copy is given back and the block stays where it is hot).

Evicting never drops what a slower tier could keep. When an allocation finds too few
free blocks (the saver fell behind, or the watermark was too small for the step), it
waits for the saves in flight out of that tier, then demotes idle blocks on demand,
copying inside the call, as the synchronous saver (``saver.InlineSaver``, the baseline
and the simulator's choice) always does. A block is dropped only at the end of the
cascade, or when every slower tier is full of blocks in use; ``dropped_unsaved`` counts
the latter, which the tiers exist to avoid.

Invariants kept here:

- A cached block's children never sit in a faster tier than the block itself: a tier
  gives up only its frontier (blocks with no child in it), a save lands only below its
  parent (``_may_land``), a swap-in promotes parents first.
- Between ``_save`` and its commit a block holds one extra index reference and its
  destination block is parked with no owner; the commit moves the node or gives the
  destination back, and drops that reference either way.
- ``prefetched`` names blocks a prefetch started moving up and no request has matched
  since; a name leaves it when matched above the disk tier or forgotten.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from memserve.kvcache.address import Tier, addr_block, addr_str, make_addrs
from memserve.kvcache.block_table import BlockTable, Held
from memserve.kvcache.blocks import MemPoolError, OutOfBlocks
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.radix import RadixIndex, RadixNode
from memserve.kvcache.saver import SaveJob
from memserve.kvcache.tier_controller import TierController

log = logging.getLogger("memserve.kvcache")


class TierMoves:
    """A part of one MemPool; the methods it exposes as its own API (``kick_saves``,
    ``swap_out``, ``prefetch``, ...) are documented there."""

    def __init__(self, index: RadixIndex, table: BlockTable, controller: TierController, disk: DiskStore | None,
                 save_watermark: float, step_blocks: int) -> None:
        self._index = index
        self._table = table
        self._ctl = controller
        self._disk = disk
        # Per tier: blocks ``kick_saves`` keeps free or being saved down: a fraction of the
        # tier, and at least what one engine step allocates (``step_blocks``), so that a
        # step finds free blocks instead of dropping cached ones.
        self._watermark = [0] * len(Tier)
        for tier in table.tiers:
            n = table.pool(tier, "watermark").num_blocks
            self._watermark[tier] = min(n, max(1, math.ceil(save_watermark * n), step_blocks))
        self._dropped_unsaved = [0] * len(Tier)  # per tier: blocks dropped though a slower tier exists
        self._corrupt: list[RadixNode] = []  # disk blocks found bad, forgotten once idle
        self._prefetched: set[int] = set()
        self.prefetch_blocks = 0  # blocks prefetched disk -> host
        self.prefetch_hits = 0  # prefetched blocks a request then matched on the host

    def dropped_unsaved(self, tier: int) -> int:
        return self._dropped_unsaved[tier]

    # ------------------------------------------------------------ allocating

    def make_room(self, tier: Tier, size: int, short: int) -> None:
        """Free ``short`` more blocks of ``tier`` for an allocation of ``size``: wait for
        saves, demote, drop; raises ``OutOfBlocks`` (changing nothing) when even evicting
        every idle block would not do."""
        pool = self._table.pool(tier, "alloc_mem")
        self.catch_up_saves(tier, short)
        short = size - pool.num_free
        if short > 0:
            if short > self._index.idle_count(tier):
                raise OutOfBlocks(
                    f"alloc_mem: need {size} {Tier(tier).name} blocks; {pool.num_free} free and "
                    f"{self._index.idle_count(tier)} evictable of {pool.num_blocks}"
                )
            self._evict(tier, short)

    def catch_up_saves(self, tier: int, short: int) -> None:
        """When ``tier``'s idle blocks cannot cover ``short`` but asynchronous saves out of
        it are in flight, wait for them: once written they free their sources (or, used
        meanwhile, become evictable again) instead of the allocation failing."""
        if 0 < short and self._index.idle_count(tier) < short and self._ctl.saving(tier) and not self._ctl.inline:
            self._ctl.wait()
            self._finish_saves()

    def forget(self, removed: list[RadixNode]) -> None:
        """Nodes just removed from the index: their blocks go back to the free lists."""
        self._table.forget(removed)
        if removed and self._prefetched:
            self._prefetched.difference_update(n.hash for n in removed)

    # ------------------------------------------------------------- saving down

    def kick_saves(self) -> None:
        self.poll_saves()
        if self._ctl.inline:
            return  # a synchronous saver demotes on demand, when allocating
        for tier in reversed(self._table.tiers):
            free = self._table.pool(tier, "kick_saves").num_free
            self.demote(tier, self._watermark[tier] - free - self._ctl.saving(tier))

    def demote(self, tier: Tier, n: int) -> int:
        nxt = self._next_tier(tier)
        if nxt is None:
            return 0
        n = min(n, self._index.idle_count(tier), self._room(nxt))
        if n > 0:
            self._save(self._index.select_evictable(tier, n), nxt)
        return max(n, 0)

    def poll_saves(self) -> None:
        self._finish_saves()
        self._drop_corrupt()

    def flush_saves(self) -> None:
        self._ctl.wait()
        self.poll_saves()

    def persist(self) -> None:
        table, index = self._table, self._index
        if table.find(Tier.DISK) is None or self._ctl.mover is None:
            return
        self.flush_saves()
        for tier in (Tier.HOST, Tier.DEVICE):
            if table.find(tier) is None:
                continue
            if tier == Tier.DEVICE and table.find(Tier.HOST) is not None and index.cached_count(Tier.HOST):
                return  # a device block could end up on disk above a child left on the host
            n = min(index.idle_count(tier), self._room(Tier.DISK))
            if n > 0:
                self._save(index.select_evictable(tier, n), Tier.DISK)
                self.flush_saves()

    def swap_out(self, n: int) -> list[tuple[int, int]]:
        host = self._table.pool(Tier.HOST, "swap_out")
        self._ctl.need_mover("swap_out")
        room = host.num_free + self._index.idle_count(Tier.HOST)
        n = min(n, self._index.idle_count(Tier.DEVICE), room)
        if n <= 0:
            return []
        job = self._save(self._index.select_evictable(Tier.DEVICE, n), Tier.HOST)
        self._ctl.wait()
        mine = {addr for _, addr, _ in job.owner}
        return [pair for pair in self._finish_saves() if pair[0] in mine]

    def _evict(self, tier: Tier, n: int) -> None:
        """Free ``n`` blocks of ``tier`` now, keeping their bytes wherever a slower tier can
        hold them: first the saves in flight out of ``tier`` are waited for (they free
        their sources), then its least valuable idle blocks are demoted to the next slower
        tier, waiting for the copies, as far as that tier can take them (making room down
        the cascade in turn). Only what no slower tier can hold is dropped; from a tier
        that has a slower one that is counted as ``dropped_unsaved``."""
        pool = self._table.pool(tier, "evict")
        target = pool.num_free + n
        if self._ctl.saving(tier) and not self._ctl.inline:
            self._ctl.wait()
            self._finish_saves()
        victims = self._index.select_evictable(tier, target - pool.num_free)
        if not victims:
            return
        nxt = self._next_tier(tier)
        keep = 0
        if nxt is not None:
            keep = min(len(victims), self._table.pool(nxt, "evict").num_free + self._index.idle_count(nxt))
        # Drop the oldest: victims come deepest first, so none of them is an ancestor of a
        # demoted one (and pinned blocks come last, so they are the ones kept). A dropped
        # block's slower descendants go with it.
        dropped = victims[: len(victims) - keep]
        if dropped:
            if nxt is not None:
                self._dropped_unsaved[tier] += len(dropped)
            self.forget([gone for v in dropped for gone in self._index.remove_subtree(v)])
        if keep:
            assert nxt is not None  # only a slower tier keeps any
            self._save(victims[len(victims) - keep :], nxt)
            self._ctl.wait()
            self._finish_saves()

    def _room(self, tier: Tier) -> int:
        """Blocks a save into ``tier`` can get without waiting: free ones, plus idle ones
        when ``tier`` is the last (they are dropped; a middle tier saves its own down)."""
        room = self._table.pool(tier, "save").num_free
        if self._next_tier(tier) is None:
            room += self._index.idle_count(tier)
        return room

    def _save(self, nodes: list[RadixNode], dst: Tier) -> SaveJob:
        """Start copying idle indexed blocks of one tier to new blocks of ``dst``: the
        copies are parked, the sources pinned until ``_finish_saves``."""
        src = nodes[0].tier
        dst_pool = self._table.pool(dst, "save")
        short = len(nodes) - dst_pool.num_free
        if short > 0:
            self._evict(dst, short)
        dst_blocks = dst_pool.alloc(len(nodes))
        dst_pool.park(dst_blocks)
        self._index.lock(nodes)
        if dst == Tier.DISK and self._disk is not None:
            for node, slot in zip(nodes, dst_blocks):
                parent = node.parent
                assert parent is not None  # an indexed node
                self._disk.name(slot, node.hash, parent.hash)
        job = SaveJob(src, [addr_block(n.addr) for n in nodes], dst, dst_blocks,
                      owner=[(n, n.addr, n.last_access) for n in nodes])
        self._ctl.start_save(job)
        return job

    def _finish_saves(self) -> list[tuple[int, int]]:
        """Commit every finished save; returns the ``(old, new)`` addresses moved."""
        pairs: list[tuple[int, int]] = []
        for job in self._ctl.finished_saves():
            pairs += self._finish_save(job)
        return pairs

    def _finish_save(self, job: SaveJob) -> list[tuple[int, int]]:
        src, dst = job.src_tier, job.dst_tier
        src_pool, dst_pool = self._table.pool(src, "save"), self._table.pool(dst, "save")
        moved: list[tuple[RadixNode, int, int]] = []
        unpin: list[RadixNode] = []
        unused: list[int] = []
        landing: set[RadixNode] = set()
        unread = self._disk.failed(job.src_blocks) if src == Tier.DISK and self._disk is not None else set()
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
            log.warning("saving %d blocks %s -> %s failed: %r", len(job.src_blocks), Tier(src).name, Tier(dst).name,
                        job.error)
        dst_pool.release(unused)
        if unpin:
            self._index.unlock(unpin, touch=False)
        if not moved:
            return []
        pairs = []
        for node, _, db in moved:
            new = self._table.addr(dst, db)
            pairs.append((node.addr, new))
            self._index.move(node, new)
        self._table.moved([(node, src, sb) for node, sb, _ in moved])
        src_pool.release([sb for _, sb, _ in moved])
        self._index.unlock([node for node, _, _ in moved], touch=False)
        return pairs

    def _may_land(self, node: RadixNode, dst: Tier, landing: set[RadixNode]) -> bool:
        """Whether a saved block's parent allows it in ``dst``: the parent is the root, in
        ``dst`` or a faster tier, or moving to ``dst`` with it (a prefetch moves a block up
        only with or after its parent: never a child above it)."""
        parent = node.parent
        assert parent is not None  # a block being saved is pinned: in the tree
        return parent is self._index.root or parent.tier <= dst or parent in landing

    # -------------------------------------------------------------- prefetching

    def prefetch_window(self) -> int:
        host = self._table.find(Tier.HOST)
        if host is None or self._table.find(Tier.DISK) is None or self._ctl.mover is None:
            return 0
        return host.num_blocks - self._prefetch_reserve()

    def prefetch_room(self) -> int:
        if not self.prefetch_window():
            return 0
        return self._table.pool(Tier.HOST, "prefetch").num_free - self._prefetch_reserve()

    def _prefetch_reserve(self) -> int:
        return min(self._watermark[Tier.HOST], self._table.pool(Tier.HOST, "prefetch").num_blocks // 2)

    def prefetch(self, nodes: list[RadixNode]) -> int:
        nodes = [n for n in nodes if n.tier == Tier.DISK and n.idle][: max(0, self.prefetch_room())]
        if not nodes:
            return 0
        self._save(nodes, Tier.HOST)
        self._prefetched.update(n.hash for n in nodes)
        self.prefetch_blocks += len(nodes)
        return len(nodes)

    def count_prefetch_hits(self, nodes: list[RadixNode]) -> None:
        """A request matched ``nodes``: those a prefetch brought up count as its hits."""
        if not self._prefetched:
            return
        for n in nodes:
            if n.hash in self._prefetched and n.tier != Tier.DISK:
                self._prefetched.discard(n.hash)
                self.prefetch_hits += 1

    # -------------------------------------------------------------- loading up

    def check_swap_in(self, addrs: Sequence[int]) -> None:
        """Raise unless ``addrs`` are held blocks of slower tiers whose parents are on the
        device or come before them."""
        self._ctl.need_mover("swap_in")
        promoted: set[RadixNode] = set()
        for e in self._table.held(addrs, "swap_in"):
            if e.tier == Tier.DEVICE:
                raise MemPoolError(f"swap_in: {addr_str(e.addr)} is already on the device")
            if e.node is not None:
                parent = e.node.parent
                assert parent is not None  # a held indexed node is in the tree
                if parent is not self._index.root and parent.tier != Tier.DEVICE and parent not in promoted:
                    raise MemPoolError(f"swap_in: {addr_str(e.addr)}'s parent block is not on the device; pass it first")
                promoted.add(e.node)

    def commit_swap_in(self, addrs: Sequence[int], device_addrs: Sequence[int]) -> int:
        entries = self._table.held(addrs, "swap_in")
        intact = self._intact_prefix(entries)
        self._ctl.count_load([e.tier for e in entries[:intact]])
        moved: list[tuple[RadixNode, Held, int]] = []
        for e, d in zip(entries[:intact], device_addrs):
            if e.node is not None and e.node.addr == e.addr:
                moved.append((e.node, e, addr_block(d)))
        if not moved:
            return intact
        self._table.pool(Tier.DEVICE, "swap_in").park([b for _, _, b in moved])
        for node, e, b in moved:
            holders = node.lock
            self._index.move(node, self._table.addr(Tier.DEVICE, b), lock=1)
            self._table.pool(e.tier, "swap_in").unpark([e.block], [holders])
        self._table.moved([(node, e.tier, e.block) for node, e, _ in moved])
        return intact

    def _intact_prefix(self, entries: list[Held]) -> int:
        """How many leading entries' bytes a load delivered (all but disk misses)."""
        if self._disk is None:
            return len(entries)
        bad = self._disk.failed(e.block for e in entries if e.tier == Tier.DISK)
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
                self.forget(self._index.remove_subtree(node))
            else:
                waiting.append(node)
        self._corrupt = waiting

    # --------------------------------------------------------------- start-up

    def adopt_disk(self, entries: list[tuple[int, int | None]]) -> None:
        """Index the valid blocks an earlier run left on disk (``DiskStore.scan``: parents
        first, entry i in slot i) as cached disk blocks, one STORED event per chain run."""
        if not entries:
            return
        pool = self._table.pool(Tier.DISK, "adopt")
        slots = pool.alloc(len(entries))
        if slots != list(range(len(entries))):
            raise MemPoolError("the disk tier must be adopted before any allocation")
        pool.park(slots)
        i = 0
        while i < len(entries):
            j = i + 1
            while j < len(entries) and entries[j][1] == entries[j - 1][0]:
                j += 1
            hashes = [h for h, _ in entries[i:j]]
            addrs = make_addrs(self._table.instance_id, Tier.DISK, slots[i:j])
            nodes = self._index.add_chain(entries[i][1], hashes, addrs)
            self._table.own(Tier.DISK, slots[i:j], nodes, entries[i][1], hashes, addrs)
            i = j

    def _next_tier(self, tier: int) -> Tier | None:
        if self._ctl.mover is None:
            return None
        return next((t for t in self._table.tiers if t > tier), None)
