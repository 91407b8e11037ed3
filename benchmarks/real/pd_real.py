"""MemServe Fig. 8 on real CPU workers: two workers colocated against the same two as a
prefill and a decode instance (``--instances prefill,decode``) in each ``--pd-mode``,
with the same KV blocks per worker (so the same total KV). For each setup, start
`memserve up` (one thread per worker, OMP_NUM_THREADS=1, so the two share a small
machine fairly), replay ShareGPT multi-turn and long-document QA with `memserve bench`,
stop it. Prints JCT and TTFT P50/P99, TBT P99, the cached-token ratio and the handoffs'
blocks and bytes per setup and workload, and pd-caching-3's P99 JCT against pd-basic's;
writes every results file, a summary JSON and, with ``--plot``, P99 JCT and P99 TTFT
against the session-start rate (Fig. 8 shape). ``--rates`` sweeps the load, a fresh
server (cold caches) per setup and rate: what caching at P saves is prefill work, so
its share of JCT grows as the prefill instance fills up.

    python benchmarks/real/pd_real.py --out /tmp/pd-real [--setups colocated,pd-basic,pd-caching-3] [--rates 0.25,0.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from memserve.bench.server_process import ServerHandle, start_server, stop_server

SETUPS = ("colocated", "pd-basic", "pd-caching-1", "pd-caching-2", "pd-caching-3")


def start(args: argparse.Namespace, setup: str, log: Path) -> ServerHandle:
    """`memserve up` for ``setup`` (one thread per worker), once /health answers 200."""
    topology = ["--cpu-workers", "2"] if setup == "colocated" else ["--instances", "prefill,decode", "--pd-mode", setup]
    return start_server(["--num-blocks", str(args.num_blocks), "--transfer-mode", args.transfer_mode, *topology],
                        log, threads=1, timeout_s=600)


def handoffs(url: str) -> dict:
    """The prefill workers' handoff counters, summed."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    keys = ("handoffs", "blocks_sent", "blocks_skipped", "bytes_sent", "messages", "transfer_s")
    return {k: sum(w.get("pd", {}).get(k, 0) for w in workers) for k in keys}


def bench(args: argparse.Namespace, url: str, workload: str, rate: float, out: Path) -> dict:
    flags = {"long-doc-qa": ["--doc-len", str(args.doc_len), "--questions-per-doc", str(args.turns)],
             "sharegpt": ["--max-turns", str(args.turns), "--max-session-tokens", str(args.max_session_tokens)]}[workload]
    before = handoffs(url)
    cmd = [sys.executable, "-m", "memserve.cli", "bench", "--base-url", url, "--workload", workload,
           "--num-sessions", str(args.num_sessions), "--rate", str(rate), "--max-tokens", str(args.max_tokens),
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

    fig, axes = plt.subplots(len(summary), 2, figsize=(10, 3.2 * len(summary)), squeeze=False)
    for row, (workload, by_rate) in enumerate(summary.items()):
        rates = sorted(by_rate, key=float)
        setups = list(by_rate[rates[0]])
        for col, (key, title) in enumerate((("jct_p99_ms", "P99 JCT"), ("ttft_p99_ms", "P99 TTFT"))):
            ax = axes[row][col]
            for setup in setups:
                ax.plot([float(r) for r in rates], [by_rate[r][setup][key] / 1000 for r in rates], marker="o",
                        label=setup)
            ax.set_title(f"{workload}: {title}")
            ax.set_xlabel("session starts per second")
            ax.set_ylabel("seconds")
    axes[0][0].legend()
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
    p.add_argument("--rates", default="0.5", help="session starts per second, comma-separated")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean pause between turns (pd-caching-3's return of decode KV runs meanwhile)")
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--max-session-tokens", type=int, default=1500)
    p.add_argument("--transfer-mode", default="by-request-agg")
    p.add_argument("--plot", action="store_true", help="write pd-real.png into --out")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict[str, dict]] = {}  # workload -> rate -> setup -> metrics
    for rate in (float(r) for r in args.rates.split(",")):
        for setup in args.setups.split(","):
            server = start(args, setup, args.out / f"{setup}-r{rate:g}.log")
            url = server.base_url
            try:
                for workload in args.workloads.split(","):
                    r = summary.setdefault(workload, {}).setdefault(f"{rate:g}", {})[setup] = bench(
                        args, url, workload, rate, args.out / f"{setup}-{workload}-r{rate:g}.json")
                    print(f"{setup:13s} {workload:12s} {rate:5g}/s JCT p50/p99 {r['jct_p50_ms']:8.0f}/"
                          f"{r['jct_p99_ms']:8.0f} ms  TTFT p50/p99 {r['ttft_p50_ms']:7.0f}/{r['ttft_p99_ms']:7.0f} ms  "
                          f"TBT p99 {r['tbt_p99_ms']:6.0f} ms  cached {r['cached_token_ratio']:.2f}  handoffs "
                          f"{r['handoffs']} blocks {r['blocks_sent']} (skipped {r['blocks_skipped']}) "
                          f"{r['bytes_sent'] / 2**20:.0f} MiB", flush=True)
            finally:
                stop_server(server, timeout_s=60)
    for workload, by_rate in summary.items():
        for rate, row in by_rate.items():
            if "pd-basic" in row and "pd-caching-3" in row:
                ratio = row["pd-caching-3"]["jct_p99_ms"] / row["pd-basic"]["jct_p99_ms"]
                print(f"{workload:12s} {rate:>5s}/s pd-caching-3 / pd-basic P99 JCT: {ratio:.2f} "
                      f"({1 - ratio:.0%} lower)")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.out / "pd-real.png")


if __name__ == "__main__":
    main()
