"""Results files and console tables: one run, or several runs side by side.

A results file holds either one run (``{"config", "ttft_ms", ..., "requests"}``) or a rate
sweep (``{"config", "label", "sweep": [{"rate", "ttft_ms", ...}, ...]}``). Both load as a
list of :class:`RunPoint`, which is what tables and plots work on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

# (row label, path into a result, format) for the metrics shown in tables.
SUMMARY_ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("TTFT mean (ms)", ("ttft_ms", "mean"), "{:.1f}"),
    ("TTFT p50 (ms)", ("ttft_ms", "p50"), "{:.1f}"),
    ("TTFT p90 (ms)", ("ttft_ms", "p90"), "{:.1f}"),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), "{:.1f}"),
    ("TBT mean (ms)", ("tbt_ms", "mean"), "{:.1f}"),
    ("TBT p50 (ms)", ("tbt_ms", "p50"), "{:.1f}"),
    ("TBT p90 (ms)", ("tbt_ms", "p90"), "{:.1f}"),
    ("TBT p99 (ms)", ("tbt_ms", "p99"), "{:.1f}"),
    ("TPOT mean (ms)", ("tpot_ms", "mean"), "{:.1f}"),
    ("TPOT p99 (ms)", ("tpot_ms", "p99"), "{:.1f}"),
    ("JCT mean (ms)", ("jct_ms", "mean"), "{:.0f}"),
    ("JCT p50 (ms)", ("jct_ms", "p50"), "{:.0f}"),
    ("JCT p99 (ms)", ("jct_ms", "p99"), "{:.0f}"),
    ("Norm. latency mean (ms/tok)", ("normalized_latency_ms_per_token", "mean"), "{:.1f}"),
    ("Requests/s", ("throughput", "requests_per_s"), "{:.3f}"),
    ("Output tokens/s", ("throughput", "output_tokens_per_s"), "{:.1f}"),
    ("Cached-token ratio", ("cached_token_ratio",), "{:.3f}"),
    ("TTFT SLO attainment", ("slo_attainment", "ttft"), "{:.3f}"),
    ("TBT SLO attainment", ("slo_attainment", "tbt"), "{:.3f}"),
    ("Requests ok", ("num_requests", "ok"), "{:d}"),
    ("Duration (s)", ("duration_s",), "{:.1f}"),
    ("Errors", ("errors", "count"), "{:d}"),
]


@dataclass
class RunPoint:
    label: str
    rate: float | None  # the sweep rate; None for a single run
    result: dict

    @property
    def name(self) -> str:
        return self.label if self.rate is None else f"{self.label}@{self.rate:g}/s"


def lookup(result: dict, path: tuple[str, ...]) -> float | None:
    value: object = result
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def write_json(path: str | Path, data: dict) -> None:
    """Write ``data`` indented, atomically. orjson, because an hour's per-request records
    take the standard encoder seconds; a value it cannot encode is written as its str."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(orjson.dumps(data, default=str, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    tmp.replace(path)


def load_points(path: str | Path) -> list[RunPoint]:
    data = json.loads(Path(path).read_text())
    label = data.get("label") or Path(path).stem
    if "sweep" in data:
        return [RunPoint(label, float(p["rate"]), p) for p in data["sweep"]]
    return [RunPoint(label, None, data)]


def _fmt(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    return fmt.format(int(value)) if fmt.endswith("d}") else fmt.format(value)


def run_table(point: RunPoint) -> Table:
    table = Table(title=f"memserve bench: {point.name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, path, fmt in SUMMARY_ROWS:
        table.add_row(label, _fmt(lookup(point.result, path), fmt))
    return table


def by_turn_table(point: RunPoint) -> Table | None:
    turns = point.result.get("by_turn") or []
    if len(turns) < 2:
        return None
    table = Table(title=f"by turn: {point.name}")
    for col in ("turn", "requests", "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p99 (ms)", "cached ratio", "prompt tok"):
        table.add_column(col, justify="right")
    for t in turns:
        ttft = t.get("ttft_ms") or {}
        table.add_row(
            str(t["turn"]),
            str(t["requests"]),
            _fmt(ttft.get("mean"), "{:.1f}"),
            _fmt(ttft.get("p50"), "{:.1f}"),
            _fmt(ttft.get("p99"), "{:.1f}"),
            _fmt(t.get("cached_token_ratio"), "{:.3f}"),
            _fmt(t.get("prompt_tokens_mean"), "{:.0f}"),
        )
    return table


def baselines(points: list[RunPoint]) -> list[RunPoint]:
    """Each point's reference for ratios: the first run's point at the same rate when it
    has one (comparing sweeps rate by rate), else the very first point."""
    first_label = points[0].label
    by_rate = {p.rate: p for p in points if p.label == first_label}
    return [by_rate.get(p.rate, points[0]) for p in points]


def compare_table(points: list[RunPoint]) -> Table:
    table = Table(title="memserve bench compare (ratio vs the first run)")
    table.add_column("metric")
    for p in points:
        table.add_column(p.name, justify="right")
    refs = baselines(points)
    for label, path, fmt in SUMMARY_ROWS:
        cells = []
        for p, ref in zip(points, refs):
            value, base = lookup(p.result, path), lookup(ref.result, path)
            cell = _fmt(value, fmt)
            if p is not ref and value is not None and base and not math.isclose(base, 0.0):
                cell += f" ({value / base:.2f}x)"
            cells.append(cell)
        table.add_row(label, *cells)
    return table


def print_run(console: Console, point: RunPoint) -> None:
    console.print(run_table(point))
    turns = by_turn_table(point)
    if turns is not None:
        console.print(turns)
