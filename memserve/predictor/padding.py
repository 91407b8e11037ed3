"""Confidence-based padding (CacheOpt §3.2, eqs. 3-4).

Hoeffding's inequality bounds the chance that the actual length deviates from the
prediction by more than ``t`` when the actual length lies in ``[a, b]``:
``P(X - X̂ >= t) <= exp(-2t² / (b - a)²)``; setting the right side to ``1 - c`` gives the
padding ``t = sqrt(-(b - a)²/2 · ln(1 - c))`` for confidence ``c``. Here ``[a, b)`` is the
predicted length bucket. The confidence falls with the arrival rate λ,
``c = α / (1 + βλ)``: under load, requests wait longer for KV that padding would hold
back, so less of it pays (§2, O2). The paper's α = 8 exceeds 1, so ``c`` is capped at
the configured confidence (90% in §5): at α = 8, β = 100 and λ in requests per second the
cap holds up to λ ≈ 0.079 req/s, and ``c`` halves at ≈ 0.15 req/s."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PaddingConfig:
    confidence: float = 0.9  # the most confidence ever asked for (CacheOpt §5)
    alpha: float = 8.0
    beta: float = 100.0  # per request/second of arrival rate


def hoeffding_padding(width: float, confidence: float) -> float:
    """Eq. 3: tokens to pad so that the deviation stays below it with ``confidence``,
    for actual lengths spread over ``width`` (= b - a) tokens."""
    if confidence <= 0.0:
        return 0.0
    if confidence >= 1.0:
        raise ValueError(f"confidence must be below 1, got {confidence}")
    return math.sqrt(-(width * width) / 2.0 * math.log(1.0 - confidence))


def rate_confidence(arrival_rate: float, cfg: PaddingConfig) -> float:
    """Eq. 4, capped at ``cfg.confidence``."""
    return min(cfg.confidence, cfg.alpha / (1.0 + cfg.beta * max(0.0, arrival_rate)))


def padded_length(predicted: float, width: float, under_predicted: bool, arrival_rate: float,
                  cfg: PaddingConfig) -> float:
    """The predicted length moved by the padding in the predicted deviation direction:
    up when the model expects to under-predict, down otherwise (§3.2), never below 1."""
    t = hoeffding_padding(width, rate_confidence(arrival_rate, cfg))
    return max(1.0, predicted + t if under_predicted else predicted - t)
