"""Logit adjustments (workers/model/penalties.py) against a plain per-row, per-token
reference written from the OpenAI / vLLM definitions; no model needed."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.penalties_reference import reference

from memserve.ipc.messages import SamplingParams
from memserve.workers.model.penalties import TokenHistory, apply_adjustments
from memserve.workers.model.sampler import Sampler

VOCAB = 40
EOS = 39


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(6)
    return SamplingParams(
        temperature=rng.choice([0.0, 0.8]),
        presence_penalty=rng.uniform(-2, 2) if kind in (1, 5) else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if kind in (2, 5) else 0.0,
        repetition_penalty=rng.uniform(0.5, 2.0) if kind in (3, 5) else 1.0,
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(4))} if kind == 4 else {},
        min_tokens=rng.choice([0, 3]) if kind == 5 else 0,
        stop_token_ids=[7],
    )


@pytest.mark.parametrize("seed", range(5))
def test_batched_adjustments_equal_the_per_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    params = [_random_params(rng) for _ in range(9)]
    histories = []
    for p in params:
        history = TokenHistory.create(p, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))], {EOS})
        if history is not None:
            history.output_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(6))]
        histories.append(history)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    raw = logits.clone()
    got = apply_adjustments(logits, params, histories)
    want = torch.tensor([reference(row, p, h) for row, p, h in zip(raw.tolist(), params, histories)])
    assert torch.equal(logits, raw), "the raw logits must stay intact (logprobs read them)"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_rows_without_adjustments_get_the_logits_themselves() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_adjustments(logits, [SamplingParams()] * 3, None) is logits


def test_greedy_rows_follow_the_bias() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100.0}), SamplingParams(temperature=0.0)]
    assert Sampler().sample(logits, params, [None, None]) == [5, int(logits[1].argmax())]


def test_min_tokens_masks_stop_and_eos_ids_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    history = TokenHistory.create(params, [1, 2], {EOS})
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 3] = 10.0, 9.0
    assert Sampler().sample(logits, [params], [None], [history]) != [EOS]
    history.observe(2, [11])
    assert Sampler().sample(logits, [params], [None], [history]) not in ([EOS], [3])
    history.observe(3, [12])
    assert Sampler().sample(logits, [params], [None], [history]) == [EOS]


def test_history_records_outputs_by_position() -> None:
    """A recompute after preemption (prompt and outputs again) or a rerun of the same
    chunk leaves the history as it was."""
    history = TokenHistory([1, 2, 3], [])
    history.observe(0, [1, 2, 3])
    history.observe(3, [10])
    history.observe(4, [11])
    history.observe(4, [11])
    assert history.output_ids == [10, 11]
    history.observe(0, [1, 2, 3, 10, 11])
    history.observe(5, [12])
    assert history.output_ids == [10, 11, 12]


def test_requests_without_history_needs_get_none() -> None:
    assert TokenHistory.create(SamplingParams(logit_bias={1: 1.0}), [1], {EOS}) is None
