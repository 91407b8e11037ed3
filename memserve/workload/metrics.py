"""Latency and throughput metrics computed from request records.

Definitions (all per successful request unless said otherwise):

- **TTFT**: first chunk carrying output text minus the time the request was sent.
- **TBT**: every gap between consecutive output chunks. Servers normally send one token
  per chunk; when a chunk carries several tokens (counted from per-chunk ``usage`` when
  the server sends it) the gap before it counts once, as the user saw it: one wait, then
  several tokens at once. TBT statistics pool the gaps of all requests.
- **TPOT**: (last output chunk - first output chunk) / (output tokens - 1), requests with
  at least two output tokens; output tokens come from the server's ``usage``.
- **JCT**: end of the stream minus the time the request was sent.
- **Normalized latency**: JCT / output tokens (ms per token), per request.
- **Throughput**: successful requests and their output tokens per second of run time.
- **Cached-token ratio**: sum of ``cached_tokens`` over sum of ``prompt_tokens``, over
  requests whose usage reports ``prompt_tokens_details.cached_tokens``; ``None`` if none do.
- **SLO attainment**: fraction of finished requests (successes and failures; requests
  cancelled by Ctrl-C do not count) meeting the SLO each carried. A failed request meets
  no SLO. TTFT is met when TTFT <= SLO (a request that produced no
  output is judged by its JCT); TBT is met only if *every* gap is <= SLO.
- Percentiles use linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from memserve.workload.records import RequestRecord

MS = 1000.0


def summarize(values: Iterable[float]) -> dict:
    """mean, p50, p90, p99, max and count of ``values``; ``None`` statistics when empty."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "count": 0}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(arr.max()),
        "count": int(arr.size),
    }


def ttft_ms(r: RequestRecord) -> float | None:
    return (r.chunk_times[0] - r.start) * MS if r.chunk_times else None


def tbt_gaps_ms(r: RequestRecord) -> list[float]:
    return [(b - a) * MS for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def tpot_ms(r: RequestRecord) -> float | None:
    n = r.output_tokens
    if n < 2 or len(r.chunk_times) < 1:
        return None
    return (r.chunk_times[-1] - r.chunk_times[0]) * MS / (n - 1)


def jct_ms(r: RequestRecord) -> float | None:
    return (r.end - r.start) * MS if r.end is not None else None


def normalized_latency_ms(r: RequestRecord) -> float | None:
    jct = jct_ms(r)
    return jct / r.output_tokens if jct is not None and r.output_tokens > 0 else None


def meets_ttft(r: RequestRecord, slo_ms: float) -> bool:
    if not r.ok:
        return False
    waited = ttft_ms(r)
    return (waited if waited is not None else jct_ms(r) or 0.0) <= slo_ms


def meets_tbt(r: RequestRecord, slo_ms: float) -> bool:
    return r.ok and all(g <= slo_ms for g in tbt_gaps_ms(r))


def tbt_attainment_ceiling(base_ms: float, scale: tuple[float, float], step_floor_ms: float) -> float:
    """The highest TBT attainment any scheduler can reach when each request's TBT SLO is
    ``base_ms`` times a scale uniform in ``scale`` (CacheOpt §5) and no decode step takes
    less than ``step_floor_ms``: a request whose SLO is below one step misses it at its
    first gap, so only the share of scales putting the SLO at or above the floor can meet it."""
    lo, hi = scale
    if hi <= lo:
        return 1.0 if base_ms * lo >= step_floor_ms else 0.0
    return min(1.0, max(0.0, (hi - max(lo, step_floor_ms / base_ms)) / (hi - lo)))


def cached_token_ratio(records: Iterable[RequestRecord]) -> float | None:
    reporting = [(r.cached_tokens, r.prompt_tokens) for r in records
                 if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    if not reporting:
        return None
    return sum(cached for cached, _ in reporting) / sum(prompt for _, prompt in reporting)


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def slo_attainment(records: list[RequestRecord]) -> dict:
    """Each request is judged by the SLOs it carried; ``None`` where no request had one."""
    out: dict = {"ttft": None, "tbt": None, "both": None}
    with_ttft = [(r, r.slo_ttft_ms) for r in records if r.slo_ttft_ms is not None]
    with_tbt = [(r, r.slo_tbt_ms) for r in records if r.slo_tbt_ms is not None]
    if with_ttft:
        out["ttft"] = sum(meets_ttft(r, ttft) for r, ttft in with_ttft) / len(with_ttft)
    if with_tbt:
        out["tbt"] = sum(meets_tbt(r, tbt) for r, tbt in with_tbt) / len(with_tbt)
    both = [(r, ttft, r.slo_tbt_ms) for r, ttft in with_ttft if r.slo_tbt_ms is not None]
    if both:
        out["both"] = sum(meets_ttft(r, ttft) and meets_tbt(r, tbt) for r, ttft, tbt in both) / len(both)
    return out


def errors_summary(records: Iterable[RequestRecord]) -> dict:
    failed = [r for r in records if not r.ok]
    messages: dict[str, str] = {}
    for r in failed:
        messages.setdefault(r.status, r.error or "")
    return {
        "count": len(failed),
        "by_status": dict(Counter(r.status for r in failed)),
        "first_message_by_status": messages,
    }


def by_turn(records: list[RequestRecord]) -> list[dict]:
    """TTFT, cached ratio and prompt size per turn index (turn 1 first)."""
    out = []
    for turn in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == turn]
        ok = [r for r in rs if r.ok]
        out.append(
            {
                "turn": turn,
                "requests": len(rs),
                "ok": len(ok),
                "ttft_ms": summarize(_present(ttft_ms(r) for r in ok)),
                "cached_token_ratio": cached_token_ratio(ok),
                "prompt_tokens_mean": (
                    float(np.mean(p)) if (p := _present(r.prompt_tokens for r in ok)) else None
                ),
            }
        )
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float) -> dict:
    """The results-file metrics for the finished (not cancelled) ``records`` of one run."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "num_requests": {"finished": len(records), "ok": len(ok), "failed": len(records) - len(ok)},
        "duration_s": duration_s,
        "ttft_ms": summarize(_present(ttft_ms(r) for r in ok)),
        # Turns after a session's first: the requests whose conversation's KV a cache may keep.
        "returning_ttft_ms": summarize(_present(ttft_ms(r) for r in ok if r.turn > 1)),
        "tbt_ms": summarize(g for r in ok for g in tbt_gaps_ms(r)),
        "tpot_ms": summarize(_present(tpot_ms(r) for r in ok)),
        "jct_ms": summarize(_present(jct_ms(r) for r in ok)),
        "normalized_latency_ms_per_token": summarize(_present(normalized_latency_ms(r) for r in ok)),
        "throughput": {
            "requests_per_s": rate(len(ok)),
            "output_tokens_per_s": rate(output_tokens),
            "prompt_tokens_per_s": rate(prompt_tokens),
        },
        "tokens": {
            "prompt": prompt_tokens,
            "output": output_tokens,
            "output_per_chunk_mean": output_tokens / chunks if chunks else None,
        },
        "cached_token_ratio": cached_token_ratio(ok),
        "slo_attainment": slo_attainment(records),
        "errors": errors_summary(records),
        "by_turn": by_turn(records),
    }
