"""MemServe Fig. 15 on the simulator: the global scheduler's policies (least-load,
session, prompt-tree, cost) on N simulated instances of a paper preset, for long-doc-qa
and ShareGPT with share ratios 1..4 (a share ratio k replays every session k times as
distinct sessions). Writes one ``memserve simulate`` results file per point, a
``summary.json`` (P99/mean TTFT, mean JCT, cached-token ratio per policy) and a plot.

    python benchmarks/simulated/global_scheduler_sim.py --out /tmp/global-scheduler-sim

``--workloads hot-prefix`` is the skewed load: single-turn requests that all share a few
long system prompts (``--hot-prefixes``, fewer than the instances), so following the
cache piles the load onto the instances that hold them:

    python benchmarks/simulated/global_scheduler_sim.py --out /tmp/gs-hot --workloads hot-prefix --share-ratios 1

The real run's setting (``global_scheduler_real.py``'s defaults on a ``memserve profile``
of the CPU workers) on the simulator:

    python benchmarks/simulated/global_scheduler_sim.py --out /tmp/gs-sim-cpu --cost-model cpu-1t.json --instances 3 \
        --num-sessions 8 --rate 0.5 --share-ratios 2,3 --doc-len 768 --questions-per-doc 3 --max-tokens 16 \
        --num-blocks 512 --sharegpt-max-turns 3 --sharegpt-max-session-tokens 1500
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from memserve.cli import main as memserve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "real"))  # the skewed load, shared with the real run
from hot_prefix import add_hot_prefix_args, hot_prefix_flags  # noqa: E402

POLICIES = ("least-load", "session", "prompt-tree", "cost")
WORKLOADS = ("long-doc-qa", "sharegpt")  # and "hot-prefix", the skewed load (not run by default)
METRICS = (("ttft_p99_ms", "P99 TTFT (ms)"), ("ttft_mean_ms", "mean TTFT (ms)"), ("jct_mean_ms", "mean JCT (ms)"),
           ("cached_token_ratio", "cached-token ratio"))


def run_point(out: Path, args: argparse.Namespace, workload: str, share_ratio: int, policy: str) -> dict:
    path = out / f"{workload}-sr{share_ratio}-{policy}.json"
    argv = ["simulate", "--cost-model", args.cost_model, "--instances", str(args.instances), "--router", policy,
            *workload_flags(args, workload), "--num-sessions", str(args.num_sessions), "--share-ratio",
            str(share_ratio), "--rate", str(args.rate), "--seed", str(args.seed), "--num-blocks", str(args.num_blocks),
            "--long-prefill-token-threshold", str(args.long_prefill_token_threshold), "--no-progress",
            "--output", str(path)]
    if args.max_tokens:
        argv += ["--max-tokens", str(args.max_tokens)]
    if args.no_shared_prefill_hold:
        argv.append("--no-shared-prefill-hold")
    with contextlib.redirect_stdout(io.StringIO()):
        if memserve(argv) != 0:
            raise RuntimeError(f"memserve {' '.join(argv)} failed")
    r = json.loads(path.read_text())
    return {"ttft_p99_ms": r["ttft_ms"]["p99"], "ttft_mean_ms": r["ttft_ms"]["mean"], "jct_mean_ms": r["jct_ms"]["mean"],
            "cached_token_ratio": r["cached_token_ratio"], "requests": r["num_requests"]["ok"]}


def workload_flags(args: argparse.Namespace, workload: str) -> list[str]:
    if workload == "hot-prefix":
        return hot_prefix_flags(args)
    if workload == "long-doc-qa":
        return ["--workload", workload, "--doc-len", str(args.doc_len), "--questions-per-doc", str(args.questions_per_doc)]
    flags = ["--workload", workload]
    if args.sharegpt_max_turns:
        flags += ["--max-turns", str(args.sharegpt_max_turns)]
    if args.sharegpt_max_session_tokens:
        flags += ["--max-session-tokens", str(args.sharegpt_max_session_tokens)]
    return flags


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(METRICS), len(summary), figsize=(5 * len(summary), 3 * len(METRICS)), squeeze=False)
    for col, (workload, by_ratio) in enumerate(summary.items()):
        ratios = sorted(by_ratio, key=int)
        for row, (key, label) in enumerate(METRICS):
            ax = axes[row][col]
            for policy in POLICIES:
                ax.plot([int(r) for r in ratios], [by_ratio[r][policy][key] for r in ratios], marker="o", label=policy)
            ax.set_xlabel("share ratio")
            ax.set_ylabel(label)
            ax.set_xticks([int(r) for r in ratios])
            if row == 0:
                ax.set_title(workload)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("global-scheduler-sim"))
    p.add_argument("--cost-model", default="llama2-13b-h800")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--num-sessions", type=int, default=80, help="sessions before sharing (MemServe: 80 LooGLE ones)")
    p.add_argument("--share-ratios", default="1,2,3,4")
    p.add_argument("--rate", type=float, default=8.0, help="session starts per second")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--doc-len", type=int, default=3000, help="long-doc-qa document tokens")
    p.add_argument("--questions-per-doc", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=2048, help="device KV blocks per instance")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="the instances' (0: no cap)")
    p.add_argument("--no-shared-prefill-hold", action="store_true", help="the instances' (memserve simulate's flag)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on answer tokens (default: the recorded ones)")
    p.add_argument("--sharegpt-max-turns", type=int, default=None)
    p.add_argument("--sharegpt-max-session-tokens", type=int, default=None)
    add_hot_prefix_args(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    for workload in args.workloads.split(","):
        for ratio in (int(r) for r in args.share_ratios.split(",")):
            row = summary.setdefault(workload, {}).setdefault(str(ratio), {})
            for policy in POLICIES:
                row[policy] = run_point(args.out, args, workload, ratio, policy)
                m = row[policy]
                print(f"{workload:12s} share {ratio}  {policy:11s}  P99 TTFT {m['ttft_p99_ms']:8.1f} ms  "
                      f"mean TTFT {m['ttft_mean_ms']:7.1f} ms  JCT {m['jct_mean_ms']:7.0f} ms  "
                      f"cached {m['cached_token_ratio']:.3f}", flush=True)
            gain = 1 - row["prompt-tree"]["ttft_p99_ms"] / row["session"]["ttft_p99_ms"]
            print(f"{workload:12s} share {ratio}  prompt-tree P99 TTFT vs session: {abs(gain):.0%} "
                  f"{'lower' if gain >= 0 else 'higher'}; "
                  f"cost/prompt-tree P99: {row['cost']['ttft_p99_ms'] / row['prompt-tree']['ttft_p99_ms']:.2f}")
    (args.out / "summary.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                       "results": summary}, indent=1))
    plot(summary, args.out / "global_scheduler.png")
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'global_scheduler.png'}")


if __name__ == "__main__":
    main()
