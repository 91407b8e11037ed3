"""The gateway's output-length predictor, played by the simulator: a noisy oracle with
CacheOpt's confidence-based padding (§3.2), so SLO-aware policies can be simulated
with a predictor of a chosen accuracy before (or without) a trained one.

For a request whose true output length is L, the raw prediction is L·exp(e) with e
normal(0, ``error``), and the deviation direction (under- or over-prediction) is
reported correctly with probability ``direction_accuracy``. The padding is Hoeffding's
bound (eq. 3) ``t = sqrt(-(b-a)²/2 · ln(1-c))`` for the range (b-a) of lengths a
prediction of p stands for, here p·(e^error - e^-error) (one standard deviation either
side), at confidence ``c = min(confidence, α/(1+βλ))`` (eq. 4; λ the arrival rate in
requests per second); it is added for a predicted under-prediction and subtracted
otherwise (the gateway predictor's ``predictor/padding.py``). ``padding="fixed"`` is
CacheOpt's /CKA ablation: p + 10%. Seeded by request id: the same request gets the same
prediction in every run."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from memserve.predictor.padding import PaddingConfig, padded_length

PADDINGS = ("hoeffding", "fixed")


@dataclass(frozen=True)
class NoisyOracle:
    error: float  # standard deviation of the log-ratio of prediction to truth
    rate: float  # λ, requests per second (the measured arrival rate)
    padding: str = "hoeffding"
    direction_accuracy: float = 0.8
    cfg: PaddingConfig = field(default_factory=PaddingConfig)  # CacheOpt §5: confidence 90%, α = 8, β = 100
    seed: int = 0

    def __call__(self, request_id: str, true_len: int) -> int:
        rng = random.Random(f"predict:{self.seed}:{request_id}")
        raw = true_len * math.exp(rng.gauss(0.0, self.error))
        if self.padding == "fixed":
            return max(1, round(raw * 1.1))
        under = raw < true_len
        if rng.random() >= self.direction_accuracy:
            under = not under
        width = raw * (math.exp(self.error) - math.exp(-self.error))
        return round(padded_length(raw, width, under, self.rate, self.cfg))
