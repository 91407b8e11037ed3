"""Pick the next token of every sequence in a batch from its logits.

Greedy rows take the argmax. Sampled rows are scaled by temperature; rows with top-k or
top-p are filtered in vectorised passes over the batch. Every sampled row is drawn by
inverse-CDF with ONE uniform number. A seeded request's number for its token at output
position p is a hash of (seed, p) alone (``position_uniform``), so it draws the same
tokens whatever else shares its batch, whichever step samples the position, and with
drafts of any depth or none: a draft is kept when it equals the token its row draws
(``ngram_proposer.accept_drafts``). That is exact speculative sampling for a draft that is
a single guessed token: the draft d is kept with probability p(d), and when it is not the
row's token follows p without d, renormalised. Unseeded rows take a fresh number from
torch's default generator.

Sorting a 50k-entry vocabulary costs milliseconds per row, so filtered rows first look at
their few hundred best tokens only (``topk``): when those already hold the top-k set or
more than top-p of the probability mass, the result is exact. Only the rare row whose
nucleus is wider falls back to a wider candidate set and finally to a full sort.
"""

from __future__ import annotations

import torch

from memserve.ipc.messages import SamplingParams
from memserve.workers.model.grammar import GrammarBatch, apply_grammar_masks
from memserve.workers.model.penalties import TokenHistory, apply_adjustments

# Candidate-set widths tried for filtered rows before a full sort.
CANDIDATE_WIDTHS = (256, 4096)

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # SplitMix64's increment


def position_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws a seeded request's token at output
    ``position``: output ``position`` of SplitMix64 started at ``seed``, computed
    directly from the two (a counter-based generator), so no step, batch or device
    changes it. 24 bits, float32's resolution of [0, 1), like ``torch.rand``'s."""
    z = (seed + (position + 1) * _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 40) / (1 << 24)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        uniforms: list[float | None],
        histories: list[TokenHistory | None] | None = None,
        grammars: GrammarBatch | None = None,
    ) -> list[int]:
        """logits [B, V] (float32), one SamplingParams and one uniform number per row (a
        seeded row's ``position_uniform``, None for a fresh draw; greedy rows ignore it)
        -> B token ids. Penalties and biases (``histories``: the tokens each row has seen)
        apply to greedy rows too, as in vLLM."""
        logits = apply_adjustments(logits, params, histories)
        logits = apply_grammar_masks(logits, grammars)  # tokens a row's grammar forbids: -inf
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return logits.argmax(dim=-1).tolist()
        picked = _sample_rows(
            _select(logits, sampled).float(), [params[i] for i in sampled], [uniforms[i] for i in sampled]
        )
        if len(sampled) == len(params):
            return picked.tolist()
        tokens = logits.argmax(dim=-1)
        tokens[torch.tensor(sampled, device=logits.device)] = picked
        return tokens.tolist()


def _select(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for sorted distinct rows, without a copy when they are all of x's rows."""
    return x if len(rows) == x.shape[0] else x[torch.tensor(rows, device=x.device)]


def _uniform_tensor(uniforms: list[float | None], device: torch.device) -> torch.Tensor:
    """The rows' uniform numbers on ``device``, each None replaced by a fresh draw; one copy
    to the device for the batch."""
    fresh = iter(torch.rand(sum(u is None for u in uniforms)).tolist())
    return torch.tensor([next(fresh) if u is None else u for u in uniforms], device=device)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], row_uniforms: list[float | None]
) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature[:, None]
    uniforms = _uniform_tensor(row_uniforms, device)
    filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not filtered:
        return _inverse_cdf(scaled, uniforms)

    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    plain = sorted(set(range(len(params))) - set(filtered))
    if plain:
        rows = torch.tensor(plain, device=device)
        tokens[rows] = _inverse_cdf(scaled[rows], uniforms[rows])
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=device)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
    pending = filtered
    for width in (*CANDIDATE_WIDTHS, vocab):
        if not pending:
            break
        rows, rows_logits = torch.tensor(pending, device=device), _select(scaled, pending)
        log_norm = rows_logits.logsumexp(dim=-1)
        if width < vocab:
            cand_logits, cand_ids = rows_logits.topk(width, dim=-1)
            cand_mass = (cand_logits - log_norm[:, None]).exp().sum(-1)
            k, p = top_k[rows], top_p[rows]
            exact = torch.where(k > 0, k <= width, cand_mass > p)
        else:
            cand_logits, cand_ids = rows_logits.sort(dim=-1, descending=True)
            exact = torch.ones(len(pending), dtype=torch.bool, device=device)
        done = rows[exact]
        picks = _filtered_inverse_cdf(cand_logits[exact], log_norm[exact], top_k[done], top_p[done], uniforms[done])
        tokens[done] = cand_ids[exact].gather(1, picks[:, None]).squeeze(1)
        pending = [row for row, ok in zip(pending, exact.tolist()) if not ok]
    return tokens


def _filtered_inverse_cdf(
    sorted_logits: torch.Tensor,
    log_norm: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Column picked in rows of (candidate) logits sorted descending, after top-k (0 = off)
    and top-p (inf = off): of the top-k set, or else of the whole vocabulary (``log_norm``
    is its logsumexp), the smallest prefix whose mass reaches top_p is kept."""
    width = sorted_logits.shape[-1]
    rank = torch.arange(width, device=sorted_logits.device)
    k = torch.where(top_k > 0, top_k, width)
    masked = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    norm = torch.where(top_k > 0, masked.logsumexp(dim=-1), log_norm)
    probs = (masked - norm[:, None]).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before > top_p[:, None], 0.0)
    return _inverse_cdf_of_probs(probs, uniforms)


def _inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token drawn from softmax(logits) of each row, in any token order."""
    return _inverse_cdf_of_probs(logits.softmax(dim=-1), uniforms)


def _inverse_cdf_of_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column of each row where the CDF passes its uniform; always a valid column, even
    for a row with no mass or NaNs (it then takes column 0 rather than an id past the
    vocabulary that would fail the next step)."""
    cdf = torch.nan_to_num(probs, nan=0.0).cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    picks = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)
    # If rounding puts the target at the total, stay on the last column that adds mass
    # (the first whose cdf reaches the total) rather than a zero-probability one after it.
    last_with_mass = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picks, last_with_mass).clamp_(0, probs.shape[-1] - 1).squeeze(1)
