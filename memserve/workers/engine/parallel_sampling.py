"""``n > 1``: several sequences sampled from one prompt (parallel sampling).

The request runs as one sequence, its choice 0, until its prompt is computed; then the
scheduler forks choices 1..n-1 from it. A choice shares the prompt's full KV blocks
(references through the MemPool's prefix index) and gets its own copy of the partly
filled last block (``KVCacheManager.fork``), so the prompt is computed once and the n
sequences hold ``prompt blocks + n * tail blocks``. Each choice then recomputes only the
last prompt token, whose logits it samples with its own seed stream (``seed + index``:
``n=4, seed=S`` is reproducible, and its choices differ), and decodes on its own.

Every choice's sequence is named ``choice_request_id(request id, index)`` (the gateway
aborts one choice by that name, the whole request by the request's id); its outputs carry
the request id and the index, so the gateway sees one stream per request."""

from __future__ import annotations

import dataclasses

from memserve.ipc.messages import SamplingParams, choice_request_id
from memserve.workers.engine.sequence import Sequence


def name_first_choice(seq: Sequence) -> None:
    """Make a new request with n > 1 its choice 0 (the other choices fork from it)."""
    if seq.params.n > 1:
        seq.choice_of, seq.request_id = seq.request_id, choice_request_id(seq.request_id, 0)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: one sequence with its own seed; prompt logprobs
    are reported by choice 0 only (every choice has the same prompt)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=None if index else params.prompt_logprobs)


def fork_choices(parent: Sequence) -> list[Sequence]:
    """The sequences of choices 1..n-1 of ``parent`` (choice 0), with its prompt;
    ``parent`` becomes a single sequence."""
    params, n, request_id = parent.params, parent.params.n, parent.choice_of or parent.request_id
    parent.params = choice_params(params, 0)
    return [
        Sequence(choice_request_id(request_id, i), parent.prompt_token_ids, choice_params(params, i), parent.arrival_time,
                 parent.session_id, parent.priority, parent.slo_ttft_ms, parent.slo_tbt_ms,
                 choice_of=request_id, choice_index=i)
        for i in range(1, n)
    ]
