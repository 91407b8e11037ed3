"""Logit adjustments a request asks for before its next token is picked: OpenAI's
``logit_bias``, ``presence_penalty`` and ``frequency_penalty``, and vLLM's extensions
``min_tokens`` and ``repetition_penalty``, in vLLM v1's order (bias and the min-tokens
mask first, then the penalties).

- ``logit_bias``: added to the token's logit (one accumulating scatter for the batch).
- ``min_tokens``: the request's stop and EOS ids are masked until it has that many tokens.
- ``repetition_penalty`` (HF/vLLM): every token seen in the prompt or the output has its
  logit divided by it when positive, multiplied by it otherwise.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI): the logit of a token generated
  ``c`` times drops by ``c * frequency + (c > 0) * presence``; prompt tokens do not count.

Everything is computed on batched tensors and touches only the (row, token) pairs that
matter: the biased ids, the stop ids, the ids seen (one ``unique`` with counts over the
rows' flattened output ids gives every pair's count; one accumulating ``index_put_``
subtracts the penalties). A step thus costs in proportion to the tokens the adjusted rows
have seen, never to the vocabulary, and there is no Python loop over either. Rows that
ask for none of this are not touched, and a batch without any such row is returned as is.

The model runner keeps a ``TokenHistory`` for each request that needs one; it learns the
output tokens from the chunks it computes, by position, so a recompute after preemption or
the rerun of a failed step records nothing twice."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from memserve.ipc.messages import SamplingParams


def uses_history(params: SamplingParams) -> bool:
    """Whether the request's adjustments depend on the tokens seen so far."""
    return (params.min_tokens > 0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


def adjusts_logits(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or uses_history(params)


@dataclass
class TokenHistory:
    """What a request has seen: its prompt and, by position, its output so far."""

    prompt_ids: list[int]
    stop_ids: list[int]  # masked while the output is shorter than min_tokens
    output_ids: list[int] = field(default_factory=list)
    _prompt_tensor: torch.Tensor | None = None  # the prompt's distinct ids, built once (repetition penalty)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int], eos_token_ids: set[int]) -> TokenHistory | None:
        """A history for a request that needs one, else None (it then costs nothing)."""
        if not uses_history(params):
            return None
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        return cls(list(prompt_ids), sorted(stop_ids))

    def observe(self, start_pos: int, token_ids: list[int]) -> None:
        """Record the output tokens among a computed chunk (positions past the prompt)."""
        num_prompt = len(self.prompt_ids)
        first = max(start_pos, num_prompt)
        if first >= start_pos + len(token_ids) or first - num_prompt > len(self.output_ids):
            return
        del self.output_ids[first - num_prompt:]
        self.output_ids += token_ids[first - start_pos:]

    def prompt_tensor(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._prompt_tensor is None:
            ids = torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.long, device=device)
            self._prompt_tensor = ids[ids < vocab]
        return self._prompt_tensor


def apply_adjustments(logits: torch.Tensor, params: list[SamplingParams],
                      histories: list[TokenHistory | None] | None) -> torch.Tensor:
    """``logits`` [B, V] with each row's adjustments applied; a new tensor when any row
    has some (the raw logits stay intact for logprobs), else ``logits`` itself."""
    rows = [i for i, p in enumerate(params) if adjusts_logits(p)]
    if not rows:
        return logits
    every_row = len(rows) == len(params)
    index = None if every_row else torch.tensor(rows, device=logits.device)
    adjusted = logits.clone() if index is None else logits.index_select(0, index)
    row_params = [params[i] for i in rows]
    row_histories = [histories[i] if histories is not None else None for i in rows]
    _add_bias(adjusted, row_params)
    _mask_early_stops(adjusted, row_params, row_histories)
    _penalize(adjusted, row_params, row_histories)
    return adjusted if index is None else logits.index_copy(0, index, adjusted)


def _add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    biased = [r for r, p in enumerate(params) if p.logit_bias]
    if not biased:
        return
    device, vocab = logits.device, logits.shape[1]
    maps = [params[r].logit_bias for r in biased]
    rows, ids = _pairs([torch.tensor(list(m), dtype=torch.long, device=device) for m in maps], biased, device)
    bias = torch.tensor(list(chain.from_iterable(m.values() for m in maps)), dtype=logits.dtype, device=device)
    known = (ids >= 0) & (ids < vocab)  # the gateway checks ids against the vocabulary; a direct caller may not
    logits.index_put_((rows[known], ids[known]), bias[known], accumulate=True)


def _mask_early_stops(logits: torch.Tensor, params: list[SamplingParams],
                      histories: list[TokenHistory | None]) -> None:
    entries = [(r, t) for r, (p, h) in enumerate(zip(params, histories))
               if h is not None and len(h.output_ids) < p.min_tokens for t in h.stop_ids if t < logits.shape[1]]
    if entries:
        r, t = zip(*entries)
        logits[torch.tensor(r, device=logits.device), torch.tensor(t, device=logits.device)] = float("-inf")


def _penalize(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]) -> None:
    """Touches only the (row, token) pairs seen, never whole rows: a step costs in
    proportion to the tokens the rows have seen, not to the vocabulary."""
    device, vocab = logits.device, logits.shape[1]
    repeating = [(r, h) for r, p in enumerate(params)
                 if (h := histories[r]) is not None and p.repetition_penalty != 1.0]
    if repeating:
        rows, ids = _pairs([torch.cat([h.prompt_tensor(vocab, device), _ids(h.output_ids, vocab, device)])
                            for _, h in repeating], [r for r, _ in repeating], device)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[rows]
        seen = logits[rows, ids]  # repeated pairs compute and write the same value
        logits[rows, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    counted = [(r, h) for r, p in enumerate(params)
               if (h := histories[r]) is not None and (p.presence_penalty or p.frequency_penalty)]
    if counted:
        rows, ids = _pairs([_ids(h.output_ids, vocab, device) for _, h in counted], [r for r, _ in counted], device)
        pairs, counts = torch.unique(rows * vocab + ids, return_counts=True)
        rows, ids = pairs // vocab, pairs % vocab
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        logits.index_put_((rows, ids), -(frequency * counts + presence), accumulate=True)


def _ids(token_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    return ids[ids < vocab]


def _pairs(ids: list[torch.Tensor], rows: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of each row's ids, flattened."""
    lengths = torch.tensor([len(t) for t in ids], device=device)
    return torch.repeat_interleave(torch.tensor(rows, device=device), lengths), torch.cat(ids)


class TokenHistories:
    """The model runner's histories of the requests that need one, from their first plan
    until the plan that lists them as finished."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self._eos_token_ids = eos_token_ids
        self._histories: dict[str, TokenHistory] = {}

    def start(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        history = TokenHistory.create(params, prompt_ids, self._eos_token_ids)
        if history is not None:
            self._histories[request_id] = history

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def observe(self, request_id: str, start_pos: int, token_ids: list[int]) -> None:
        history = self._histories.get(request_id)
        if history is not None:
            history.observe(start_pos, token_ids)

    def rows(self, request_ids: list[str]) -> list[TokenHistory | None] | None:
        """One history (or None) per row; None for a batch where no request has one."""
        if not self._histories:
            return None
        return [self._histories.get(r) for r in request_ids]
