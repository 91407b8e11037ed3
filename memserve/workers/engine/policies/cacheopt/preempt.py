"""CacheOpt's preemption order (§3.4): preempt the request that suffers least and frees
KV fastest. Three factors, each in magnitude bands so that a small difference in one
does not override the next: a looser TBT SLO first (bands 0.05-0.2 s, 0.2-0.5 s,
0.5-2 s, beyond), then a longer remaining time (predicted output tokens still to come,
bands of 128 tokens; a long job waits anyway, so the pause is a small share of it),
then less KV held (bands of 128 tokens; it is cheap to restore). Ties go to the newest."""

from __future__ import annotations

from bisect import bisect_right

from memserve.workers.engine.sequence import Sequence

TBT_BANDS_MS = (50.0, 200.0, 500.0, 2000.0)
TOKEN_BAND = 128


def remaining_tokens(seq: Sequence) -> int:
    """Predicted output tokens still to come (by ``max_tokens`` without a prediction)."""
    target = seq.predicted_output_tokens if seq.predicted_output_tokens is not None else seq.params.max_tokens
    return max(0, target - len(seq.output_token_ids))


def victim_order_key(seq: Sequence, tbt_slo_ms: float, kv_tokens: int) -> tuple[int, int, int]:
    """Lower preempts first."""
    return (-bisect_right(TBT_BANDS_MS, tbt_slo_ms), -(remaining_tokens(seq) // TOKEN_BAND), kv_tokens // TOKEN_BAND)


def preemption_order(running: list[Sequence], tbt_slo_ms: list[float], kv_tokens: list[int]) -> list[Sequence]:
    """``running`` in CacheOpt's order, first to preempt first; of equals, the latest arrival."""
    order = sorted(range(len(running)),
                   key=lambda i: (victim_order_key(running[i], tbt_slo_ms[i], kv_tokens[i]), -running[i].arrival_time))
    return [running[i] for i in order]


def pick_victim(running: list[Sequence], tbt_slo_ms: list[float], kv_tokens: list[int]) -> Sequence:
    """The first request in CacheOpt's order."""
    return preemption_order(running, tbt_slo_ms, kv_tokens)[0]
