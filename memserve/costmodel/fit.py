"""Fit MemServe's operator-level cost model (§5.3) to profiled samples, and measure how
well it predicts held-out points next to an architecture-level fit (MemServe Fig. 14).

Every fit is a linear least-squares problem on a few physical features, weighted by
1/measured step time so that it minimises *relative* error (short and long prompts count
alike). Coefficients that physics says are non-negative (seconds per token, per step)
are fitted by non-negative least squares. numpy only: no torch here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)

OVERHEAD = "overhead"  # step wall time no operator hook covers: scheduling, batch prep, sampling
ATTENTION = "attention"
# Each operator class: its kind in MemServe's taxonomy and the terms its time depends on.
# lm_head computes logits only for each sequence's last token, hence per sequence.
OPERATOR_TERMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("compute", ("per_token", "per_step")),
    "o_proj": ("compute", ("per_token", "per_step")),
    "gate_up_proj": ("compute", ("per_token", "per_step")),
    "down_proj": ("compute", ("per_token", "per_step")),
    "lm_head": ("compute", ("per_seq", "per_step")),
    "norm": ("constant", ("per_token", "per_step")),
    "activation": ("constant", ("per_token", "per_step")),
    "residual": ("constant", ("per_token", "per_step")),
    "embedding": ("constant", ("per_token", "per_step")),
    OVERHEAD: ("overhead", ("per_token", "per_seq", "per_step")),
}
# The architecture-level model: one polynomial in (x, y) on total prefill time.
ARCH_FEATURES = ("1", "x", "x*y", "x^2", "x^2*y")


@dataclass
class PrefillSample:
    """One prefill step: its sequences as (prompt tokens, cached tokens), the median
    step wall time and the median exclusive seconds per operator class."""

    seqs: list[tuple[int, int]]
    total_s: float
    ops: dict[str, float]
    held_out: bool = False

    @property
    def new_tokens(self) -> int:
        return sum(x - c for x, c in self.seqs)

    def terms(self) -> dict[str, float]:
        return {"per_token": self.new_tokens, "per_seq": len(self.seqs), "per_step": 1.0}

    def as_exec_point(self) -> tuple[int, float]:
        """The batch as one prompt, the way MemServe applies exec() to a batch (§5.3.1)."""
        x = sum(x for x, _ in self.seqs)
        return x, sum(c for _, c in self.seqs) / x


@dataclass
class DecodeSample:
    batch_size: int
    context_tokens: int  # KV tokens attended over the whole batch
    step_s: float
    held_out: bool = False


@dataclass
class BandwidthSample:
    nbytes: int
    seconds: float
    held_out: bool = False


@dataclass
class Samples:
    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)
    copy: list[BandwidthSample] = field(default_factory=list)
    transfer: list[BandwidthSample] = field(default_factory=list)


@dataclass
class FitError:
    """Relative error |predicted - measured| / measured over held-out points."""

    name: str
    points: int
    mean: float
    max: float


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max() * max(a.shape)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            shrinking = passive & (z <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def _fit(rows: Sequence[Sequence[float]], targets: Sequence[float], scale: Sequence[float],
         nonneg: bool = True) -> np.ndarray:
    """Least squares of ``rows @ coef ~ targets`` with each row divided by ``scale`` (the
    measured total), columns normalised for conditioning."""
    a = np.asarray(rows, dtype=float) / np.asarray(scale, dtype=float)[:, None]
    b = np.asarray(targets, dtype=float) / np.asarray(scale, dtype=float)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef = nnls(a / norms, b) if nonneg else np.linalg.lstsq(a / norms, b, rcond=None)[0]
    return coef / norms


def fit_operators(train: list[PrefillSample]) -> dict[str, OperatorCost]:
    scale = [s.total_s for s in train]
    out = {}
    for name, (kind, terms) in OPERATOR_TERMS.items():
        coef = _fit([[s.terms()[t] for t in terms] for s in train], [s.ops.get(name, 0.0) for s in train], scale)
        out[name] = OperatorCost(**{t: float(c) for t, c in zip(terms, coef)}, kind=kind)
    return out


def fit_attention(train: list[PrefillSample]) -> AttentionCost:
    """``a*x²*y + b*x² + c*x + d`` per sequence, fitted as p*x²(1-y) + q*x²y with p, q >= 0
    so that attention time is non-negative at every cached ratio; then b = p, a = q - p."""
    rows = [[sum(x * (x - c) for x, c in s.seqs), sum(x * c for x, c in s.seqs), sum(x for x, _ in s.seqs),
             len(s.seqs)] for s in train]
    p, q, c, d = _fit(rows, [s.ops.get(ATTENTION, 0.0) for s in train], [s.total_s for s in train])
    return AttentionCost(a=float(q - p), b=float(p), c=float(c), d=float(d))


def _arch_row(x: float, y: float) -> list[float]:
    return [1.0, x, x * y, x * x, x * x * y]


def fit_arch(train: list[PrefillSample]) -> list[float]:
    """Coefficients of ``ARCH_FEATURES`` fitted on single-prompt TTFTs (signs free)."""
    singles = [s for s in train if len(s.seqs) == 1]
    rows = [_arch_row(*s.as_exec_point()) for s in singles]
    return [float(c) for c in _fit(rows, [s.total_s for s in singles], [s.total_s for s in singles], nonneg=False)]


def predict_arch(coef: Sequence[float], x: float, y: float) -> float:
    return float(np.dot(coef, _arch_row(x, y)))


def fit_decode(train: list[DecodeSample]) -> DecodeCost:
    coef = _fit([[1.0, s.batch_size, s.context_tokens] for s in train], [s.step_s for s in train],
                [s.step_s for s in train])
    # The profiled engine's decode attention pads to the longest context (attention.py).
    return DecodeCost(per_step=float(coef[0]), per_seq=float(coef[1]), per_context_token=float(coef[2]), padded=True)


def fit_bandwidth(train: list[BandwidthSample]) -> BandwidthCost:
    latency, per_byte = _fit([[1.0, s.nbytes] for s in train], [s.seconds for s in train],
                             [s.seconds for s in train])
    if per_byte <= 0:  # larger moves were not slower (timing noise): keep the mean throughput
        return BandwidthCost(latency_s=0.0, bytes_per_s=sum(s.nbytes for s in train) / sum(s.seconds for s in train))
    return BandwidthCost(latency_s=float(latency), bytes_per_s=float(1.0 / per_byte))


def relative_error(name: str, predicted: Sequence[float], measured: Sequence[float]) -> FitError:
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return FitError(name, len(errors), float(np.mean(errors)) if errors else float("nan"),
                    max(errors, default=float("nan")))


def fit_errors(model: CostModel, arch: Sequence[float], samples: Samples) -> list[FitError]:
    """Held-out errors: operator- vs architecture-level on single prompts and on batches
    (the arch-level model sees a batch as one prompt, as MemServe applies it), then the
    decode, copy and transfer models."""
    singles = [s for s in samples.prefill if s.held_out and len(s.seqs) == 1]
    batches = [s for s in samples.prefill if s.held_out and len(s.seqs) > 1]

    def op_level(group: list[PrefillSample]) -> list[float]:
        return [model.prefill_batch_s([(x, c / x) for x, c in s.seqs]) for s in group]

    def arch_level(group: list[PrefillSample]) -> list[float]:
        return [predict_arch(arch, *s.as_exec_point()) for s in group]

    decode = [s for s in samples.decode if s.held_out]
    copy = [s for s in samples.copy if s.held_out]
    transfer = [s for s in samples.transfer if s.held_out]
    return [
        relative_error("prefill, operator-level", op_level(singles), [s.total_s for s in singles]),
        relative_error("prefill, arch-level", arch_level(singles), [s.total_s for s in singles]),
        relative_error("batched prefill, operator-level", op_level(batches), [s.total_s for s in batches]),
        relative_error("batched prefill, arch-level", arch_level(batches), [s.total_s for s in batches]),
        relative_error("decode step", [model.decode_step_s(s.batch_size, s.context_tokens) for s in decode],
                       [s.step_s for s in decode]),
        relative_error("host<->device copy", [model.copy_s(s.nbytes) for s in copy], [s.seconds for s in copy]),
        relative_error("worker->worker transfer", [model.transfer_s(s.nbytes) for s in transfer],
                       [s.seconds for s in transfer]),
    ]


def fit_cost_model(key: CostKey, block_size: int, kv_bytes_per_token: int, samples: Samples,
                   meta: dict[str, Any]) -> tuple[CostModel, list[FitError]]:
    """Fit every part on the training points; report errors on the held-out ones. The
    samples, the arch-level fit and the errors are kept in ``meta`` for later refits."""
    train = [s for s in samples.prefill if not s.held_out]
    arch = fit_arch(train)
    model = CostModel(
        key=key,
        block_size=block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        operators=fit_operators(train),
        attention=fit_attention(train),
        decode=fit_decode([s for s in samples.decode if not s.held_out]),
        copy=fit_bandwidth([s for s in samples.copy if not s.held_out]),
        transfer=fit_bandwidth([s for s in samples.transfer if not s.held_out]),
    )
    errors = fit_errors(model, arch, samples)
    model.meta = {**meta, "arch_level": {"features": list(ARCH_FEATURES), "coef": arch},
                  "fit_errors": [asdict(e) for e in errors], "samples": asdict(samples)}
    return model, errors
