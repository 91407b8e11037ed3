"""MemServe Fig. 15 on real workers: for each share ratio and routing policy, start
`memserve up` with 3 CPU workers (one thread each, OMP_NUM_THREADS=1, so they share a
small machine fairly), replay long-doc-qa and ShareGPT with that share ratio (every
session replayed k times as distinct sessions) with `memserve bench`, and stop it (every
point starts from cold caches). Prints P99/mean TTFT, mean JCT and the cached-token
ratio per policy, and writes the results files and a summary.

The ``cost`` policy needs this machine's cost model: ``memserve profile --quick
--threads 1 --dtype float32 --output cpu-1t.json`` then ``--cost-model cpu-1t.json``.

    python benchmarks/real/global_scheduler_real.py --out /tmp/gs-real --cost-model cpu-1t.json --share-ratios 1,2,3,4

``--workloads hot-prefix --share-ratios 1`` is the skewed load (``hot_prefix.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from hot_prefix import add_hot_prefix_args, hot_prefix_flags

from memserve.bench.server_process import serving
from memserve.model_files.gguf_convert import ensure_model_dir

POLICIES = ("least-load", "session", "prompt-tree", "cost")
# ShareGPT as replayed on three CPU workers: the first turns, conversations that fit,
# counted by the served model's tokenizer (at four characters a token, a 2,302-token turn
# of a 1,500-token session got in).
SHAREGPT_MAX_TURNS, SHAREGPT_MAX_SESSION_TOKENS = 3, 1500


def server_flags(args: argparse.Namespace, policy: str) -> list[str]:
    flags = ["--cpu-workers", "3", "--num-blocks", str(args.num_blocks), "--router", policy,
             "--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    if args.no_shared_prefill_hold:
        flags.append("--no-shared-prefill-hold")
    return flags + ["--cost-model", args.cost_model] if args.cost_model else flags


def bench(args: argparse.Namespace, url: str, workload: str, share_ratio: int, out: Path) -> dict:
    flags = {"long-doc-qa": ["--workload", workload, "--doc-len", str(args.doc_len), "--questions-per-doc", "3"],
             "sharegpt": ["--workload", workload, "--max-turns", str(SHAREGPT_MAX_TURNS),
                          "--max-session-tokens", str(SHAREGPT_MAX_SESSION_TOKENS),
                          "--tokenizer", str(ensure_model_dir(None))],
             "hot-prefix": hot_prefix_flags(args)}[workload]
    cmd = [sys.executable, "-m", "memserve.cli", "bench", "--base-url", url,
           "--num-sessions", str(args.num_sessions), "--share-ratio", str(share_ratio), "--rate", str(args.rate),
           "--max-tokens", str(args.max_tokens), "--seed", str(args.seed), "--no-progress", "--output", str(out),
           *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    with urllib.request.urlopen(url + "/metrics", timeout=10) as m:  # router and hold counters so far
        router = [line for line in m.read().decode().splitlines()
                  if line.startswith(("memserve_router_", "memserve_shared_prefill_holds")) and "_bucket" not in line]
    return {"ttft_p99_ms": r["ttft_ms"]["p99"], "ttft_mean_ms": r["ttft_ms"]["mean"], "jct_mean_ms": r["jct_ms"]["mean"],
            "cached_token_ratio": r["cached_token_ratio"], "requests": r["num_requests"]["ok"], "router": router}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("global-scheduler-real"))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--workloads", default="long-doc-qa,sharegpt")
    p.add_argument("--cost-model", help="required by the cost policy (see above)")
    p.add_argument("--num-sessions", type=int, default=8, help="sessions before sharing")
    p.add_argument("--share-ratios", default="2", help="comma-separated, e.g. 1,2,3,4")
    p.add_argument("--rate", type=float, default=0.5, help="session starts per second")
    p.add_argument("--doc-len", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per worker")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="the workers' (0: no cap)")
    p.add_argument("--no-shared-prefill-hold", action="store_true", help="the workers' (memserve up's flag)")
    p.add_argument("--seed", type=int, default=0, help="the bench's: which documents, questions and arrival times")
    add_hot_prefix_args(p)
    args = p.parse_args()
    if "cost" in args.policies.split(",") and not args.cost_model:
        p.error("the cost policy needs --cost-model (see above)")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    for ratio in (int(r) for r in args.share_ratios.split(",")):
        for policy in args.policies.split(","):
            with serving(server_flags(args, policy), args.out / f"server-sr{ratio}-{policy}.log", threads=1,
                         timeout_s=600) as server:
                url = server.base_url
                for workload in args.workloads.split(","):  # each workload's text is its own: no carry-over
                    m = summary.setdefault(workload, {}).setdefault(str(ratio), {})[policy] = bench(
                        args, url, workload, ratio, args.out / f"{workload}-sr{ratio}-{policy}.json")
                    print(f"{workload:12s} share {ratio}  {policy:11s}  P99 TTFT {m['ttft_p99_ms']:8.1f} ms  "
                          f"mean TTFT {m['ttft_mean_ms']:7.1f} ms  JCT {m['jct_mean_ms']:7.0f} ms  "
                          f"cached {m['cached_token_ratio']:.3f}  ({m['requests']} requests)", flush=True)
    for workload, by_ratio in summary.items():
        for ratio, row in by_ratio.items():
            if "session" in row and "prompt-tree" in row:
                gain = 1 - row["prompt-tree"]["ttft_p99_ms"] / row["session"]["ttft_p99_ms"]
                print(f"{workload} share {ratio}: prompt-tree P99 TTFT {abs(gain):.0%} "
                      f"{'lower' if gain >= 0 else 'higher'} than session")
            if "cost" in row and "prompt-tree" in row:
                print(f"{workload} share {ratio}: cost/prompt-tree P99 TTFT "
                      f"{row['cost']['ttft_p99_ms'] / row['prompt-tree']['ttft_p99_ms']:.2f}")
    (args.out / "summary.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                       "results": summary}, indent=1))


if __name__ == "__main__":
    main()
