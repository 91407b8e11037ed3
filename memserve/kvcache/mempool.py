"""MemPool: one instance's KV memory, index and transfer API (MemServe Table 1).

The engine allocates blocks for running requests (``alloc_mem``/``free_mem``), turns
finished prompts into cached context (``insert``), looks prompts up (``match``), moves
cached blocks between tiers (``swap_out``/``swap_in``) and ships KV to other instances
(``transfer``/``transfer_with_insert``). Every API speaks addresses (``address.py``).

Ownership. A block is either *private* (held by its owners, reference-counted in its
tier's ``BlockPool``) or *indexed* (owned by the radix index; its references are the
node's ``lock``). ``insert`` turns private blocks into indexed ones, moving their
references along; an indexed block nobody holds is cached: it stays in the tier until
eviction needs the room.

Tiers. Pools exist for the tiers given in ``num_blocks``; cached blocks cascade device
-> host -> disk -> dropped, driven by capacity, in the order of the injected eviction
policy (LRU by default). A cached block's children never sit in a faster tier than the
block itself, so a tier always gives up the deep end of a prompt first and a prompt's
cached prefix reads device blocks first, then host, then disk.

Saving down (``tiering.py``). With an asynchronous ``Saver`` the engine calls
``kick_saves`` after each step: each tier with a slower one keeps a watermark of its
blocks free or being saved (``save_watermark`` of the tier, at least ``step_blocks``). A block being saved is pinned (one index reference): it
stays readable and matchable on its source tier, cannot be evicted or deleted, and its
source block is freed only once its copy is written (``poll_saves``). Short of free
blocks, ``alloc_mem`` waits for the saves in flight out of the tier and demotes idle
blocks on demand (as it always does with the synchronous ``InlineSaver``): a block is
dropped only where no slower tier can hold it (``dropped_unsaved`` counts the drops from
a tier that has a slower one). The disk tier (``DiskStore``) holds one checksummed file per block; the
blocks an earlier run left there are indexed at construction (STORED events), and a
disk block found missing or corrupt on loading is a miss (``commit_swap_in``), then
forgotten (REMOVED events).

Pure Python: the data moves through a ``BlockMover`` that the model runner implements.

Shape (after SGLang's ``HiRadixCache`` over its ``HiCacheController``). ``MemPool`` is
the API and owns the radix index, the hit counters and the transfer endpoint; it is
composed of parts that own the rest of the state, each stating its invariants:

- ``BlockTable`` (``block_table.py``): the per-tier block pools, which node owns which
  block, the KV event log, and the checks on addresses;
- ``TierController`` (``tier_controller.py``), an abstract base: the bytes, that is the
  mover, the saver with its queue and thread, the blocks in flight and the bytes moved
  per tier;
- ``TierMoves`` (``tiering.py``): the index side of tier moves (the cascade, saves,
  prefetches, swap-in commits).

The parts call each other only through their methods; the MemPool calls the controller
only through the interface it declares.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from enum import IntFlag
from typing import Any

from memserve.kvcache.address import Tier, addr_block, addr_str, addr_tier, make_addrs
from memserve.kvcache.block_table import BlockTable
from memserve.kvcache.blocks import MemPoolError, OutOfBlocks
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.eviction import EvictionPolicy
from memserve.kvcache.events import KVEvent
from memserve.kvcache.hashing import adapter_of, block_hashes
from memserve.kvcache.mover import BlockMover, Buffer, TransferEndpoint
from memserve.kvcache.pinning import Pins
from memserve.kvcache.radix import RadixIndex, RadixNode
from memserve.kvcache.saver import InlineSaver, Saver
from memserve.kvcache.tier_controller import BlockMoverController, TierController
from memserve.kvcache.tiering import TierMoves

__all__ = ["BlockMover", "KVFlags", "MemPool", "MemPoolError", "OutOfBlocks", "Tier"]

class KVFlags(IntFlag):
    """Flags of ``insert`` and the transfer calls."""

    NONE = 0
    #: insert: drop the caller's references once indexed (active -> historical KV);
    #: transfer: the receiver drops its references once written (and inserted).
    RELEASE = 1
    #: transfer: the receiver allocates in its host tier instead of its device tier.
    HOST = 2


_RELEASE = int(KVFlags.RELEASE)  # tested as a plain int: an IntFlag operation takes a microsecond


class MemPool:
    """MemServe's elastic memory pool for one inference instance."""

    def __init__(
        self,
        instance_id: int,
        num_blocks: dict[Tier, int],
        block_size: int,
        enable_caching: bool = True,
        mover: BlockMover | None = None,
        clock: Callable[[], float] | None = None,
        eviction: EvictionPolicy | None = None,
        saver: Saver | None = None,
        disk: DiskStore | None = None,
        save_watermark: float = 0.1,
        step_blocks: int = 0,
        max_pinned_fraction: float = 0.0,
        max_pinned_fraction_per_key: float | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._table = BlockTable(instance_id, num_blocks)
        self.tiers = self._table.tiers  # the tiers this pool has blocks in, fastest first
        clock = clock if clock is not None else itertools.count().__next__
        self.index = RadixIndex(block_size, clock, eviction)
        # Blocks requests pinned (cache_control); None: pinning is off.
        self.pins = (Pins(self.index, [self._table.pool(t, "pins").num_blocks for t in self.tiers],
                          max_pinned_fraction, clock, max_pinned_fraction_per_key) if max_pinned_fraction > 0 else None)
        # Set to a dict by a consumer that needs the tokens of stored blocks (the worker's
        # vLLM-format KV event publisher): insert records hash -> the block's tokens there,
        # and the consumer takes them out. None: nothing is recorded.
        self.event_tokens: dict[int, Sequence[int]] | None = None
        # Beside them, the LoRA adapter of each prompt's first block (its children are the
        # same adapter's: the adapter is part of the first block's name).
        self.event_adapters: dict[int, str] = {}
        self._hit_tokens = 0
        self._query_tokens = 0
        self._hits = [0] * len(Tier)  # per tier: blocks matched there
        self._transfer: TransferEndpoint | None = None
        self._ctl: TierController = BlockMoverController(mover, saver if saver is not None else InlineSaver(mover))
        self.disk = disk  # the DISK tier's files, when there is one
        self._moves = TierMoves(self.index, self._table, self._ctl, disk, save_watermark, step_blocks)
        if disk is not None:
            disk_pool = self._table.find(Tier.DISK)
            if disk_pool is None or disk_pool.num_blocks != disk.num_blocks:
                raise ValueError("a disk store needs a DISK tier of as many blocks")
            self._moves.adopt_disk(disk.scan(instance_id))

    @property
    def mover(self) -> BlockMover | None:
        """The bytes behind block ids (None: no tier moves, no transfers)."""
        return self._ctl.mover

    @property
    def saver(self) -> Saver:
        """Where demotions are copied (``saver.py``)."""
        return self._ctl.saver

    # ---------------------------------------------------------------- memory

    def alloc_mem(self, size: int, type: Tier = Tier.DEVICE, instance: int | None = None,  # noqa: A002
                  ticket: str = "") -> list[int]:
        """``size`` blocks of tier ``type`` on ``instance`` (default: this one), each held
        once by the caller. Evicts cached blocks when the free list is short; raises
        ``OutOfBlocks`` and allocates nothing when even that is not enough. A remote
        allocation asks that instance over the transfer endpoint, for the transfer it
        expects under ``ticket``."""
        if instance is not None and instance != self.instance_id:
            return self._endpoint().allocate(instance, size, Tier(type), ticket)
        pool = self._table.pool(type, "alloc_mem")
        short = size - pool.num_free
        if short > 0:
            self._moves.make_room(type, size, short)
        return make_addrs(self.instance_id, type, pool.alloc(size))

    def can_alloc(self, size: int, tier: Tier = Tier.DEVICE) -> bool:
        """Whether ``alloc_mem(size, tier)`` would succeed now (free + evictable blocks)."""
        pool = self._table.find(tier)
        if pool is None:
            return False
        self._moves.catch_up_saves(tier, size - pool.num_free)
        return size <= pool.num_free + self.index.idle_count(tier)

    def free_mem(self, addrs: Sequence[int]) -> None:
        """Drop one reference on each address. An unindexed block nobody holds returns to
        the free list; an indexed one stays cached. All or nothing: misuse (double free,
        unknown or foreign address) raises ``MemPoolError`` and changes nothing."""
        groups = self._table.split(addrs, "free_mem")
        if len(groups) > 1:
            for tier, blocks in groups:
                self._table.check_release(tier, blocks)
        for tier, blocks in groups:
            self._release(tier, blocks)

    def _release(self, tier: int, blocks: list[int]) -> None:
        pool = self._table.pool(tier, "free_mem")
        if not self.index.cached_count(tier):
            try:
                pool.free(blocks)
            except MemPoolError:
                self._table.check_release(tier, blocks)  # raises, naming the address
                raise
            return
        owners = self._table.owners(tier)
        nodes = []
        private = []
        for b in blocks:
            node = owners[b]
            if node is None:
                private.append(b)
            else:
                nodes.append(node)
        try:
            self.index.unlock(nodes)
        except MemPoolError:
            self._table.check_release(tier, blocks)  # raises, naming the address
            raise
        try:
            pool.free(private)
        except MemPoolError:
            self.index.lock(nodes)
            self._table.check_release(tier, blocks)
            raise

    # ----------------------------------------------------------------- index

    def insert(self, tokens: Sequence[int], addrs: Sequence[int], flags: int = 0, hashes: Sequence[int] | None = None,
               salt: str | None = None) -> int:
        """Index the full blocks of ``tokens`` (``addrs[i]`` holds block i) and return how
        many were newly indexed. A block whose name is already cached keeps its cached
        copy; the given address then stays private to the caller. ``hashes`` (the
        prompt's ``block_hashes``) skips hashing when the caller already has them;
        ``salt``: the prompt's ``cache_salt`` (names its blocks apart)."""
        newly = 0
        if self.enable_caching:
            if hashes is None:
                hashes = block_hashes(tokens, self.block_size, salt=salt)
            n = min(len(hashes), len(addrs))
            start = self.index.known_prefix(hashes if len(hashes) == n else hashes[:n])
            if start < n:
                newly = self._index_chain(hashes[start - 1] if start else None, hashes[start:n], addrs[start:n])
                # Callers that pass names alone (a truncated prompt's shifted copies) give
                # no tokens: those blocks are published without them.
                if newly and self.event_tokens is not None:
                    self._record_event_blocks(tokens, hashes[:n], start, salt)
        if flags & _RELEASE:
            self.free_mem(addrs)
        return newly

    def _record_event_blocks(self, tokens: Sequence[int], hashes: Sequence[int], start: int,
                             salt: str | None) -> None:
        """Hand the event consumer the tokens of newly indexed blocks ``hashes[start:]``
        and, for a prompt's first block, its adapter."""
        assert self.event_tokens is not None
        bs = self.block_size
        if len(tokens) >= len(hashes) * bs:
            for i in range(start, len(hashes)):
                self.event_tokens[hashes[i]] = tokens[i * bs:(i + 1) * bs]
        adapter = adapter_of(salt)
        if start == 0 and adapter is not None:
            self.event_adapters[hashes[0]] = adapter

    def _index_chain(self, parent_hash: int | None, hashes: Sequence[int], addrs: Sequence[int]) -> int:
        groups = self._table.split(addrs, "insert")
        if len(groups) != 1:
            raise MemPoolError("insert: the new blocks of one call must be in one tier")
        tier, blocks = groups[0]
        if parent_hash is not None:
            parent = self.index.get(parent_hash)
            assert parent is not None  # insert found it indexed (known_prefix)
            if parent.tier > tier:
                return 0  # never below a slower parent: eviction could not go deepest-first
        try:
            locks = self._table.pool(tier, "insert").park(blocks)
        except MemPoolError as e:
            raise MemPoolError(f"insert: every new block must be held by the caller ({e})") from e
        created = self.index.add_chain(parent_hash, hashes, addrs, locks)
        self._table.own(tier, blocks, created, parent_hash, hashes, addrs)
        return len(created)

    def match(self, tokens: Sequence[int], take_ref: bool = True, hashes: Sequence[int] | None = None,
              salt: str | None = None) -> list[int]:
        """Addresses of the longest cached prefix of ``tokens`` (full blocks; an empty or
        shorter-than-a-block prompt matches nothing). With ``take_ref`` the caller holds
        each returned block until it frees it, and the lookup counts for the hit rate;
        without, it is a peek. Blocks may sit in any tier: ``swap_in`` the slow ones.
        ``salt``: the prompt's ``cache_salt`` (only blocks named with it match)."""
        if salt and hashes is None and self.enable_caching:
            hashes = block_hashes(tokens, self.block_size, salt=salt)
        if not self.enable_caching:
            nodes: list[RadixNode] = []
        elif hashes is not None:
            nodes = self.index.match_hashes(hashes)
        else:
            nodes = self.index.match(tokens)
        if take_ref:
            self.index.lock(nodes)
            self._query_tokens += len(tokens)
            self._hit_tokens += len(nodes) * self.block_size
            hits = self._hits
            for n in nodes:
                hits[n.tier] += 1
            self._moves.count_prefetch_hits(nodes)
        return [n.addr for n in nodes]

    def drop(self, node: RadixNode) -> int:
        """Unindex an idle cached block and everything below it, whatever their tiers, and
        free their blocks (REMOVED events; their disk files are deleted). Returns how
        many went (retention: ``retention.py``)."""
        removed = self.index.remove_subtree(node)
        if self.disk is not None:
            for n in removed:
                self.disk.forget(n.hash)
        self._moves.forget(removed)
        return len(removed)

    def delete(self, tokens: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        """Drop the cached blocks only this prompt uses (see ``RadixIndex.delete``);
        returns how many. ``hashes``: its block names (a salted prompt's must be given)."""
        removed = self.index.delete(tokens, hashes)
        self._moves.forget(removed)
        return len(removed)

    # ----------------------------------------------------------------- tiers

    def kick_saves(self) -> None:
        """Commit the saves that finished, then start demotions so that every tier with
        a slower one has ``watermark`` blocks free or being saved (slowest tier first:
        its saves make room for the faster tier's). Never waits for a copy."""
        self._moves.kick_saves()

    def demote(self, tier: Tier, n: int) -> int:
        """Start saving up to ``n`` of ``tier``'s least valuable idle blocks to the next
        slower tier, as far as it has room without waiting; returns how many."""
        return self._moves.demote(tier, n)

    def poll_saves(self) -> None:
        """Move the blocks whose saves finished to their copies; forget corrupt disk
        blocks nobody holds any more. Cheap and I/O-free: call it before scheduling."""
        self._moves.poll_saves()

    def flush_saves(self) -> None:
        """Wait for every save in flight and commit it (tests, shutdown)."""
        self._moves.flush_saves()

    def persist(self) -> None:
        """Save every idle cached block of the faster tiers to the disk tier, as far as
        it holds them (a graceful shutdown: the next run re-indexes them). Slower tiers
        go first, so a block never lands below a child of a faster tier."""
        self._moves.persist()

    def swap_out(self, n: int) -> list[tuple[int, int]]:
        """Move up to ``n`` least recently used cached device blocks to the host tier,
        waiting for the copies; returns ``(old, new)`` addresses. Fewer move when fewer
        are idle or the host is full of blocks in use."""
        return self._moves.swap_out(n)

    def prefetch_window(self) -> int:
        """Host blocks the look-ahead window may claim for prefetches: the host tier less
        the free blocks kept for device demotions (its watermark, at most half of it);
        0 without a disk and a host tier."""
        return self._moves.prefetch_window()

    def prefetch_room(self) -> int:
        """Host blocks a prefetch may fill now: the free ones beyond that reserve
        (negative when the host must first save that many down)."""
        return self._moves.prefetch_room()

    def prefetch(self, nodes: list[RadixNode]) -> int:
        """Start copying idle disk blocks up to the host tier through the saver
        (AttentionStore §3.3.1), parents before children, as far as ``prefetch_room``
        allows; returns how many started. Like a save, the block stays readable on disk
        meanwhile and moves only if nobody used it (then a load reads it from the host)."""
        return self._moves.prefetch(nodes)

    def swap_in(self, addrs: Sequence[int]) -> list[int]:
        """Copy held blocks of slower tiers to new device blocks; returns the device
        addresses, each held once by the caller. The caller keeps its references to the
        old addresses (free them as usual). An indexed block is re-pointed to its device
        copy; pass a prompt's blocks parent first. Raises when a disk block was missing or
        corrupt (the blocks before it are swapped in)."""
        device_addrs = self.prepare_swap_in(addrs)
        self._ctl.load(self.swap_in_copies(addrs, device_addrs))
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
        self._moves.check_swap_in(addrs)
        return self.alloc_mem(len(addrs), Tier.DEVICE)

    @staticmethod
    def swap_in_copies(addrs: Sequence[int], device_addrs: Sequence[int]) -> list[tuple[Tier, list[int], list[int]]]:
        """(source tier, source blocks, device blocks) runs that a swap-in copies."""
        pairs = [(addr_tier(a), addr_block(a), addr_block(d)) for a, d in zip(addrs, device_addrs)]
        return [(tier, [p[1] for p in run], [p[2] for p in run])
                for tier, run in ((t, list(g)) for t, g in itertools.groupby(pairs, key=lambda p: p[0]))]

    def commit_swap_in(self, addrs: Sequence[int], device_addrs: Sequence[int]) -> int:
        """Second half of an asynchronous ``swap_in``, once the copies are done: indexed
        sources are re-pointed to their device copies. A source another swap-in already
        promoted keeps that copy; this one's stays private to the caller. Returns how
        many leading blocks arrived: a disk block whose file was missing or corrupt, and
        every block after it, are not committed (their device blocks stay private to the
        caller, to recompute) and the bad blocks are forgotten once nobody holds them."""
        return self._moves.commit_swap_in(addrs, device_addrs)

    # -------------------------------------------------------------- transfer

    def attach_transfer(self, endpoint: TransferEndpoint) -> None:
        """Called by the endpoint that carries this instance's transfers (``ipc/kv_transfer.py``):
        the bytes of ``transfer`` travel through it, never through the MemPool."""
        if self._transfer is not None and self._transfer is not endpoint:
            raise MemPoolError("a transfer endpoint is already attached")
        self._transfer = endpoint

    def transfer(
        self, instance: int, src: Sequence[int], dst: Sequence[int] | None = None, flags: int = 0,
        private: Any = None, ticket: str = "",
    ) -> list[int]:
        """Copy the held blocks ``src`` to ``instance`` and return their addresses there.
        Without ``dst`` the receiver allocates them (device, or host with ``KVFlags.HOST``);
        ``private`` (msgpack-able) reaches the receiving engine with the addresses. The
        receiver accepts only a transfer it expects under ``ticket``."""
        return self._endpoint().send(instance, list(src), dst, flags, private, ticket)

    def transfer_with_insert(
        self,
        instance: int,
        tokens: Sequence[int],
        src: Sequence[int],
        dst: Sequence[int] | None = None,
        flags: int = 0,
        private: Any = None,
        first_block: int = 0,
        ticket: str = "",
    ) -> list[int]:
        """``transfer`` plus an ``insert(tokens, ...)`` at the receiver, saving a round
        trip. ``src`` holds blocks ``first_block..`` of ``tokens``; the receiver must have
        the blocks before ``first_block`` cached (incremental transfer)."""
        return self._endpoint().send(instance, list(src), dst, flags, private, ticket, list(tokens), first_block)

    def check_held(self, addrs: Sequence[int], op: str) -> None:
        """Raise unless every address is a local block someone holds."""
        self._table.held(addrs, op)

    def read_blocks(self, addrs: Sequence[int]) -> list[Buffer]:
        """The bytes of held blocks, in order, as the mover's per-run buffers."""
        self._ctl.need_mover("read_blocks")
        return self._ctl.read(self._table.runs_by_tier(addrs, "read_blocks"))

    def write_blocks(self, addrs: Sequence[int], buffers: Sequence[Buffer]) -> None:
        """Store blocks given back to back across ``buffers`` (the sender's runs) into
        held blocks ``addrs``, re-cut into this pool's runs for the mover."""
        self._ctl.need_mover("write_blocks")
        self._ctl.write(self._table.runs_by_tier(addrs, "write_blocks"), buffers)

    def _endpoint(self) -> TransferEndpoint:
        if self._transfer is None:
            raise MemPoolError("no transfer endpoint attached to this MemPool")
        return self._transfer

    # ----------------------------------------------------------------- state

    def drain_events(self) -> list[KVEvent]:
        """Index changes since the last call, in order (for ``KVEvents``)."""
        return self._table.drain_events()

    def stats(self) -> dict[str, Any]:
        """Hit rate; per tier (``device``, ...) its block counts (``used``: held by
        requests; ``pinned``, with pinning on: blocks pinned there); under ``tier_io`` per
        tier: bytes in use, blocks matched there, bytes read from and written to it, blocks
        being saved out of it, blocks dropped from it though a slower tier exists
        (``dropped_unsaved``); ``save_queue``: save jobs not yet committed."""
        out: dict[str, Any] = {
            "hit_tokens": self._hit_tokens,
            "query_tokens": self._query_tokens,
            "hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            "save_queue": self._ctl.pending(),
        }
        io: dict[str, dict[str, int]] = {}
        nbytes = self._ctl.block_nbytes
        for tier in self.tiers:
            pool = self._table.pool(tier, "stats")
            allocated = pool.num_blocks - pool.num_free
            name = tier.name.lower()
            out[name] = self.tier_stats(tier)
            read, written = self._ctl.io_bytes(tier)
            io[name] = {
                "bytes_used": allocated * nbytes,
                "hits": self._hits[tier],
                "read_bytes": read,
                "write_bytes": written,
                "saving": self._ctl.saving(tier),
                "dropped_unsaved": self._moves.dropped_unsaved(tier),
                # blocks queued or in flight between this tier and another (saves, prefetches)
                "queue_depth": self._ctl.saving(tier) + self._ctl.incoming(tier),
            }
        if self.pins is not None:
            for tier, n in self.pins.per_tier().items():
                if tier in self.tiers:
                    out[tier.name.lower()]["pinned"] = n
        if Tier.HOST in self.tiers and Tier.DISK in self.tiers:
            io["host"]["prefetched"] = self._moves.prefetch_blocks
            io["host"]["prefetch_hits"] = self._moves.prefetch_hits
        out["tier_io"] = io
        return out

    def tier_stats(self, tier: Tier) -> dict[str, int]:
        """One tier's block counts, as in ``stats`` (without pins)."""
        pool = self._table.pool(tier, "stats")
        evictable = self.index.idle_count(tier)
        return {
            "total": pool.num_blocks,
            "free": pool.num_free,
            "cached": self.index.cached_count(tier),
            "evictable": evictable,
            "used": pool.num_blocks - pool.num_free - evictable - self._ctl.saving(tier) - self._ctl.incoming(tier),
        }

    def close(self) -> None:
        """Finish and commit the saves in flight, save what the faster tiers cache to the
        disk tier (``persist``), then stop the saver."""
        self.flush_saves()
        if self.disk is not None:
            self.persist()
        self._ctl.close()

