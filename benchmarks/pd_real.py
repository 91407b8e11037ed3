"""MemServe Fig. 8 on real CPU workers: two workers colocated against the same two as a
prefill and a decode instance (``--instances prefill,decode``) in each ``--pd-mode``,
with the same KV blocks per worker (so the same total KV). For each setup, start
`memserve up` (one thread per worker, OMP_NUM_THREADS=1, so the two share a small
machine fairly), replay ShareGPT multi-turn and long-document QA with `memserve bench`,
stop it. Prints JCT and TTFT P50/P99, TBT P99, the cached-token ratio and the handoffs'
blocks and bytes per setup and workload; writes every results file, a summary JSON and,
with ``--plot``, the P99 JCT / P99 TTFT bars (Fig. 8 shape).

    python benchmarks/pd_real.py --out /tmp/pd-real [--setups colocated,pd-basic,pd-caching-3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from serve_process import start_memserve

SETUPS = ("colocated", "pd-basic", "pd-caching-1", "pd-caching-2", "pd-caching-3")


def start(args: argparse.Namespace, setup: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`memserve up` for ``setup``, once /health answers 200."""
    topology = ["--cpu-workers", "2"] if setup == "colocated" else ["--instances", "prefill,decode", "--pd-mode", setup]
    return start_memserve(["--num-blocks", str(args.num_blocks), "--transfer-mode", args.transfer_mode, *topology],
                          log)


def handoffs(url: str) -> dict:
    """The prefill workers' handoff counters, summed."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    keys = ("handoffs", "blocks_sent", "blocks_skipped", "bytes_sent", "messages", "transfer_s")
    return {k: sum(w.get("pd", {}).get(k, 0) for w in workers) for k in keys}


def bench(args: argparse.Namespace, url: str, workload: str, out: Path) -> dict:
    flags = {"long-doc-qa": ["--doc-len", str(args.doc_len), "--questions-per-doc", str(args.turns)],
             "sharegpt": ["--max-turns", str(args.turns), "--max-session-tokens", str(args.max_session_tokens)]}[workload]
    before = handoffs(url)
    cmd = [sys.executable, "-m", "memserve.cli", "bench", "--base-url", url, "--workload", workload,
           "--num-sessions", str(args.num_sessions), "--rate", str(args.rate), "--max-tokens", str(args.max_tokens),
           "--think-time", str(args.think_time), "--no-progress", "--output", str(out), *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    after = handoffs(url)
    return {"jct_p50_ms": r["jct_ms"]["p50"], "jct_p99_ms": r["jct_ms"]["p99"], "ttft_p50_ms": r["ttft_ms"]["p50"],
            "ttft_p99_ms": r["ttft_ms"]["p99"], "tbt_p99_ms": r["tbt_ms"]["p99"],
            "cached_token_ratio": r["cached_token_ratio"], "requests": r["num_requests"]["ok"],
            **{k: after[k] - before[k] for k in after}}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({w for per in summary.values() for w in per})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.2 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        setups = [s for s in summary if workload in summary[s]]
        for col, (key, title) in enumerate((("jct_p99_ms", "P99 JCT"), ("ttft_p99_ms", "P99 TTFT"))):
            ax = axes[row][col]
            ax.bar(setups, [summary[s][workload][key] / 1000 for s in setups], color="tab:blue")
            ax.set_title(f"{workload}: {title}")
            ax.set_ylabel("seconds")
            ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("pd-real"))
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--workloads", default="sharegpt,long-doc-qa")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker (the same in every setup)")
    p.add_argument("--num-sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rate", type=float, default=0.5, help="session starts per second")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean pause between turns (pd-caching-3's return of decode KV runs meanwhile)")
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--max-session-tokens", type=int, default=1500)
    p.add_argument("--transfer-mode", default="by-request-agg")
    p.add_argument("--plot", action="store_true", help="write pd-real.png into --out")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict] = {}
    for setup in args.setups.split(","):
        proc, url = start(args, setup, args.out / f"{setup}.log")
        try:
            summary[setup] = {w: bench(args, url, w, args.out / f"{setup}-{w}.json") for w in args.workloads.split(",")}
        finally:
            proc.terminate()
            proc.wait(60)
        for workload, r in summary[setup].items():
            print(f"{setup:13s} {workload:12s} JCT p50/p99 {r['jct_p50_ms']:8.0f}/{r['jct_p99_ms']:8.0f} ms  "
                  f"TTFT p50/p99 {r['ttft_p50_ms']:7.0f}/{r['ttft_p99_ms']:7.0f} ms  TBT p99 {r['tbt_p99_ms']:6.0f} ms  "
                  f"cached {r['cached_token_ratio']:.2f}  handoffs {r['handoffs']} blocks {r['blocks_sent']} "
                  f"(skipped {r['blocks_skipped']}) {r['bytes_sent'] / 2**20:.0f} MiB", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.out / "pd-real.png")


if __name__ == "__main__":
    main()
