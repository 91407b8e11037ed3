"""What the scheduler tells the model runner to do in one step, and what comes back.

A plan names requests by id and KV blocks by id; it carries the token ids to compute but
no live object, so the runner cannot touch scheduler state and a simulated runner can
execute the same plan (after vLLM v1's ``SchedulerOutput``). The runner keeps what it
needs across steps (sampling parameters, a seed) from ``new_requests`` until
the request's id appears in ``finished_ids``."""

from __future__ import annotations

from dataclasses import dataclass, field

from memserve.ipc.messages import SamplingParams, TokenLogprobs
from memserve.kvcache.address import Tier


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen yet."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)  # penalties look at the prompt
    # Tokens sampled before this instance saw the request (a disaggregated prefill's
    # first token): penalties count them, and a seeded request's draws, keyed by output
    # position, go on after them.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ScheduledChunk:
    """New tokens of one request computed this step."""

    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    start_pos: int  # position of token_ids[0] (tokens before it are in the KV cache)
    block_ids: list[int]  # the request's device block table, covering start_pos + len(token_ids)
    sample: bool  # True when the last token's logits give the request's next token
    # The last num_drafts of token_ids are guesses of the tokens after the first one
    # (``ngram_proposer.py``): the runner keeps those the model agrees with.
    num_drafts: int = 0


@dataclass
class KVLoad:
    """A copy of KV blocks into device blocks that a request waits for (a slower tier's
    cached prefix). The sources are held by the request until the load is done."""

    request_id: str
    copies: list[tuple[int, list[int], list[int]]]  # (source tier, source block ids, device block ids)
    num_new_tokens: int = 0  # tokens the request computes after the load (sizes a preload's read buffer)


@dataclass
class BlockCopy:
    """A copy of blocks the scheduler decided (a swap-out to the host tier, a fork's
    copy-on-write), run by the engine before the blocks are written again. ``hold``:
    MemPool addresses referenced until the copy has run (a swap-out's host copies, so
    they are neither evicted nor saved further down before they hold the data)."""

    src_tier: Tier
    src_blocks: list[int]
    dst_tier: Tier
    dst_blocks: list[int]
    hold: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)  # to start this step
    copies: list[BlockCopy] = field(default_factory=list)  # to run before this step computes
    finished_ids: list[str] = field(default_factory=list)  # left since the last plan: forget them
    preempted_ids: list[str] = field(default_factory=list)
    # Device blocks whose every layer the step's hooks read as it is computed (by-layer
    # sends, in the order they read), named before the plan goes to a tensor-parallel
    # worker's other ranks: each read gathers every rank's part, so each rank joins it.
    layer_reads: list[list[int]] = field(default_factory=list)

    def only(self, chunk: ScheduledChunk) -> StepPlan:
        """The same plan restricted to one chunk (to find which request fails a step)."""
        new = [r for r in self.new_requests if r.request_id == chunk.request_id]
        return StepPlan(new_requests=new, chunks=[chunk])


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> next token
    # For requests that asked: the sampled token's log-probabilities, and those of the
    # whole prompt (given once, in the step that samples the first token).
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Drafts the model agreed with (request id -> tokens): they come before its next token.
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)

    def logprobs_of(self, request_id: str) -> tuple[list[TokenLogprobs] | None, list[TokenLogprobs] | None]:
        """What a request's output of this step carries: its sampled token's and its
        prompt's log-probabilities, each None when not asked for (or not due)."""
        sampled = self.logprobs.get(request_id)
        return (None if sampled is None else [sampled]), self.prompt_logprobs.get(request_id)

    def merge(self, other: StepResult) -> None:
        self.sampled.update(other.sampled)
        self.accepted_drafts.update(other.accepted_drafts)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
