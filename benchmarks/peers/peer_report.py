"""Medians and memserve / peer ratios of the results the ``benchmarks/peers/vs_*.sh``
comparisons write.

Files are named ``<dtype>-<workload>-<server>-<rep>.json``, the server being ``memserve``
or the peer (``vllm``, ``llama.cpp``); for each dtype and workload the median of each
metric over the repetitions is printed for both servers, with the ratio memserve / peer
(below 1 is better for latencies, above 1 for throughput).

    python benchmarks/peers/peer_report.py results/vs-vllm-<stamp>
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from memserve.workload.report import load_points, lookup

METRICS = [
    ("TTFT mean (ms)", ("ttft_ms", "mean")),
    ("TTFT p50 (ms)", ("ttft_ms", "p50")),
    ("TTFT p99 (ms)", ("ttft_ms", "p99")),
    ("turn 2+ TTFT mean", ("returning_ttft_ms", "mean")),
    ("turn 2+ TTFT p50", ("returning_ttft_ms", "p50")),
    ("turn 2+ TTFT p99", ("returning_ttft_ms", "p99")),
    ("TBT mean (ms)", ("tbt_ms", "mean")),
    ("TBT p99 (ms)", ("tbt_ms", "p99")),
    ("JCT mean (ms)", ("jct_ms", "mean")),
    ("JCT p99 (ms)", ("jct_ms", "p99")),
    ("output tok/s", ("throughput", "output_tokens_per_s")),
    ("cached-token ratio", ("cached_token_ratio",)),
]


def main(folder: Path) -> None:
    runs: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(folder.glob("*.json")):
        dtype, rest = path.stem.split("-", 1)
        workload, server, _rep = rest.rsplit("-", 2)
        runs[dtype, workload][server] += [p.result for p in load_points(path)]
    for (dtype, workload), sides in sorted(runs.items()):
        peer = next((s for s in sorted(sides) if s != "memserve"), "peer")
        print(f"\n{dtype} {workload} (medians of {len(sides.get('memserve', []))} / {len(sides.get(peer, []))} runs)")
        print(f"  {'metric':22s} {'memserve':>10s} {peer:>10s} {'memserve/' + peer:>18s}")
        for label, key in METRICS:
            values = {s: [v for r in sides.get(s, []) if (v := lookup(r, key)) is not None] for s in ("memserve", peer)}
            med = {s: statistics.median(v) if v else None for s, v in values.items()}
            ratio = med["memserve"] / med[peer] if med["memserve"] is not None and med[peer] else None
            cells = [f"{m:10.1f}" if m is not None else f"{'-':>10s}" for m in med.values()]
            print(f"  {label:22s} {cells[0]} {cells[1]} {f'{ratio:17.2f}x' if ratio else '-':>18s}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
