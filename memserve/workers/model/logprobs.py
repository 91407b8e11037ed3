"""Log-probabilities for the requests that ask for them, computed batched on tensors.

Values are the log-softmax of the model's raw logits, before temperature, penalties,
biases and grammar masks change them (vLLM's default, "raw_logprobs"): they describe
the model, not the sampler. Sampled tokens get theirs from the logits the step computes
anyway; prompt tokens (``echo`` with logprobs) need the logits at every prompt position,
which are computed here for those requests' rows only.

A prompt may be computed over several chunks (chunked prefill) and, after a preemption,
computed again. The last row of a chunk predicts the first token of the next chunk, which
that chunk does not hold: its hidden state waits here until the next chunk comes. Each
prompt position is reported once, in order, whatever is computed again; the whole list
goes out in the step that samples the request's first token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from memserve.ipc.messages import SamplingParams, TokenLogprobs
from memserve.workers.engine.step_plan import ScheduledChunk

# Prompt positions whose [vocab] logits are materialised at once: 512 x 49k floats is
# 100 MB, and a 2k-token chunk done in one pass would be four times that.
MAX_ROWS_PER_PASS = 512


def token_logprobs(log_probs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """log_probs [N, V], chosen [N] token ids, and how many top tokens each row wants ->
    per row (chosen token's log-prob, top ids, top log-probs), the top ones sorted
    best first. Three host transfers for the whole batch, none per row."""
    chosen_lp = log_probs.gather(1, chosen[:, None]).squeeze(1).tolist()
    k = max(num_top, default=0)
    if k == 0:
        return [(lp, [], []) for lp in chosen_lp]
    top_lp, top_ids = log_probs.topk(k, dim=-1)
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    return [(lp, ids[:n], lps[:n]) for lp, ids, lps, n in zip(chosen_lp, top_id_rows, top_lp_rows, num_top)]


def log_softmax_rows(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], torch.Tensor | None]:
    """The rows whose request wants sampled-token logprobs and their log-softmax, taken
    before the sampler may change ``logits`` in place."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return rows, None
    picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
    return rows, torch.log_softmax(picked.float(), dim=-1)


def sampled_logprobs(rows: list[int], log_probs: torch.Tensor | None, tokens: list[int],
                     params: list[SamplingParams], request_ids: list[str]) -> dict[str, TokenLogprobs]:
    """Request id -> its sampled token's logprobs, for the ``rows`` of ``log_softmax_rows``."""
    if log_probs is None:
        return {}
    chosen = torch.tensor([tokens[i] for i in rows], device=log_probs.device)
    values = token_logprobs(log_probs, chosen, [params[i].logprobs or 0 for i in rows])
    return {request_ids[i]: v for i, v in zip(rows, values)}


@dataclass
class _PromptProgress:
    collected: list[TokenLogprobs] = field(default_factory=list)  # positions 1..len(collected)
    waiting: tuple[int, torch.Tensor] | None = None  # (position it predicts, hidden state)
    sent: bool = False


class PromptLogprobs:
    """The prompt log-probabilities of the requests that asked, as their chunks run."""

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._compute_logits = compute_logits
        self._progress: dict[str, _PromptProgress] = {}

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def step(self, chunks: list[ScheduledChunk], query_start_loc: list[int], hidden: torch.Tensor,
             params: dict[str, SamplingParams]) -> dict[str, list[TokenLogprobs]]:
        """Collect what this step's chunks tell about their prompts; return the complete
        lists of the requests whose first token this step samples."""
        # Rows to score, waiting hidden states first: within one request they come
        # before its rows of this step, and values are appended in this order.
        waiting = _Rows()
        current = _Rows()
        done: list[tuple[str, _PromptProgress]] = []
        for chunk, first_row in zip(chunks, query_start_loc):
            k = params[chunk.request_id].prompt_logprobs
            if k is None:
                continue
            progress = self._progress.setdefault(chunk.request_id, _PromptProgress())
            if progress.sent:
                continue  # computed again after a preemption: already reported
            start, ids = chunk.start_pos, chunk.token_ids
            next_position = len(progress.collected) + 1  # the first prompt position not scored yet
            if progress.waiting is not None and progress.waiting[0] == start == next_position:
                waiting.add(progress, progress.waiting[1], ids[0], k)
                next_position += 1
            # Row i predicts the token at position start + 1 + i; rows already scored are skipped.
            for i in range(max(0, next_position - start - 1), len(ids) - 1):
                current.add(progress, first_row + i, ids[i + 1], k)
            if chunk.sample:
                done.append((chunk.request_id, progress))
                progress.waiting = None
            else:
                progress.waiting = (start + len(ids), hidden[first_row + len(ids) - 1].clone())
        if waiting.owners or current.owners:
            states = [torch.stack(waiting.states)] if waiting.states else []
            if current.states:
                states.append(hidden[torch.tensor(current.states, device=hidden.device)])
            values = self._score(torch.cat(states), waiting.targets + current.targets,
                                 waiting.num_top + current.num_top)
            for progress, value in zip(waiting.owners + current.owners, values):
                progress.collected.append(value)
        for _, progress in done:
            progress.sent = True
        return {rid: progress.collected for rid, progress in done}

    def _score(self, hidden: torch.Tensor, targets: list[int], num_top: list[int]) -> list[TokenLogprobs]:
        chosen = torch.tensor(targets, device=hidden.device)
        values: list[TokenLogprobs] = []
        for lo in range(0, len(targets), MAX_ROWS_PER_PASS):
            hi = lo + MAX_ROWS_PER_PASS
            log_probs = torch.log_softmax(self._compute_logits(hidden[lo:hi]).float(), dim=-1)
            values += token_logprobs(log_probs, chosen[lo:hi], num_top[lo:hi])
        return values


@dataclass
class _Rows:
    """Prompt positions to score: whose they are, their hidden states (tensors or row
    numbers in the step's hidden states), the tokens they predict, top-k wanted."""

    owners: list[_PromptProgress] = field(default_factory=list)
    states: list = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)

    def add(self, owner: _PromptProgress, state: torch.Tensor | int, target: int, k: int) -> None:
        self.owners.append(owner)
        self.states.append(state)
        self.targets.append(target)
        self.num_top.append(k)
