"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure logic: it decides which sequences run this step and how many tokens each computes,
and keeps KV bookkeeping through the MemPool API. It never touches tensors or the wall
clock; the engine passes it a clock, and runs the model with a ``ModelRunner``.

Policy (the vLLM-style ``fcfs`` baseline): every step has a token budget. Running
sequences go first (one token each when decoding, or their next prefill chunk), oldest
first; when blocks run out, the newest running sequence is preempted (its blocks freed,
its full blocks kept as cached KV, recomputed later). Waiting sequences are admitted in
arrival order while budget, sequence slots and blocks last; an admitted sequence skips
the prefix already cached in the MemPool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from memserve.ipc.messages import RequestOutput
from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.mempool import MemPool
from memserve.workers.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What runs this step: each sequence with the number of new tokens it computes."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        mempool: MemPool,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        enable_prefix_caching: bool,
        clock: Callable[[], float],
    ) -> None:
        self.mempool = mempool
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped_in = 0  # cached blocks brought back from slower tiers
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    # ----------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> RequestOutput | None:
        """Queue a sequence; returns an error output at once if it can never fit."""
        blocks_needed = -(-min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len) // self.block_size)
        if seq.num_prompt_tokens == 0 or seq.num_prompt_tokens >= self.max_model_len:
            return self._reject(seq, f"prompt of {seq.num_prompt_tokens} tokens does not fit the context window "
                                     f"of {self.max_model_len} tokens")
        if blocks_needed > self.num_blocks:
            return self._reject(seq, f"request needs {blocks_needed} KV blocks but the pool holds "
                                     f"{self.num_blocks}")
        self.waiting.append(seq)
        return None

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._reserve(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Take the cached prefix and the blocks for the first chunk, or nothing at all."""
        if self.enable_prefix_caching:
            # Leave at least one token to compute: its logits give the next token.
            tokens = seq.all_token_ids[:-1]
            hashes = seq.full_block_hashes(self.block_size, len(tokens) // self.block_size)
            hit = self._to_device(self.mempool.match(tokens, take_ref=True, hashes=hashes))
            seq.block_addrs = hit
            seq.block_ids = [addr_block(a) for a in hit]
            seq.num_indexed_blocks = len(hit)
            seq.num_computed_tokens = len(hit) * self.block_size
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not self._reserve(seq, num_new):
            self._release(seq)
            return False
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prompt_tokens_total += seq.num_prompt_tokens
            self.cached_tokens_total += seq.num_cached_tokens
        return True

    def _to_device(self, hit: list[int]) -> list[int]:
        """Bring the slower-tier tail of a cache hit back to the device (a block is never
        indexed under a slower-tier parent, so those blocks are a suffix); keep only the
        device part when there is no room for it."""
        slow = [a for a in hit if addr_tier(a) != Tier.DEVICE]
        if not slow:
            return hit
        fast = hit[: len(hit) - len(slow)]
        swapped = self.mempool.swap_in(slow) if self.mempool.can_alloc(len(slow)) else []
        self.mempool.free_mem(slow)
        self.num_swapped_in += len(swapped)
        return fast + swapped

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        """Make sure the sequence has blocks for ``num_new`` more tokens."""
        need = -(-(seq.num_computed_tokens + num_new) // self.block_size) - len(seq.block_addrs)
        if need <= 0:
            return True
        if not self.mempool.can_alloc(need):
            return False
        addrs = self.mempool.alloc_mem(need)
        seq.block_addrs += addrs
        seq.block_ids += [addr_block(a) for a in addrs]
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_addrs:
            self.mempool.free_mem(seq.block_addrs)
        seq.block_addrs, seq.block_ids = [], []
        seq.num_computed_tokens = seq.num_indexed_blocks = 0

    # ----------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, sampled: dict[Sequence, int]) -> list[RequestOutput]:
        """Advance sequences by what the step computed; return this step's token deltas."""
        outputs = []
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
            token = sampled.get(seq)
            if token is not None:
                seq.output_token_ids.append(token)
                self._check_stop(seq, token)
            self._index_full_blocks(seq)
            if seq.is_finished:
                self.running.remove(seq)
                self._free_finished(seq)
            if token is not None:
                outputs.append(self._output(seq, [token]))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, "stop", release=False)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", release=False)

    def _index_full_blocks(self, seq: Sequence) -> None:
        """Offer newly filled blocks to the index: prompt blocks after prefill, and the
        answer's blocks as decoding fills them, so a finished request is historical KV."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_indexed_blocks:
            self.mempool.insert(seq.all_token_ids[: full * self.block_size], seq.block_addrs[:full],
                                hashes=seq.full_block_hashes(self.block_size, full))
            seq.num_indexed_blocks = full

    def _finish(self, seq: Sequence, reason: str, release: bool = True) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if release:
            self._free_finished(seq)

    def _free_finished(self, seq: Sequence) -> None:
        if seq.block_addrs:
            self.mempool.free_mem(seq.block_addrs)
        seq.block_addrs, seq.block_ids = [], []

    def _reject(self, seq: Sequence, message: str) -> RequestOutput:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        out = self._output(seq, [])
        out.error = message
        return out

    @staticmethod
    def _output(seq: Sequence, tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "num_swapped_in": self.num_swapped_in,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "cache_hit_rate": self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0,
        }
