"""N-gram speculative decoding (``--speculative-config``) against plain decoding, same build.

Starts `memserve up` without and with prompt-lookup drafts, one after the other, ``--reps``
times in alternation (so that a shared machine's load falls on both alike), and runs
`memserve bench` workloads against each: multi-turn ShareGPT conversations at a fixed
session rate, and a closed loop of random prompts at a fixed concurrency. Greedy
decoding, so both sides produce the same tokens. Prints the median of each metric per
side, the ratio speculative / plain, and how many drafts were proposed and kept (from
``/v1/stats``). TBT is per streamed chunk, as vLLM's benchmark measures ITL; with drafts a
chunk may carry several tokens, so TPOT (time per output token) is the per-token view.

    python benchmarks/real/speculative_decoding.py [--reps 2] [--workloads sharegpt,closed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from memserve.bench.server_process import serving
from memserve.model_files.gguf_convert import ensure_model_dir

REPO = Path(__file__).resolve().parents[2]
METRICS = [("TTFT mean", "ttft_ms", "mean"), ("TTFT p99", "ttft_ms", "p99"), ("TBT mean", "tbt_ms", "mean"),
           ("TBT p99", "tbt_ms", "p99"), ("TPOT mean", "tpot_ms", "mean"), ("JCT mean", "jct_ms", "mean"),
           ("JCT p99", "jct_ms", "p99"), ("output tok/s", "throughput", "output_tokens_per_s")]


def workload_flags(name: str, args: argparse.Namespace) -> list[str]:
    if name == "sharegpt":
        return ["--workload", "sharegpt", "--num-sessions", str(args.num_sessions), "--max-turns", str(args.max_turns),
                "--rate", str(args.rate), "--max-tokens", str(args.max_tokens)]
    if name == "closed":
        return ["--workload", "random", "--num-requests", str(args.num_requests), "--input-len", "256",
                "--output-len", "128", "--fixed-output-len", "--concurrency", str(args.concurrency)]
    raise SystemExit(f"unknown workload {name!r}")


def run_side(flags: list[str], workloads: list[str], args: argparse.Namespace, out_dir: Path, tag: str) -> dict:
    """One server up; every workload against it; {workload: (bench result, spec counts)}."""
    results = {}
    with serving([*flags, *args.server_args.split()], out_dir / f"{tag}.log") as server:
        for name in workloads:
            out = out_dir / f"{tag}-{name}.json"
            before = server.get_json("/v1/stats")["instances"][0]["spec_decode"]
            subprocess.run([sys.executable, "-m", "memserve.bench.cli", "--base-url", server.base_url,
                            "--tokenizer", str(ensure_model_dir(None)), "--temperature", "0", "--seed",
                            str(args.seed), "--no-progress", "--output", str(out), *workload_flags(name, args)],
                           check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            after = server.get_json("/v1/stats")["instances"][0]["spec_decode"]
            results[name] = (json.loads(out.read_text()), {k: after[k] - before[k] for k in after})
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workloads", default="sharegpt,closed")
    ap.add_argument("--speculative-config",
                    default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                            '"prompt_lookup_min": 2}')
    ap.add_argument("--num-sessions", type=int, default=16, help="sharegpt: sessions")
    ap.add_argument("--max-turns", type=int, default=4, help="sharegpt: turns per session")
    ap.add_argument("--rate", type=float, default=0.5, help="sharegpt: sessions per second")
    ap.add_argument("--max-tokens", type=int, default=64, help="sharegpt: cap on each answer")
    ap.add_argument("--num-requests", type=int, default=48, help="closed: requests (256 in, 128 out)")
    ap.add_argument("--concurrency", type=int, default=16, help="closed: requests in flight")
    ap.add_argument("--server-args", default="", help="extra `memserve up` flags for both sides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="speculative-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = args.workloads.split(",")
    sides = {"plain": [], "ngram": ["--speculative-config", args.speculative_config]}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(args.reps):
        for side, flags in sides.items():
            print(f"rep {rep + 1}/{args.reps}: {side}", flush=True)
            runs[side].append(run_side(flags, workloads, args, out_dir, f"{side}-{rep}"))
    for name in workloads:
        print(f"\n### {name}\n\n| metric | plain | ngram | ngram / plain |\n| --- | ---: | ---: | ---: |")
        for label, key, stat in METRICS:
            plain = statistics.median(r[name][0][key][stat] for r in runs["plain"])
            spec = statistics.median(r[name][0][key][stat] for r in runs["ngram"])
            print(f"| {label} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x |")
        drafted = sum(r[name][1]["draft_tokens"] for r in runs["ngram"])
        kept = sum(r[name][1]["accepted_tokens"] for r in runs["ngram"])
        output = sum(r[name][0]["tokens"]["output"] for r in runs["ngram"])
        print(f"\ndrafts kept: {kept} of {drafted} ({kept / max(drafted, 1):.0%}); "
              f"{kept / max(output, 1):.0%} of the output tokens came from kept drafts")
    print(f"\nresults: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
