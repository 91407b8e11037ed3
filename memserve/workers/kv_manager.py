"""The request-level boundary between the scheduler and the MemPool (after vLLM v1's
``KVCacheManager``): the scheduler asks for a request's computed prefix and for slots for
its next tokens, and never does block arithmetic, tier moves or indexing itself.

Invariants:
- Every block a request holds is listed here (``_blocks``), device blocks in token order;
  ``free`` returns all of them, so a request that leaves in any state leaks nothing.
- A cached prefix found in a slower tier is never copied inside ``schedule()``: admission
  reserves device blocks for it and queues a ``KVLoad``; the request waits in
  ``WAITING_FOR_KV`` while the engine keeps stepping others, and ``finish_load`` turns
  the copies into its computed prefix once the runner reports them done.
- Full blocks are offered to the index once each, as soon as they are computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.mempool import MemPool
from memserve.workers.sequence import Sequence
from memserve.workers.step_plan import KVLoad


@dataclass
class ComputedPrefix:
    """A request's cached prefix, held: device blocks first, then slower-tier ones."""

    device: list[int] = field(default_factory=list)
    slow: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _RequestBlocks:
    addrs: list[int] = field(default_factory=list)  # device MemPool addresses, in token order
    ids: list[int] = field(default_factory=list)  # their block ids (the runner's block table)
    num_indexed: int = 0  # leading full blocks offered to the index
    loading: list[int] = field(default_factory=list)  # slow-tier sources of a load in flight
    loading_dst: list[int] = field(default_factory=list)  # the device blocks they are copied to
    loading_seq: Sequence | None = None  # the request loading (its prefix shrinks if a block is lost)


class KVCacheManager:
    def __init__(self, mempool: MemPool, enable_caching: bool) -> None:
        self.mempool = mempool
        self.block_size = mempool.block_size
        self.enable_caching = enable_caching
        self._blocks: dict[str, _RequestBlocks] = {}
        self._pending_loads: list[KVLoad] = []  # not yet handed to the runner
        # Blocks of requests that left while the runner was copying into them: freed
        # when the copy is done, never earlier (the blocks could be reused mid-copy).
        self._abandoned: dict[str, _RequestBlocks] = {}
        self.num_loaded_blocks = 0  # cached blocks brought back from slower tiers

    # ----------------------------------------------------------------- prefix
    def get_computed_blocks(self, seq: Sequence) -> ComputedPrefix:
        """The cached prefix of the request's tokens, one reference taken on each block.
        At least one token is always left to compute: its logits give the next token.
        A request that wants prompt logprobs computes its whole prompt (as vLLM does):
        they need the logits at every prompt position."""
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return ComputedPrefix()
        tokens = seq.all_token_ids[:-1]
        hashes = seq.full_block_hashes(self.block_size, len(tokens) // self.block_size)
        hit = self.mempool.match(tokens, take_ref=True, hashes=hashes)
        # A block is never indexed under a slower-tier parent: slower blocks are a suffix.
        split = next((i for i, a in enumerate(hit) if addr_tier(a) != Tier.DEVICE), len(hit))
        return ComputedPrefix(hit[:split], hit[split:])

    def admit(self, seq: Sequence, prefix: ComputedPrefix) -> bool:
        """Make ``prefix`` the request's computed KV; returns True when part of it must
        first be loaded from a slower tier (the request then waits for ``finish_load``).
        Without room on the device for that part, only the device part counts."""
        blocks = self._blocks.setdefault(seq.request_id, _RequestBlocks())
        blocks.addrs = list(prefix.device)
        blocks.ids = [addr_block(a) for a in prefix.device]
        blocks.num_indexed = len(prefix.device)
        loading = False
        if prefix.slow and self.mempool.can_alloc(len(prefix.slow)):
            dst = self.mempool.prepare_swap_in(prefix.slow)
            blocks.addrs += dst
            blocks.ids += [addr_block(a) for a in dst]
            blocks.loading, blocks.loading_dst, blocks.loading_seq = list(prefix.slow), dst, seq
            copies = [(int(t), src, dst_ids) for t, src, dst_ids in self.mempool.swap_in_copies(prefix.slow, dst)]
            self._pending_loads.append(KVLoad(seq.request_id, copies))
            loading = True
        elif prefix.slow:
            self.mempool.free_mem(prefix.slow)
        seq.num_computed_tokens = len(blocks.addrs) * self.block_size
        return loading

    def take_loads(self) -> list[KVLoad]:
        """Loads queued since the last call, for the next step plan."""
        loads, self._pending_loads = self._pending_loads, []
        return loads

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
        if intact < len(src):
            blocks.loading_seq.num_computed_tokens = blocks.num_indexed * self.block_size  # type: ignore[union-attr]
        blocks.loading, blocks.loading_dst, blocks.loading_seq = [], [], None
        self.num_loaded_blocks += intact
        return True

    # ----------------------------------------------------------------- slots
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones; False (and
        nothing allocated) when the pool cannot provide them now."""
        blocks = self._blocks.get(seq.request_id)
        if blocks is None:
            blocks = self._blocks[seq.request_id] = _RequestBlocks()
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks.addrs)
        if need <= 0:
            return True
        if not self.mempool.can_alloc(need):
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
            self.mempool.mover.copy_blocks(Tier.DEVICE, src, Tier.DEVICE, own[shared:])  # type: ignore[union-attr]
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
        full = seq.num_computed_tokens // self.block_size
        if full > blocks.num_indexed:
            self.mempool.insert(seq.token_slice(0, full * self.block_size), blocks.addrs[:full],
                                hashes=seq.full_block_hashes(self.block_size, full))
            blocks.num_indexed = full

    def free(self, seq: Sequence) -> None:
        """Release every block the request holds (indexed ones stay cached)."""
        blocks = self._blocks.pop(seq.request_id, None)
        if blocks is None:
            return
        if blocks.loading:
            queued = len(self._pending_loads)
            self._pending_loads = [ld for ld in self._pending_loads if ld.request_id != seq.request_id]
            if len(self._pending_loads) == queued:  # the runner is copying: wait for it
                self._abandoned[seq.request_id] = blocks
                return
            self.mempool.free_mem(blocks.loading)
        if blocks.addrs:
            self.mempool.free_mem(blocks.addrs)
