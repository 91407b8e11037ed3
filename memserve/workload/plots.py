"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

Every function takes several runs and draws them on shared axes, so one run's plots and
``bench compare``'s plots are the same code.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from memserve.workload.metrics import jct_ms, tbt_gaps_ms, ttft_ms  # noqa: E402
from memserve.workload.records import RequestRecord  # noqa: E402
from memserve.workload.report import RunPoint, lookup  # noqa: E402


def samples(point: RunPoint) -> dict[str, list[float]]:
    """Per-request samples of TTFT, TBT (all gaps) and JCT of the successful requests."""
    records = [RequestRecord.from_json(r) for r in point.result.get("requests", [])]
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": [v for r in ok if (v := ttft_ms(r)) is not None],
        "tbt_ms": [g for r in ok for g in tbt_gaps_ms(r)],
        "jct_ms": [v for r in ok if (v := jct_ms(r)) is not None],
    }


def plot_cdfs(points: list[RunPoint], out_dir: Path) -> list[Path]:
    """One CDF figure per metric (TTFT, TBT, JCT), every run a line."""
    per_point = [samples(p) for p in points]
    written = []
    for key, title in (("ttft_ms", "TTFT"), ("tbt_ms", "TBT (every inter-token gap)"), ("jct_ms", "JCT")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for point, s in zip(points, per_point):
            values = np.sort(np.asarray(s[key]))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=point.name)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests" if key != "tbt_ms" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"CDF of {title}")
        written.append(_save(fig, out_dir / f"cdf_{key.removesuffix('_ms')}.png"))
    return written


def plot_by_turn(points: list[RunPoint], out_dir: Path) -> Path | None:
    """Mean TTFT and cached-token ratio against the turn index (session workloads)."""
    if not any(len(p.result.get("by_turn") or []) > 1 for p in points):
        return None
    fig, (ax_ttft, ax_cache) = plt.subplots(1, 2, figsize=(10, 4))
    for p in points:
        turns = p.result.get("by_turn") or []
        xs = [t["turn"] for t in turns]
        ax_ttft.plot(xs, [(t.get("ttft_ms") or {}).get("mean") or np.nan for t in turns], marker="o", label=p.name)
        cached = [t.get("cached_token_ratio") for t in turns]
        ax_cache.plot(xs, [np.nan if c is None else c for c in cached], marker="o", label=p.name)
    ax_ttft.set(xlabel="turn", ylabel="mean TTFT (ms)", title="TTFT by turn")
    ax_cache.set(xlabel="turn", ylabel="cached-token ratio", title="Cached prompt tokens by turn", ylim=(0, 1.01))
    for ax in (ax_ttft, ax_cache):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out_dir / "ttft_by_turn.png")


def plot_vs_rate(points: list[RunPoint], out_dir: Path) -> Path | None:
    """Latency and throughput against the arrival rate, one line per run (sweeps only)."""
    swept = [p for p in points if p.rate is not None]
    if not swept:
        return None
    panels = [
        ("TTFT (ms)", ("ttft_ms",)),
        ("TBT (ms)", ("tbt_ms",)),
        ("normalized latency (ms/token)", ("normalized_latency_ms_per_token",)),
    ]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4))
    labels = list(dict.fromkeys(p.label for p in swept))
    for label in labels:
        series = sorted((p for p in swept if p.label == label), key=lambda p: _num(p.rate))  # all set in a sweep
        rates = [p.rate for p in series]
        for ax, (title, path) in zip(axes, panels):
            (line,) = ax.plot(rates, [_num(lookup(p.result, path + ("p50",))) for p in series], marker="o",
                              label=f"{label} p50")
            ax.plot(rates, [_num(lookup(p.result, path + ("p99",))) for p in series], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{label} p99")
            ax.set(xlabel="arrival rate (/s)", ylabel=title, title=title)
        axes[-1].plot(rates, [_num(lookup(p.result, ("throughput", "output_tokens_per_s"))) for p in series],
                      marker="o", label=label)
    axes[-1].set(xlabel="arrival rate (/s)", ylabel="output tokens/s", title="throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out_dir / "latency_vs_rate.png")


def plot_all(points: list[RunPoint], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = plot_cdfs(points, out)
    written += [p for p in (plot_by_turn(points, out), plot_vs_rate(points, out)) if p is not None]
    return written


def _num(value: float | None) -> float:
    return np.nan if value is None else value


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
