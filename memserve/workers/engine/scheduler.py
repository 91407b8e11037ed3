"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure logic: it decides which requests run this step and how many tokens each computes,
and returns a ``StepPlan`` of ids, tokens and block ids for the runner. It speaks requests,
not blocks: the KV cache manager hands out computed prefixes and slots, and the injected
policy orders admission and picks preemption victims. It never touches tensors or the
wall clock (the engine passes it a clock).

Mechanics: every step has a token budget. Running requests go first (one token each when
decoding, or their next prefill chunk: at most ``long_prefill_token_threshold`` tokens
when that is set, as in vLLM, so that a long prompt leaves room for short ones beside it),
oldest first unless the policy reorders them (``begin_step``); when blocks run out (or the
policy's ``KVGate`` refuses them), the policy's victim is preempted: recomputed later (its
blocks freed, its full blocks kept as cached KV) or swapped (its full blocks copied to the
host tier), as the policy says; the policy may also name running requests to preempt
before the step so that waiting ones fit (``make_room``), which, unlike a running request
going short, still lets the step admit. Waiting requests are admitted in the policy's
order while budget, request slots and blocks last, except that one sharing a block that a
running prefill has yet to compute is passed over (and put back at the head) until that
block is computed and cached (``hold_shared_prefills``), and so is one whose LoRA adapter
would make the running requests' adapters more than ``max_loras`` (vLLM's rule: the
slots that hold adapters ready bound a step's adapters); an admitted request skips its cached
prefix, and waits (``WAITING_FOR_KV``) while the slower-tier part of that prefix is copied
in, or, with layer-wise preloading, only until the runner says the copy may stream under
its prefill (``stream_loads``).

Speculative decoding. With a proposer (``--speculative-config``), a decoding request that
can draft (``ngram_proposer.can_draft``) computes its next token plus the drafts the
proposer guesses, within the step's budget and the request's limits; the drafts' slots
are allocated with the step's, or dropped when the pool has no room for them. ``update``
appends the drafts the runner kept and then its next token, checking each for a stop.

Invariant: a request is in exactly one of ``policy`` (waiting), ``loading`` (waiting for
KV), ``running``, or none (finished); the KV manager holds blocks exactly for requests in
``loading`` and ``running``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memserve.ipc.messages import RequestOutput
from memserve.workers.engine.kv_manager import KVCacheManager
from memserve.workers.engine.ngram_proposer import NgramIndex, NgramProposer, can_draft
from memserve.workers.engine.parallel_sampling import fork_choices
from memserve.workers.engine.policies import PreemptKind, SchedulePolicy
from memserve.workers.engine.sequence import Sequence, SequenceStatus
from memserve.workers.engine.step_plan import (
    BlockCopy,
    NewRequestData,
    ScheduledChunk,
    StepPlan,
    StepResult,
)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0  # a prefill computes at most this many tokens a step; 0: no cap
    hold_shared_prefills: bool = True  # admission passes over requests sharing blocks a running prefill computes
    max_loras: int = 0  # LoRA adapters the running requests may use at once (vLLM's --max-loras); 0: no cap


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: SchedulePolicy, config: SchedulerConfig,
                 eos_token_ids: set[int], clock: Callable[[], float], proposer: NgramProposer | None = None) -> None:
        self.kv = kv
        self.proposer = proposer  # drafts for decoding requests (speculative decoding); None: off
        self._ngrams: dict[str, NgramIndex] = {}
        self.draft_tokens_total = 0
        self.accepted_tokens_total = 0
        self.policy = policy
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}
        self._requests: dict[str, Sequence] = {}
        self._unseen: set[str] = set()  # admitted, not yet announced to the runner
        self._finished_ids: list[str] = []  # left since the last plan
        self.num_preemptions = 0
        self.num_held_admissions = 0  # requests admitted after a hold for a running prefill's blocks
        self.preemptions = {kind.value: 0 for kind in PreemptKind}
        self.kv.gate = policy.attach(kv)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    # ----------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> RequestOutput | None:
        """Queue a request; returns an error output at once if it can never fit (the
        engine caps the context by the pool, so a request that fits it fits the pool)."""
        max_len = self.config.max_model_len
        if seq.num_prompt_tokens == 0 or seq.num_prompt_tokens >= max_len:
            return self.reject(seq, f"prompt of {seq.num_prompt_tokens} tokens does not fit the context window "
                                     f"of {max_len} tokens")
        self._requests[seq.request_id] = seq
        self.policy.push(seq)
        return None

    def abort(self, request_id: str) -> Sequence | None:
        """Abort a request with all its choices (n > 1), or one choice by its own id."""
        for choice in [s for s in self._requests.values() if s.choice_of == request_id]:
            self._abort(choice)
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._abort(seq)
        return seq

    def _abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING:
            self.policy.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_KV:
            del self.loading[seq.request_id]
        else:
            self.running.remove(seq)
        self._finish(seq, "abort")

    def request_ids(self) -> list[str]:
        """Every request not finished, in any state."""
        return list(self._requests)

    @property
    def has_work(self) -> bool:
        return bool(len(self.policy) or self.running or self.loading or self.kv.has_abandoned_loads)

    @property
    def num_waiting(self) -> int:
        return len(self.policy) + len(self.loading)

    def finish_loads(self, request_ids: list[str]) -> None:
        """The runner finished copying these requests' cached prefixes: they run from the
        next step on (their first chunk's slots were reserved at admission)."""
        for rid in request_ids:
            if self.kv.finish_load(rid):
                self._run_loading(rid)

    def stream_loads(self, request_ids: list[str]) -> None:
        """Layer-wise preloading: these requests run from the next step on while the rest
        of their prefix is copied in; their forward pass waits for each layer's copy."""
        for rid in request_ids:
            self._run_loading(rid)

    def _run_loading(self, rid: str) -> None:
        seq = self.loading.pop(rid, None)
        if seq is None:  # already streaming (or left)
            return
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._unseen.add(rid)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        now = self.clock()
        for victim in self.policy.make_room(self.running, now, budget):  # for waiting requests
            self.running.remove(victim)
            self._preempt(victim)
            plan.preempted_ids.append(victim.request_id)
        made_room = len(plan.preempted_ids)
        budget = self.policy.begin_step(self.running, now, budget)
        running, allocate_slots, chunks = self.running, self.kv.allocate_slots, plan.chunks
        max_drafts = self.proposer.config.max_drafts(len(running)) if self.proposer is not None else 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = self._num_new_tokens(seq, budget)
            drafts = self._drafts(seq, min(budget - 1, max_drafts)) if max_drafts and num_new == 1 else []
            # A guess never takes a block the requests after this one may need for their next token.
            if drafts and not allocate_slots(seq, 1 + len(drafts), reserve=len(running) - i - 1):
                drafts = []  # no room for guesses: decode the one token
            while not allocate_slots(seq, num_new):
                victim = self.policy.victim(self.running, seq)
                self.running.remove(victim)
                self._preempt(victim)
                plan.preempted_ids.append(victim.request_id)
                if victim is seq:
                    break
            else:
                chunks.append(self._chunk(seq, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1
        if len(plan.preempted_ids) == made_room and len(self.policy):  # requests wait, and no running one went short
            self._admit(plan, budget)
        plan.loads, plan.copies = self.kv.take_loads(), self.kv.take_copies()
        if self._unseen:
            plan.new_requests = [NewRequestData(c.request_id, self._requests[c.request_id].params,
                                                self._requests[c.request_id].prompt_token_ids,
                                                list(self._requests[c.request_id].output_token_ids))
                                 for c in plan.chunks if c.request_id in self._unseen]
            self._unseen.difference_update([r.request_id for r in plan.new_requests])
        plan.finished_ids, self._finished_ids = self._finished_ids, []
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting requests in the policy's order while budget, slots and blocks
        last. A request whose cached prefix must first be loaded gets the slots of its
        first chunk now too, so it can run as soon as the load is done. A request that
        shares a block with the part of a running prompt not computed yet is passed over
        this step, and the requests behind it are not (``_blocks_computing``); so is one
        whose adapter would pass ``max_loras`` adapters among the requests holding blocks."""
        computing = self._blocks_computing() if self.config.hold_shared_prefills and len(self.policy) else None
        adapters = self._adapters_running() if self.config.max_loras else None
        passed_over: list[Sequence] = []
        while budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            seq = self.policy.peek()
            if seq is None or self.kv.load_in_flight(seq.request_id):
                break
            if computing and not computing.isdisjoint(self.kv.prefix_names(seq)):
                passed_over.append(self.policy.pop())
                seq.num_held_steps += 1
                continue
            adapter = _adapter(seq)
            if adapters is not None and adapter is not None and adapter not in adapters:
                if len(adapters) >= self.config.max_loras:
                    passed_over.append(self.policy.pop())  # until a running adapter's requests are done
                    continue
                adapters.add(adapter)
            loading = self.kv.admit(seq, self.kv.get_computed_blocks(seq))
            num_new = self._num_new_tokens(seq, budget)
            if not self.kv.allocate_slots(seq, num_new):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                if not self.running and not self.loading and self.kv.connector.release_adopted(keep=seq.request_id):
                    continue  # nothing else would free blocks: KV held by requests behind it goes
                break
            self.policy.pop()
            self._count_admission(seq)
            if loading:
                seq.status = SequenceStatus.WAITING_FOR_KV
                self.loading[seq.request_id] = seq
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._unseen.add(seq.request_id)
            plan.chunks.append(self._chunk(seq, num_new))
            budget -= num_new
            if computing is not None:
                computing.update(self.kv.names_to_compute(seq))
        for seq in reversed(passed_over):  # back at the head, in their order
            self.policy.push_preempted(seq)

    def _adapters_running(self) -> set[tuple[str, str]]:
        """The LoRA adapters of the requests that hold blocks (running or loading)."""
        seqs = [*self.running, *self.loading.values()]
        return {adapter for adapter in map(_adapter, seqs) if adapter is not None}

    def _blocks_computing(self) -> set[int]:
        """Names of the prompt blocks running requests have yet to compute. A waiting
        request that shares one would compute it a second time if admitted now; passed
        over until its sharer has computed it, it finds it cached (copies of a prompt
        routed to one instance arrive while the first is still in prefill; SGLang's
        in-batch prefix caching passes over such requests the same way)."""
        computing: set[int] = set()
        for seq in self.running:
            computing.update(self.kv.names_to_compute(seq))
        return computing

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` computes this step: what it has left, within the step's budget and
        the long-prefill cap (which keeps a long prompt from filling every step while short
        ones wait behind it)."""
        num_new = seq.num_tokens - seq.num_computed_tokens
        cap = self.config.long_prefill_token_threshold
        if 0 < cap < num_new:
            num_new = cap
        return min(num_new, budget)

    def _count_admission(self, seq: Sequence) -> None:
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prompt_tokens_total += seq.num_prompt_tokens
            self.cached_tokens_total += seq.num_cached_tokens
            if seq.num_held_steps:
                self.num_held_admissions += 1

    def _chunk(self, seq: Sequence, num_new: int, drafts: list[int] | None = None) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + num_new
        chunk = ScheduledChunk(seq.request_id, seq.token_slice(start, end), start,
                               self.kv.block_ids(seq.request_id), end == len(seq.prompt_token_ids) + len(seq.output_token_ids))
        if drafts:
            chunk.token_ids += drafts
            chunk.num_drafts = len(drafts)
            self.draft_tokens_total += len(drafts)
        return chunk

    def _drafts(self, seq: Sequence, most: int) -> list[int]:
        """At most ``most`` guesses of the tokens after a decoding request's next one, as
        many as its limits leave room for: each accepted draft is an output token and a
        computed position, and the step after the drafts still samples one token."""
        if seq.num_computed_tokens != seq.num_tokens - 1 or not can_draft(seq.params):
            return []
        assert self.proposer is not None
        limit = min(most, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                    self.config.max_model_len - seq.num_tokens - 1)
        index = self._ngrams.setdefault(seq.request_id, NgramIndex())
        return self.proposer.propose(index, seq.all_token_ids, limit)

    def _preempt(self, seq: Sequence) -> None:
        kind = self.policy.preempt_kind(seq)
        if kind is PreemptKind.SWAP:
            self.kv.swap_out(seq)
        else:
            self.kv.free(seq)
        self.preemptions[kind.value] += 1
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.push_preempted(seq)

    # ----------------------------------------------------------------- update
    def take_copies(self) -> list[BlockCopy]:
        """Copies ``update`` queued (forks' copy-on-write), for the engine to run now."""
        return self.kv.take_copies()

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Advance requests by what the step computed; return this step's token deltas."""
        outputs = []
        requests, sampled, cache_full_blocks = self._requests, result.sampled, self.kv.cache_full_blocks
        with_logprobs = bool(result.logprobs or result.prompt_logprobs)
        running = SequenceStatus.RUNNING
        for chunk in plan.chunks:
            seq = requests.get(chunk.request_id)
            if seq is None or seq.status is not running:
                continue  # aborted while the step ran
            token = sampled.get(chunk.request_id)
            tokens = [] if token is None else [*result.accepted_drafts.get(chunk.request_id, ()), token]
            for i, t in enumerate(tokens):
                seq.output_token_ids.append(t)
                self._check_stop(seq, t)
                if seq.status is SequenceStatus.FINISHED:
                    tokens = tokens[:i + 1]
                    break
            # The chunk's own tokens, and every kept draft before the last token appended.
            seq.num_computed_tokens += len(chunk.token_ids) - chunk.num_drafts + max(len(tokens) - 1, 0)
            if chunk.num_drafts and token is not None:
                kept = len(result.accepted_drafts.get(chunk.request_id, ()))
                self.accepted_tokens_total += kept
                self._ngrams[chunk.request_id].record(chunk.num_drafts, kept)
            cache_full_blocks(seq)
            if token is not None and seq.params.n > 1:
                self._fork(seq)
            if seq.status is SequenceStatus.FINISHED:
                self.running.remove(seq)
                self._release(seq)
            if token is not None:
                outputs.append(self._output(seq, tokens))
                if with_logprobs:
                    outputs[-1].logprobs, outputs[-1].prompt_logprobs = result.logprobs_of(chunk.request_id)
        return outputs

    def _fork(self, parent: Sequence) -> None:
        """Start choices 1..n-1 of a request whose prompt was just computed, on that
        prompt's KV (``parallel_sampling.py``); a choice the pool or the batch has no room
        for now waits, and is admitted like any request."""
        for child in fork_choices(parent):
            self._requests[child.request_id] = child
            if len(self.running) < self.config.max_num_seqs and self.kv.fork(parent, child):
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                self._unseen.add(child.request_id)
            else:
                self.policy.push(child)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, "stop", release=False)
        elif (len(seq.output_token_ids) >= params.max_tokens
              or len(seq.prompt_token_ids) + len(seq.output_token_ids) >= self.config.max_model_len):
            self._finish(seq, "length", release=False)

    def _finish(self, seq: Sequence, reason: str, release: bool = True) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if release:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self._requests.pop(seq.request_id, None)
        self._ngrams.pop(seq.request_id, None)
        self._unseen.discard(seq.request_id)
        self._finished_ids.append(seq.request_id)

    def reject(self, seq: Sequence, message: str, status: int | None = None) -> RequestOutput:
        """End a request before it is queued: an error output (``status``: the HTTP status
        the gateway answers with; None: a server error)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        out = self._output(seq, [])
        out.error, out.error_status = message, status
        return out

    @staticmethod
    def _output(seq: Sequence, tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.choice_of or seq.request_id,
            index=seq.choice_index,
            new_token_ids=tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            pin_refused=seq.pin_refused,
        )

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "num_held_admissions": self.num_held_admissions,
            "preemptions": dict(self.preemptions),
            "num_swapped_in": self.kv.num_loaded_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "cache_hit_rate": self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0,
            "spec_draft_tokens_total": self.draft_tokens_total,
            "spec_accepted_tokens_total": self.accepted_tokens_total,
            **self.policy.stats(),
        }


def _adapter(seq: Sequence) -> tuple[str, str] | None:
    """The LoRA adapter a request runs through, as the runner's slots name it (None: the base model)."""
    name = seq.params.lora_name
    return None if name is None else (name, seq.params.lora_digest)
