"""MemServe Fig. 8 on the simulator: disaggregated prefill/decode with context caching at
cluster scale. 8 instances of a paper preset (``llama2-13b-h800``: Llama-2-13B, TP 2 on
H800s, NVLink between instances), run as 8 colocated instances with context caching
(PD-CC) and as 4 prefill + 4 decode instances in each ``--pd-mode`` (MemServe Table 4),
every instance with the same KV pool (same total KV), prompt-tree routing, on ShareGPT
multi-turn and long-doc-qa (LooGLE-like) sessions, at several session-start rates.

Prints and writes (``summary.json``) JCT and TTFT P50/P99, TBT P99, the cached-token
ratio and what moved between instances (handoff blocks and bytes, decode-phase KV
returned to prefill) per point; plots Fig. 8's shape (metric against the rate per
instance, one line per setting) and prints pd-caching-3's P99 JCT against pd-basic's.

    python benchmarks/simulated/pd_sim.py --out /tmp/pd-sim
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

from memserve.cli import main as memserve

MODES = ("pd-basic", "pd-caching-1", "pd-caching-2", "pd-caching-3")
WORKLOADS = {
    # Recorded answer lengths; each next turn's history holds the answer the engine produced
    # (MemServe §8.2 replaces the recorded responses with the model's), so decode-phase KV
    # is reusable.
    "sharegpt": ["--workload", "sharegpt"],
    # MemServe §8.2: LooGLE documents (cut to fit the context) with their first five
    # questions, short answers.
    "long-doc-qa": ["--workload", "long-doc-qa", "--doc-len", "2048", "--questions-per-doc", "5",
                    "--output-len", "64"],
}
METRICS = (("jct_p50_ms", "P50 JCT (ms)"), ("jct_p99_ms", "P99 JCT (ms)"), ("ttft_p50_ms", "P50 TTFT (ms)"),
           ("ttft_p99_ms", "P99 TTFT (ms)"), ("tbt_p99_ms", "P99 TBT (ms)"))


def settings(instances: int, prefill: int) -> dict[str, list[str]]:
    """Label -> the simulate flags of that setting."""
    roles = ",".join(["prefill"] * prefill + ["decode"] * (instances - prefill))
    out = {"colocated": ["--instances", str(instances)]}
    for mode in MODES:
        out[mode] = ["--instances", roles, "--pd-mode", mode]
    return out


def run_point(out: Path, args: argparse.Namespace, workload: str, rate: float, label: str, flags: list[str]) -> dict:
    path = out / f"{workload}-r{rate:g}-{label}.json"
    argv = ["simulate", "--cost-model", args.cost_model, *flags, "--router", "prompt-tree",
            "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs), *WORKLOADS[workload], "--num-sessions", str(args.num_sessions),
            "--max-tokens", str(args.max_tokens), "--max-model-len", "4096", "--think-time", str(args.think_time),
            "--rate", str(rate * args.instances), "--seed", str(args.seed), "--no-progress", "--output", str(path)]
    if args.dataset:
        argv += ["--dataset", args.dataset]
    with contextlib.redirect_stdout(io.StringIO()):
        if memserve(argv) != 0:
            raise RuntimeError(f"memserve {' '.join(argv)} failed")
    r = json.loads(path.read_text())
    pd = r["simulation"].get("pd", {})
    return {"jct_p50_ms": r["jct_ms"]["p50"], "jct_p99_ms": r["jct_ms"]["p99"], "ttft_p50_ms": r["ttft_ms"]["p50"],
            "ttft_p99_ms": r["ttft_ms"]["p99"], "tbt_p99_ms": r["tbt_ms"]["p99"],
            "cached_token_ratio": r["cached_token_ratio"], "requests": r["num_requests"]["ok"],
            "errors": r["errors"]["count"], "handoff_blocks": pd.get("blocks_sent", 0),
            "handoff_bytes": pd.get("bytes_sent", 0), "blocks_skipped": pd.get("blocks_skipped", 0),
            "returned_blocks": pd.get("returned_blocks", 0), "returned_bytes": pd.get("returned_bytes", 0),
            "handoff_failed": pd.get("handoff_failed", 0)}


def plot(summary: dict, labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(METRICS), len(summary), figsize=(5 * len(summary), 2.8 * len(METRICS)),
                             squeeze=False)
    for col, (workload, by_rate) in enumerate(summary.items()):
        rates = sorted(by_rate, key=float)
        for row, (key, name) in enumerate(METRICS):
            ax = axes[row][col]
            for label in labels:
                ax.plot([float(r) for r in rates], [by_rate[r][label][key] for r in rates], marker="o", label=label,
                        linestyle="--" if label == "colocated" else "-")
            ax.set_xlabel("session starts / s per instance")
            ax.set_ylabel(name)
            if row == 0:
                ax.set_title(workload)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("pd-sim"))
    p.add_argument("--cost-model", default="llama2-13b-h800")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--prefill", type=int, default=4, help="prefill instances of the disaggregated settings")
    # 8192 blocks of 16 tokens: 107 GB of KV, what two H800s hold beside Llama-2-13B's weights.
    p.add_argument("--num-blocks", type=int, default=8192, help="KV blocks per instance (every setting)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--num-sessions", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=512, help="cap on the recorded answer lengths")
    p.add_argument("--think-time", type=float, default=1.0, help="mean pause between turns (s)")
    p.add_argument("--rates", default="0.5,1,2", help="session starts per second per instance")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dataset", help="ShareGPT JSONL (default: the bench's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = settings(args.instances, args.prefill)
    summary: dict = {}
    for workload in args.workloads.split(","):
        for rate in (float(r) for r in args.rates.split(",")):
            row = summary.setdefault(workload, {}).setdefault(f"{rate:g}", {})
            for label, flags in runs.items():
                m = row[label] = run_point(args.out, args, workload, rate, label, flags)
                print(f"{workload:11s} {rate:5g}/s/inst {label:12s} JCT p50 {m['jct_p50_ms']:7.0f} p99 "
                      f"{m['jct_p99_ms']:7.0f} ms  TTFT p50 {m['ttft_p50_ms']:6.1f} p99 {m['ttft_p99_ms']:7.1f} ms  "
                      f"TBT p99 {m['tbt_p99_ms']:6.1f} ms  cached {m['cached_token_ratio']:.3f}  "
                      f"handoff {m['handoff_blocks']:6d} blk {m['handoff_bytes'] / 1e9:6.1f} GB  "
                      f"returned {m['returned_blocks']:6d} blk", flush=True)
            ratio = row["pd-caching-3"]["jct_p99_ms"] / row["pd-basic"]["jct_p99_ms"]
            print(f"{workload:11s} {rate:5g}/s/inst pd-caching-3 / pd-basic P99 JCT: {ratio:.2f} "
                  f"({1 - ratio:+.0%} lower)", flush=True)
    (args.out / "summary.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                       "results": summary}, indent=1))
    plot(summary, list(runs), args.out / "pd_sim.png")
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'pd_sim.png'}")


if __name__ == "__main__":
    main()
