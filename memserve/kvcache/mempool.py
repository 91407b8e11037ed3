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
The class is split by concern: memory, index and state here, tier moves in
``tiering.py``, the transfer API in ``transfer_api.py``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from enum import IntFlag
from typing import Any

from memserve.kvcache.address import (
    BLOCK_MASK,
    INSTANCE_SHIFT,
    TIER_MASK,
    TIER_SHIFT,
    Tier,
    addr_instance,
    addr_str,
    make_addrs,
)
from memserve.kvcache.blocks import BlockPool, MemPoolError, OutOfBlocks
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.events import REMOVED, STORED, KVEvent
from memserve.kvcache.eviction import EvictionPolicy
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mover import BlockMover
from memserve.kvcache.pinning import Pins
from memserve.kvcache.pool_state import Held
from memserve.kvcache.radix import RadixIndex, RadixNode
from memserve.kvcache.saver import InlineSaver, Saver
from memserve.kvcache.tiering import TierMoves
from memserve.kvcache.transfer_api import TransferAPI

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


def _tier_of(node: RadixNode) -> int:
    return (node.addr >> TIER_SHIFT) & TIER_MASK


class MemPool(TierMoves, TransferAPI):
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
        self.mover = mover
        self._clock = clock if clock is not None else itertools.count().__next__
        self._pools: list[BlockPool | None] = [None] * len(Tier)
        for tier, n in num_blocks.items():
            if n > 0:
                self._pools[Tier(tier)] = BlockPool(n)
        self.tiers = [Tier(t) for t, p in enumerate(self._pools) if p is not None]
        if not self.tiers:
            raise ValueError("a MemPool needs blocks in at least one tier")
        self._node_of: list[list[RadixNode | None]] = [[None] * (p.num_blocks if p else 0) for p in self._pools]
        self.index = RadixIndex(block_size, self._clock, eviction)
        self.pins = (Pins(self.index, [p.num_blocks for p in self._pools if p is not None], max_pinned_fraction,
                          self._clock, max_pinned_fraction_per_key) if max_pinned_fraction > 0 else None)
        self._events: list[KVEvent] = []
        # Set to a dict by a consumer that needs the tokens of stored blocks (the worker's
        # vLLM-format KV event publisher): insert records hash -> the block's tokens there,
        # and the consumer takes them out. None: nothing is recorded.
        self.event_tokens: dict[int, Sequence[int]] | None = None
        self._hit_tokens = 0
        self._query_tokens = 0
        self._transfer = None
        self.saver: Saver = saver if saver is not None else InlineSaver(mover)
        self.disk = disk
        # Per tier: blocks ``kick_saves`` keeps free or being saved down: a fraction of the
        # tier, and at least what one engine step allocates (``step_blocks``), so that a
        # step finds free blocks instead of dropping cached ones.
        self._watermark = [min(p.num_blocks, max(1, math.ceil(save_watermark * p.num_blocks), step_blocks))
                           if p else 0 for p in self._pools]
        self._saving = [0] * len(Tier)  # per tier: cached blocks being saved out of it (pinned)
        self._incoming = [0] * len(Tier)  # per tier: blocks reserved for saves into it
        self._io_bytes = [[0, 0] for _ in Tier]  # per tier: bytes read from it, written to it
        self._hits = [0] * len(Tier)  # per tier: blocks matched there
        self._dropped_unsaved = [0] * len(Tier)  # per tier: blocks dropped though a slower tier exists
        self._corrupt: list[RadixNode] = []  # disk blocks found bad, forgotten once idle
        self._prefetched: set[int] = set()  # blocks a prefetch started moving up, not read since
        self._prefetch_blocks = 0  # blocks prefetched disk -> host
        self._prefetch_hits = 0  # prefetched blocks a request then matched on the host
        if disk is not None:
            disk_pool = self._pools[Tier.DISK]
            if disk_pool is None or disk_pool.num_blocks != disk.num_blocks:
                raise ValueError("a disk store needs a DISK tier of as many blocks")
            self._adopt_disk(disk.scan(instance_id))

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
        pool = self._pool(type, "alloc_mem")
        short = size - pool.num_free
        if short > 0:
            self._catch_up_saves(type, short)
            short = size - pool.num_free
        if short > 0:
            if short > self.index.idle_count(type):
                raise OutOfBlocks(
                    f"alloc_mem: need {size} {Tier(type).name} blocks; {pool.num_free} free and "
                    f"{self.index.idle_count(type)} evictable of {pool.num_blocks}"
                )
            self._evict(type, short)
        return make_addrs(self.instance_id, type, pool.alloc(size))

    def can_alloc(self, size: int, tier: Tier = Tier.DEVICE) -> bool:
        """Whether ``alloc_mem(size, tier)`` would succeed now (free + evictable blocks)."""
        pool = self._pools[tier] if 0 <= tier < len(self._pools) else None
        if pool is None:
            return False
        self._catch_up_saves(tier, size - pool.num_free)
        return size <= pool.num_free + self.index.idle_count(tier)

    def _catch_up_saves(self, tier: int, short: int) -> None:
        """When ``tier``'s idle blocks cannot cover ``short`` but asynchronous saves out of
        it are in flight, wait for them: once written they free their sources (or, used
        meanwhile, become evictable again) instead of the allocation failing."""
        if 0 < short and self.index.idle_count(tier) < short and self._saving[tier] and not self.saver.inline:
            self.saver.wait()
            self._finish_saves()

    def free_mem(self, addrs: Sequence[int]) -> None:
        """Drop one reference on each address. An unindexed block nobody holds returns to
        the free list; an indexed one stays cached. All or nothing: misuse (double free,
        unknown or foreign address) raises ``MemPoolError`` and changes nothing."""
        groups = self._split(addrs, "free_mem")
        if len(groups) > 1:
            for tier, blocks in groups:
                self._check_release(tier, blocks)
        for tier, blocks in groups:
            self._release(tier, blocks)

    def _release(self, tier: int, blocks: list[int]) -> None:
        pool = self._pools[tier]
        assert pool is not None  # a tier of _split's
        if not self.index.cached_count(tier):
            try:
                pool.free(blocks)
            except MemPoolError:
                self._check_release(tier, blocks)  # raises, naming the address
                raise
            return
        owners = self._node_of[tier]
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
            self._check_release(tier, blocks)  # raises, naming the address
            raise
        try:
            pool.free(private)
        except MemPoolError:
            self.index.lock(nodes)
            self._check_release(tier, blocks)
            raise

    def _check_release(self, tier: int, blocks: list[int]) -> None:
        owners = self._node_of[tier]
        pool = self._pool(tier, "free_mem")
        for b, n in Counter(blocks).items():
            node = owners[b]
            held = node.lock if node is not None else pool.refcount(b)
            if held < n:
                where = addr_str(self._addr(tier, b))
                if held < 1:
                    raise MemPoolError(f"free_mem: {where} is not held (already freed, or never allocated)")
                raise MemPoolError(f"free_mem: {where} is held {held} times, released {n} times")

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
                if newly and self.event_tokens is not None and len(tokens) >= n * self.block_size:
                    bs = self.block_size
                    for i in range(start, n):
                        self.event_tokens[hashes[i]] = tokens[i * bs:(i + 1) * bs]
        if flags & _RELEASE:
            self.free_mem(addrs)
        return newly

    def _index_chain(self, parent_hash: int | None, hashes: Sequence[int], addrs: Sequence[int]) -> int:
        groups = self._split(addrs, "insert")
        if len(groups) != 1:
            raise MemPoolError("insert: the new blocks of one call must be in one tier")
        tier, blocks = groups[0]
        if parent_hash is not None:
            parent = self.index.get(parent_hash)
            assert parent is not None  # insert found it indexed (known_prefix)
            if _tier_of(parent) > tier:
                return 0  # never below a slower parent: eviction could not go deepest-first
        try:
            locks = self._pool(tier, "insert").park(blocks)
        except MemPoolError as e:
            raise MemPoolError(f"insert: every new block must be held by the caller ({e})") from e
        created = self.index.add_chain(parent_hash, hashes, addrs, locks)
        owners = self._node_of[tier]
        for b, node in zip(blocks, created):
            owners[b] = node
        self._events.append(KVEvent(STORED, list(hashes), parent_hash, list(addrs)))
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
                hits[(n.addr >> TIER_SHIFT) & TIER_MASK] += 1
            if self._prefetched:
                self._count_prefetch_hits(nodes)
        return [n.addr for n in nodes]

    def _count_prefetch_hits(self, nodes: list[RadixNode]) -> None:
        for n in nodes:
            if n.hash in self._prefetched and n.tier != Tier.DISK:
                self._prefetched.discard(n.hash)
                self._prefetch_hits += 1

    def drop(self, node: RadixNode) -> int:
        """Unindex an idle cached block and everything below it, whatever their tiers, and
        free their blocks (REMOVED events; their disk files are deleted). Returns how
        many went (retention: ``retention.py``)."""
        removed = self.index.remove_subtree(node)
        if self.disk is not None:
            for n in removed:
                self.disk.forget(n.hash)
        self._forget(removed)
        return len(removed)

    def delete(self, tokens: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        """Drop the cached blocks only this prompt uses (see ``RadixIndex.delete``);
        returns how many. ``hashes``: its block names (a salted prompt's must be given)."""
        removed = self.index.delete(tokens, hashes)
        self._forget(removed)
        return len(removed)

    # ----------------------------------------------------------------- state

    def drain_events(self) -> list[KVEvent]:
        """Index changes since the last call, in order (for ``KVEvents``)."""
        events, self._events = self._events, []
        return events

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
            "save_queue": self.saver.pending(),
        }
        io: dict[str, dict[str, int]] = {}
        nbytes = self.mover.block_nbytes if self.mover is not None else 0
        for tier in self.tiers:
            pool = self._pool(tier, "stats")
            allocated = pool.num_blocks - pool.num_free
            name = tier.name.lower()
            out[name] = self.tier_stats(tier)
            io[name] = {
                "bytes_used": allocated * nbytes,
                "hits": self._hits[tier],
                "read_bytes": self._io_bytes[tier][0],
                "write_bytes": self._io_bytes[tier][1],
                "saving": self._saving[tier],
                "dropped_unsaved": self._dropped_unsaved[tier],
                # blocks queued or in flight between this tier and another (saves, prefetches)
                "queue_depth": self._saving[tier] + self._incoming[tier],
            }
        if self.pins is not None:
            for tier, n in self.pins.per_tier().items():
                if tier in self.tiers:
                    out[tier.name.lower()]["pinned"] = n
        if Tier.HOST in self.tiers and Tier.DISK in self.tiers:
            io["host"]["prefetched"] = self._prefetch_blocks
            io["host"]["prefetch_hits"] = self._prefetch_hits
        out["tier_io"] = io
        return out

    def tier_stats(self, tier: Tier) -> dict[str, int]:
        """One tier's block counts, as in ``stats`` (without pins)."""
        pool = self._pool(tier, "stats")
        evictable = self.index.idle_count(tier)
        return {
            "total": pool.num_blocks,
            "free": pool.num_free,
            "cached": self.index.cached_count(tier),
            "evictable": evictable,
            "used": pool.num_blocks - pool.num_free - evictable - self._saving[tier] - self._incoming[tier],
        }

    def close(self) -> None:
        """Finish and commit the saves in flight, save what the faster tiers cache to the
        disk tier (``persist``), then stop the saver."""
        self.flush_saves()
        if self.disk is not None:
            self.persist()
        self.saver.close()

    # -------------------------------------------------------------- internals

    def _forget(self, removed: list[RadixNode]) -> None:
        """Return the blocks of nodes just removed from the index to their free lists."""
        if not removed:
            return
        for tier, group in itertools.groupby(removed, key=_tier_of):
            blocks = [n.addr & BLOCK_MASK for n in group]
            owners = self._node_of[tier]
            for b in blocks:
                owners[b] = None
            self._pool(tier, "forget").release(blocks)
        if self._prefetched:
            self._prefetched.difference_update(n.hash for n in removed)
        self._events.append(KVEvent(REMOVED, [n.hash for n in removed]))

    def _addr(self, tier: int, block: int) -> int:
        return (self.instance_id << INSTANCE_SHIFT) | (tier << TIER_SHIFT) | block

    def _split(self, addrs: Sequence[int], op: str) -> list[tuple[int, list[int]]]:
        """``(tier, blocks)`` groups of local addresses; raises on foreign or unknown ones."""
        if not addrs:
            return []
        base = addrs[0] & ~BLOCK_MASK
        tier = (base >> TIER_SHIFT) & TIER_MASK
        pool = self._pools[tier] if tier < len(self._pools) else None
        if base >> INSTANCE_SHIFT == self.instance_id and pool is not None:
            blocks = [a - base for a in addrs]
            if min(blocks) >= 0 and max(blocks) < pool.num_blocks:
                return [(tier, blocks)]
        groups: dict[int, list[int]] = {}
        for a in addrs:
            tier = (a >> TIER_SHIFT) & TIER_MASK
            if addr_instance(a) != self.instance_id:
                raise MemPoolError(f"{op}: {addr_str(a)} belongs to instance {addr_instance(a)}, this is {self.instance_id}")
            pool = self._pools[tier] if tier < len(self._pools) else None
            if pool is None or not 0 <= a & BLOCK_MASK < pool.num_blocks:
                raise MemPoolError(f"{op}: {addr_str(a)} is not a block of this pool")
            groups.setdefault(tier, []).append(a & BLOCK_MASK)
        return list(groups.items())

    def _runs_by_tier(self, addrs: Sequence[int], op: str) -> list[tuple[Tier, list[int]]]:
        """Maximal runs of consecutive same-tier held addresses, in order."""
        return [
            (Tier(tier), [e.block for e in group])
            for tier, group in itertools.groupby(self._held(addrs, op), key=lambda e: e.tier)
        ]

    def _held(self, addrs: Sequence[int], op: str) -> list[Held]:
        """Each address decoded; raises unless it is a local block someone holds."""
        self._split(addrs, op)
        if len(set(addrs)) != len(addrs):
            raise MemPoolError(f"{op}: repeated addresses")
        out = []
        for a in addrs:
            tier, block = (a >> TIER_SHIFT) & TIER_MASK, a & BLOCK_MASK
            node = self._node_of[tier][block]
            held = node.lock if node is not None else self._pool(tier, op).refcount(block)
            if held < 1:
                raise MemPoolError(f"{op}: {addr_str(a)} is not held by anyone")
            out.append(Held(a, tier, block, node))
        return out

    def _pool(self, tier: int, op: str) -> BlockPool:
        pool = self._pools[tier] if 0 <= tier < len(self._pools) else None
        if pool is None:
            raise MemPoolError(f"{op}: this pool has no {Tier(tier).name if tier < len(Tier) else tier} tier")
        return pool

    def _need_mover(self, op: str) -> BlockMover:
        if self.mover is None:
            raise MemPoolError(f"{op} needs a BlockMover")
        return self.mover
