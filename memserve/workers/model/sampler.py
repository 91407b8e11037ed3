"""Pick the next token of every sequence in a batch from its logits.

Greedy rows take the argmax. Sampled rows are filtered (temperature, top-k, top-p) in one
vectorised pass over the batch, then drawn by inverse-CDF with ONE uniform number per row
taken from that row's own generator: a request with a seed therefore draws the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from memserve.ipc.messages import SamplingParams


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """logits [B, V] (float32), one SamplingParams and one optional seeded generator
        (on the logits' device) per row -> B token ids."""
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            picked = self._sample_rows(
                logits[rows].float(), [params[i] for i in sampled_rows], [generators[i] for i in sampled_rows]
            )
            tokens[rows] = picked
        return tokens.tolist()

    @staticmethod
    def _sample_rows(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)

        sorted_logits, sorted_ids = (logits / temperature[:, None]).sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # top-p: keep the smallest prefix whose mass reaches top_p (always the first token).
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before > top_p[:, None], 0.0)

        cdf = probs.cumsum(dim=-1)
        uniforms = torch.cat([torch.rand(1, device=device, generator=g) for g in generators])
        targets = uniforms * cdf[:, -1]
        picks = torch.searchsorted(cdf, targets[:, None], right=True)
        # Kept tokens form a prefix of the sorted row; rounding must not step past it.
        last_kept = (probs > 0).sum(dim=-1, keepdim=True) - 1
        picks = torch.minimum(picks, last_kept)
        return sorted_ids.gather(1, picks).squeeze(1)
