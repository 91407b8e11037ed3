"""Sampler: greedy rows, filtering (temperature, top-k, top-p), per-request seeds keyed
by output position, and drafts kept when they equal the draw (speculative sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from memserve.ipc.messages import SamplingParams
from memserve.workers.model import sampler as sampler_module
from memserve.workers.model.sampler import Sampler, position_uniform

VOCAB = 50


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, VOCAB, generator=_generator(0)) * 3


def test_greedy_rows_take_the_argmax(logits):
    params = [SamplingParams(temperature=0.0)] * 4
    assert Sampler().sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)])
def test_filters_that_keep_one_token_give_the_argmax(logits, params):
    for seed in range(5):
        tokens = Sampler().sample(logits, [params] * 4, [position_uniform(seed + i, 0) for i in range(4)])
        assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-40, 1e-7])
def test_temperature_that_vanishes_in_float32_is_greedy(logits, temperature):
    """1e-40 rounds to 0 in float32: dividing by it once produced NaN and an id past the
    vocabulary, which failed every request in the next step."""
    params = [SamplingParams(temperature=temperature)] * 4
    assert Sampler().sample(logits, params, [position_uniform(i, 0) for i in range(4)]) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_non_finite_logits_still_give_ids_in_the_vocabulary(logits, bad, top_p):
    logits = logits.clone()
    logits[1] = bad
    logits[2, 7] = bad
    params = [SamplingParams(temperature=0.8, top_p=top_p)] * 4
    for seed in range(20):
        tokens = Sampler().sample(logits, params, [position_uniform(seed, i) for i in range(4)])
        assert all(0 <= t < VOCAB for t in tokens), tokens


def test_greedy_and_sampled_rows_mix(logits):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=1e-6)] * 2
    assert Sampler().sample(logits, params, [None, 0.999, None, None]) == logits.argmax(-1).tolist()


def test_seeded_request_is_reproducible_whatever_its_batch_companions(logits):
    target = logits[0]
    params = SamplingParams(temperature=1.0, seed=7)
    draws_alone, draws_batched = [], []
    for step in range(20):
        draws_alone.append(Sampler().sample(target[None], [params], [position_uniform(7, step)])[0])
        companions = torch.randn(3, VOCAB, generator=_generator(100 + step))
        batch = torch.cat([companions[:1], target[None], companions[1:]])
        other = SamplingParams(temperature=0.8, top_k=5)
        uniforms = [None, position_uniform(7, step), position_uniform(step, 3), None]
        tokens = Sampler().sample(batch, [other, params, other, other], uniforms)
        draws_batched.append(tokens[1])
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # it really samples


def _frequencies(probs: list[float], params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    logits = torch.log(torch.tensor(probs)).expand(draws, -1).contiguous()
    tokens = Sampler().sample(logits, [params] * draws, [position_uniform(3, p) for p in range(draws)])
    return torch.bincount(torch.tensor(tokens), minlength=len(probs)).float() / draws


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.5, 0.3, 0.2]),
        (SamplingParams(temperature=0.5), [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.6), [0.625, 0.375, 0.0]),
    ],
)
def test_sampled_frequencies_follow_the_filtered_distribution(params, expected):
    freq = _frequencies([0.5, 0.3, 0.2], params)
    tolerance = 4 * math.sqrt(0.25 / 4000)  # four standard deviations at worst p=0.5
    assert torch.allclose(freq, torch.tensor(expected), atol=tolerance), freq
    for token, p in enumerate(expected):
        if p == 0.0:
            assert freq[token] == 0.0


def test_candidate_shortcut_draws_exactly_what_a_full_sort_draws(monkeypatch):
    """Filtered rows look at their best 256, then 4096 tokens before sorting the whole
    vocabulary; every level must give the full sort's token for the same random draw."""
    rows, vocab, gen = 12, 6000, _generator(5)
    logits = torch.randn(rows, vocab, generator=gen) * 0.1
    head = torch.rand(rows, vocab, generator=gen).argsort(-1)[:, :256]
    logits.scatter_add_(1, head, torch.full((rows, 256), 3.5))  # the best 256 hold ~60% of the mass
    mass = logits.softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    assert ((mass[:, 255] > 0.5) & (mass[:, 255] < 0.95) & (mass[:, 4095] < 0.95)).all()
    options = [
        SamplingParams(temperature=1.0, top_p=0.5),  # nucleus within the best 256
        SamplingParams(temperature=1.0, top_k=300),  # more than 256: the 4096 level
        SamplingParams(temperature=1.0, top_p=0.95),  # nucleus wider than 4096: full sort
    ]
    params = [options[i % 3] for i in range(rows)]

    def draw() -> list[int]:
        return Sampler().sample(logits, params, [position_uniform(i, 0) for i in range(rows)])

    with_shortcut = draw()
    monkeypatch.setattr(sampler_module, "CANDIDATE_WIDTHS", ())
    assert draw() == with_shortcut


def test_position_uniform_depends_on_seed_and_position_alone():
    assert position_uniform(7, 3) == position_uniform(7, 3)
    draws = [position_uniform(seed, p) for seed in range(50) for p in range(50)]
    assert len(set(draws)) > 2490 and all(0.0 <= u < 1.0 for u in draws)
    assert position_uniform(-1, 0) == position_uniform(2**64 - 1, 0)  # seeds are taken modulo 2**64


def test_position_uniforms_are_uniform_and_independent_of_the_next_position():
    """Speculative sampling needs the number at a position independent of those before
    it: a draft at p+1 was chosen knowing the token at p."""
    first = torch.tensor([position_uniform(seed, 5) for seed in range(4000)])
    second = torch.tensor([position_uniform(seed, 6) for seed in range(4000)])
    assert torch.histc(first, bins=10, min=0, max=1).div(4000).sub(0.1).abs().max() < 0.02
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1]) < 0.05
    quadrants = torch.bincount((first < 0.5).long() * 2 + (second < 0.5).long(), minlength=4) / 4000
    assert quadrants.sub(0.25).abs().max() < 0.03


def _speculative(rows: torch.Tensor, drafts: list[int], params: SamplingParams, seed: int) -> list[int]:
    """The tokens a request keeps from one step with ``drafts`` at output positions 0..:
    each row is sampled with its position's number, drafts are kept while equal to them,
    then the row's own token (``ngram_proposer.accept_drafts``)."""
    chosen = Sampler().sample(rows, [params] * len(rows), [position_uniform(seed, p) for p in range(len(rows))])
    kept = 0
    while kept < len(drafts) and drafts[kept] == chosen[kept]:
        kept += 1
    return chosen[: kept + 1]


def test_drafts_kept_by_equality_are_speculative_sampling():
    """A draft d is kept with probability p(d) under its row; when lost, the token follows
    the row without d, renormalised; after a kept draft the next token follows the next
    row: each emitted token has plain sampling's distribution, whatever the draft."""
    rows, params = torch.randn(3, 8, generator=_generator(1)) * 2, SamplingParams(temperature=0.7, seed=0)
    probs = (rows / params.temperature).softmax(-1)
    trials = 3000
    for draft in (int(probs[0].argmax()), int(probs[0].argmin())):
        first, second, lost = torch.zeros(8), torch.zeros(8), torch.zeros(8)
        for seed in range(trials):
            tokens = _speculative(rows, [draft, 3], params, seed)
            first[tokens[0]] += 1
            if tokens[0] == draft:
                second[tokens[1]] += 1
            else:
                lost[tokens[0]] += 1
        kept = int(first[draft])
        assert kept / trials == pytest.approx(float(probs[0, draft]), abs=0.04)
        assert torch.allclose(first / trials, probs[0], atol=0.04)
        without = probs[0].clone()
        without[draft] = 0.0
        assert torch.allclose(lost / lost.sum(), without / without.sum(), atol=0.05)
        if kept > 300:
            assert torch.allclose(second / kept, probs[1], atol=0.07)

