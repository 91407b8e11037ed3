"""A request inside a worker's scheduler: its tokens, its state and how far it has been
computed. Its KV blocks belong to the KV cache manager (``kv_manager.py``), its sampling
state to the model runner; the scheduler reasons in tokens only."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from memserve.ipc.messages import SamplingParams
from memserve.kvcache.hashing import block_hashes


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # admitted; its cached prefix is being copied in
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    session_id: str | None = None
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    predicted_output_tokens: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V is in the cache (prefix-cache hits plus everything computed).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the latest admission.
    num_cached_tokens: int = 0
    # Chained names of the leading full blocks of all_token_ids, computed once each.
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Steps admission passed it over while a running prefill computed blocks of its prompt.
    num_held_steps: int = 0
    # A choice forked from another request (n > 1, workers/engine/parallel_sampling.py): that
    # request's id and this choice's index; its outputs go out under that id.
    choice_of: str | None = None
    choice_index: int = 0
    # Why its cache_control pin was refused (it runs unpinned); reported with its outputs.
    pin_refused: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (decode steps
        need the last token only)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Names of the first ``num_blocks`` full blocks, hashing only blocks not named yet."""
        have = len(self.block_hashes)
        if num_blocks > have:
            tokens = self.token_slice(have * block_size, num_blocks * block_size)
            # The first block's seed carries the request's cache_salt (kvcache/hashing.py).
            self.block_hashes += block_hashes(tokens, block_size, self.block_hashes[-1] if have else None,
                                              self.params.kv_salt)
        return self.block_hashes[:num_blocks]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
