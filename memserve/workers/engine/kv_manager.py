"""The request-level boundary between the scheduler and the MemPool (after vLLM v1's
``KVCacheManager``): the scheduler asks for a request's computed prefix and for slots for
its next tokens, and never does block arithmetic, tier moves or indexing itself.

Invariants:
- Every block a request holds is listed here (``_blocks``), device blocks in token order;
  ``free`` returns all of them, so a request that leaves in any state leaks nothing.
- A cached prefix found in a slower tier is never copied inside ``schedule()``: admission
  reserves device blocks for it and queues a ``KVLoad``; the request waits in
  ``WAITING_FOR_KV`` while the engine keeps stepping others, and ``finish_load`` turns
  the copies into its computed prefix once the runner reports them done. With layer-wise
  preloading the request may run before that (its forward pass waits per layer); its
  blocks are indexed only after ``finish_load``.
- Full blocks are offered to the index once each, as soon as they are computed.
- No copy runs here: a swap-out's copy to the host tier and a fork's copy-on-write are
  queued (``take_copies``) for the engine to run before the blocks are next written.
- KV that crosses instances (adopted from a prefill instance, kept for a handoff) is the
  ``KVConnector``'s (``kv_connector.py``); this manager asks it at admission and release.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.kvcache.retention import Retention
from memserve.workers.engine.kv_connector import ComputedPrefix, KVConnector
from memserve.workers.engine.sequence import Sequence
from memserve.workers.engine.step_plan import BlockCopy, KVLoad


class KVGate(Protocol):
    """A scheduling policy's say over KV growth (``policies.SchedulePolicy.attach``),
    consulted only when a request needs new blocks (so a policy without one costs nothing)."""

    def grant(self, seq: Sequence, held: int, need: int) -> bool:
        """May ``seq``, holding ``held`` device blocks, take ``need`` more now?"""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` gave up all its blocks (finished, aborted or preempted)."""
        ...


@dataclass(slots=True)
class _RequestBlocks:
    addrs: list[int] = field(default_factory=list)  # device MemPool addresses, in token order
    ids: list[int] = field(default_factory=list)  # their block ids (the runner's block table)
    num_indexed: int = 0  # leading full blocks offered to the index
    loading: list[int] = field(default_factory=list)  # slow-tier sources of a load in flight
    loading_dst: list[int] = field(default_factory=list)  # the device blocks they are copied to
    loading_seq: Sequence | None = None  # the request loading (its prefix shrinks if a block is lost)


class KVCacheManager:
    def __init__(self, mempool: MemPool, connector: KVConnector, enable_caching: bool,
                 retention: Retention | None = None) -> None:
        self.mempool = mempool
        self.connector = connector
        self.retention = retention
        self.block_size = mempool.block_size
        self.enable_caching = enable_caching
        self._blocks: dict[str, _RequestBlocks] = {}
        self._pending_loads: list[KVLoad] = []  # not yet handed to the runner
        self._pending_copies: list[BlockCopy] = []  # not yet run by the engine
        # Blocks of requests that left while the runner was copying into them: freed
        # when the copy is done, never earlier (the blocks could be reused mid-copy).
        self._abandoned: dict[str, _RequestBlocks] = {}
        self.num_loaded_blocks = 0  # cached blocks brought back from slower tiers
        self.gate: KVGate | None = None  # the schedule policy's say over growth

    # ----------------------------------------------------------------- prefix
    def get_computed_blocks(self, seq: Sequence) -> ComputedPrefix:
        """The cached prefix of the request's tokens, one reference taken on each block.
        At least one token is always left to compute: its logits give the next token.
        A request that wants prompt logprobs computes its whole prompt (as vLLM does):
        they need the logits at every prompt position."""
        adopted = self.connector.take_adopted(seq.request_id)
        if adopted is not None:
            return adopted
        hashes = self.prefix_names(seq)
        if not hashes:
            return ComputedPrefix()
        hit = self.mempool.match(seq.all_token_ids[:-1], take_ref=True, hashes=hashes)
        # A block is never indexed under a slower-tier parent: slower blocks are a suffix.
        split = next((i for i, a in enumerate(hit) if addr_tier(a) != Tier.DEVICE), len(hit))
        return ComputedPrefix(hit[:split], hit[split:])

    def prefix_names(self, seq: Sequence) -> list[int]:
        """The block names a waiting request's admission looks up in the cache: its full
        blocks but the last token's; none when it will not look (caching off, prompt
        logprobs wanted, or KV adopted from a prefill instance)."""
        if (not self.enable_caching or seq.params.prompt_logprobs is not None
                or self.connector.has_adopted(seq.request_id)):
            return []
        return seq.full_block_hashes(self.block_size, (seq.num_tokens - 1) // self.block_size)

    def names_to_compute(self, seq: Sequence) -> list[int]:
        """The names of the full prompt blocks a running request has yet to compute: each
        enters the cache in the step that computes it (none without caching)."""
        first, last = seq.num_computed_tokens // self.block_size, seq.num_prompt_tokens // self.block_size
        if not self.enable_caching or first >= last:
            return []
        return seq.full_block_hashes(self.block_size, last)[first:]

    def queued_prefixes(self, waiting: Iterable[Sequence]) -> Iterator[list[int]]:
        """The block names each waiting request will look up at admission, in queue
        order (the look-ahead window's input: ``kvcache/prefetch.py``)."""
        return (self.prefix_names(seq) for seq in waiting)

    def admit(self, seq: Sequence, prefix: ComputedPrefix) -> bool:
        """Make ``prefix`` the request's computed KV; returns True when part of it must
        first be loaded from a slower tier (the request then waits for ``finish_load``).
        Without room on the device for that part, only the device part counts."""
        blocks = self._blocks.setdefault(seq.request_id, _RequestBlocks())
        blocks.addrs = list(prefix.device)
        blocks.ids = [addr_block(a) for a in prefix.device]
        blocks.num_indexed = len(prefix.device)
        if prefix.num_tokens is not None:  # adopted KV: its partly filled last block is not indexed
            blocks.num_indexed = min(blocks.num_indexed, prefix.num_tokens // self.block_size)
        loading = False
        if prefix.slow and self.mempool.can_alloc(len(prefix.slow)):
            dst = self.mempool.prepare_swap_in(prefix.slow)
            blocks.addrs += dst
            blocks.ids += [addr_block(a) for a in dst]
            blocks.loading, blocks.loading_dst, blocks.loading_seq = list(prefix.slow), dst, seq
            copies = [(int(t), src, dst_ids) for t, src, dst_ids in self.mempool.swap_in_copies(prefix.slow, dst)]
            loading = True
        elif prefix.slow:
            self.mempool.free_mem(prefix.slow)
        seq.num_computed_tokens = len(blocks.addrs) * self.block_size
        if prefix.num_tokens is not None:
            seq.num_computed_tokens = min(seq.num_computed_tokens, prefix.num_tokens)
        if loading:
            self._pending_loads.append(KVLoad(seq.request_id, copies, seq.num_tokens - seq.num_computed_tokens))
        return loading

    def take_loads(self) -> list[KVLoad]:
        """Loads queued since the last call, for the next step plan."""
        loads, self._pending_loads = self._pending_loads, []
        return loads

    def take_copies(self) -> list[BlockCopy]:
        """Copies queued since the last call (swap-outs, forks), for the engine to run
        before any of their blocks is written again."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def finish_load(self, request_id: str) -> bool:
        """The runner copied the request's slow-tier prefix: index the device copies and
        drop the references on the sources. A block that could not be read (a missing or
        corrupt disk file) ends the computed prefix there: the rest is recomputed in the
        blocks already reserved. False when the request left meanwhile (its blocks are
        freed now)."""
        abandoned = self._abandoned.pop(request_id, None)
        if abandoned is not None:
            self.mempool.free_mem(abandoned.loading + abandoned.addrs)
            return False
        blocks = self._blocks[request_id]
        src = blocks.loading
        intact = self.mempool.commit_swap_in(src, blocks.loading_dst)
        self.mempool.free_mem(src)
        blocks.num_indexed += intact  # the index holds these blocks now (ours, or another copy)
        if intact < len(src) and blocks.loading_seq is not None:
            blocks.loading_seq.num_computed_tokens = blocks.num_indexed * self.block_size
        blocks.loading, blocks.loading_dst, blocks.loading_seq = [], [], None
        self.num_loaded_blocks += intact
        return True

    def fail_load(self, request_id: str) -> bool:
        """The runner's copy of the request's prefix failed: drop the sources and never
        index the device blocks (they hold garbage; ``free`` returns them with the
        request). False when the request left meanwhile (its blocks are freed now)."""
        abandoned = self._abandoned.pop(request_id, None)
        if abandoned is not None:
            self.mempool.free_mem(abandoned.loading + abandoned.addrs)
            return False
        blocks = self._blocks[request_id]
        self.mempool.free_mem(blocks.loading)
        blocks.loading, blocks.loading_dst, blocks.loading_seq = [], [], None
        return True

    def load_in_flight(self, request_id: str) -> bool:
        """A load of an earlier admission of this request (preempted while its prefix
        was still streaming in) is still being copied: it is not admitted again until
        that copy is done, so one request never has two loads."""
        return request_id in self._abandoned

    # ----------------------------------------------------------------- slots
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones; False (and
        nothing allocated) when the pool cannot provide them now while keeping ``reserve``
        more blocks allocatable (what other requests of the step may still need)."""
        blocks = self._blocks.get(seq.request_id)
        if blocks is None:
            blocks = self._blocks[seq.request_id] = _RequestBlocks()
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks.addrs)
        if need <= 0:
            return True
        if not self.mempool.can_alloc(need + reserve):
            return False
        if self.gate is not None and not self.gate.grant(seq, len(blocks.addrs), need):
            return False
        addrs = self.mempool.alloc_mem(need)
        blocks.addrs += addrs
        blocks.ids += [addr_block(a) for a in addrs]
        return True

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` (``parent``'s prompt, which ``parent`` has computed) that prompt's
        KV up to its last token, so the child computes that one token only: the full
        blocks are shared (references through the index, like a prefix-cache hit), the
        rest is copied into the child's own blocks (copy-on-write of the partly filled
        block; without caching, every block). False, holding nothing, when the pool
        cannot provide the child's blocks now."""
        prefix = self.get_computed_blocks(child)
        if prefix.slow:
            self.mempool.free_mem(prefix.slow)  # a faster copy is made below
        self.admit(child, ComputedPrefix(prefix.device))
        shared = len(prefix.device)
        child.num_computed_tokens = child.num_prompt_tokens - 1
        if not self.allocate_slots(child, 1):
            self.free(child)
            child.num_computed_tokens = 0
            return False
        own = self._blocks[child.request_id].ids
        src = self._blocks[parent.request_id].ids[shared:len(own)]
        if src:
            self._pending_copies.append(BlockCopy(Tier.DEVICE, src, Tier.DEVICE, own[shared:]))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks[request_id].ids

    @property
    def has_abandoned_loads(self) -> bool:
        """Loads of requests that left are still being copied: their blocks await them."""
        return bool(self._abandoned)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer newly computed full blocks to the index: prompt blocks after prefill, and
        the answer's blocks as decoding fills them, so a finished request is historical KV."""
        if not self.enable_caching:
            return
        blocks = self._blocks[seq.request_id]
        if blocks.loading:  # a layer-wise preload not yet committed (``finish_load``): index after it
            return
        full = seq.num_computed_tokens // self.block_size
        if full > blocks.num_indexed:
            # Named blocks need their tokens only where stored blocks' tokens are recorded.
            tokens = seq.token_slice(0, full * self.block_size) if self.mempool.event_tokens is not None else ()
            self.mempool.insert(tokens, blocks.addrs[:full], hashes=seq.full_block_hashes(self.block_size, full))
            blocks.num_indexed = full

    @property
    def num_device_blocks(self) -> int:
        return self.mempool.stats()["device"]["total"]

    def available_blocks(self) -> int:
        """Device blocks an allocation could get now: free plus cached-but-evictable."""
        device = self.mempool.stats()["device"]
        return device["free"] + device["evictable"]

    def can_swap_out(self, seq: Sequence) -> bool:
        """Whether ``swap_out`` would keep the request's KV: prefix caching is on, it
        holds full computed blocks and the host tier has room for them."""
        blocks = self._blocks.get(seq.request_id)
        if blocks is None or blocks.loading or not self.enable_caching:
            return False
        full = min(seq.num_computed_tokens // self.block_size, len(blocks.addrs))
        return full > 0 and self.mempool.can_alloc(full, Tier.HOST)

    def swap_out(self, seq: Sequence) -> int:
        """Preempt by swapping: copy the request's full computed blocks to the host tier,
        free all its blocks, and index the host copies in place of its own device ones
        (a prefix it shares with other cached prompts keeps its device copy). Its
        readmission then finds them as a host-tier prefix and loads them back
        (``WAITING_FOR_KV``); the partly filled last block is recomputed. The copy out is
        queued (``take_copies``) and runs before the step that may reuse the device blocks
        writes them (as vLLM's swap-out); the host copies stay held, so never evicted or
        saved further down, until it has run. Returns the blocks swapped (0: no room, freed
        as for a recompute)."""
        if not self.can_swap_out(seq):
            self.free(seq)
            return 0
        blocks = self._blocks[seq.request_id]
        full = min(seq.num_computed_tokens // self.block_size, len(blocks.addrs))
        tokens = seq.token_slice(0, full * self.block_size)
        host = self.mempool.alloc_mem(full, Tier.HOST)
        self._pending_copies.append(BlockCopy(Tier.DEVICE, blocks.ids[:full], Tier.HOST,
                                              [addr_block(a) for a in host], hold=host))
        self.free(seq)
        hashes = seq.full_block_hashes(self.block_size, full)
        self.mempool.delete(tokens, hashes)
        self.mempool.insert(tokens, host, KVFlags.NONE, hashes=hashes)
        return full

    def free(self, seq: Sequence) -> None:
        """Release every block the request holds (indexed ones stay cached)."""
        if self.gate is not None:
            self.gate.release(seq)
        blocks = self._blocks.pop(seq.request_id, None)
        if blocks is None:
            self.connector.request_finished(seq.request_id, False, [])
            return
        if self.retention is not None and seq.params.cache_ttl_s:
            self.retention.extend(seq.block_hashes[: blocks.num_indexed], seq.params.cache_ttl_s)
        if self.connector.request_finished(seq.request_id, seq.is_finished and not blocks.loading, blocks.addrs):
            return  # kept for a handoff
        if blocks.loading:
            queued = len(self._pending_loads)
            self._pending_loads = [ld for ld in self._pending_loads if ld.request_id != seq.request_id]
            if len(self._pending_loads) == queued:  # the runner is copying: wait for it
                self._abandoned[seq.request_id] = blocks
                return
            self.mempool.free_mem(blocks.loading)
        if blocks.addrs:
            self.mempool.free_mem(blocks.addrs)
