"""A plain per-row, per-token reference of the logit adjustments, from the OpenAI / vLLM definitions."""

from __future__ import annotations

import math

from memserve.ipc.messages import SamplingParams
from memserve.workers.model.penalties import TokenHistory


def reference(logits: list[float], params: SamplingParams, history: TokenHistory | None) -> list[float]:
    """One row, token by token: bias, min_tokens mask, repetition, frequency and presence."""
    out = list(logits)
    for token, bias in params.logit_bias.items():
        out[token] += bias
    if history is None:
        return out
    if len(history.output_ids) < params.min_tokens:
        for token in history.stop_ids:
            out[token] = -math.inf
    for token in range(len(out)):
        count = history.output_ids.count(token)
        if params.repetition_penalty != 1.0 and (count or token in history.prompt_ids):
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
        out[token] -= count * params.frequency_penalty + (count > 0) * params.presence_penalty
    return out
