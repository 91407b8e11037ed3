"""Multi-turn reuse: context caching on vs `--no-prefix-cache`, same build, one run.

Replays ShareGPT sessions with causal dependencies (turn k+1 is sent after turn k's
answer and carries the answer the server produced; greedy decoding, so both runs
produce the same answers and see identical histories) with
`memserve bench` against a real `memserve up`, once with caching and once without, and
prints mean/P99 TTFT by turn and the prompt tokens actually computed (prompt tokens minus
the cached tokens the server reports).

    python benchmarks/real/multiturn_caching.py [--num-sessions 16] [--max-turns 6] [--rate 0.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from memserve.bench.server_process import start_server, stop_server
from memserve.model_files.gguf_convert import ensure_model_dir

REPO = Path(__file__).resolve().parents[2]


def run_bench(server, args, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "memserve.bench.cli", "--base-url", server.base_url, "--workload", "sharegpt",
        "--num-sessions", str(args.num_sessions), "--max-turns", str(args.max_turns), "--rate", str(args.rate),
        "--max-tokens", str(args.max_tokens), "--temperature", "0",
        "--max-session-tokens", str(args.max_session_tokens), "--tokenizer", str(ensure_model_dir(None)),
        "--seed", str(args.seed), "--no-progress", "--output", str(out),
    ]
    if args.concurrency:
        cmd += ["--concurrency", str(args.concurrency)]
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads(out.read_text())


def by_turn(result: dict) -> dict[int, dict]:
    turns: dict[int, dict] = {}
    for r in result["requests"]:
        if r["status"] != "ok" or not r["chunk_times"]:
            continue
        t = turns.setdefault(r["turn"], {"ttft": [], "computed": 0, "prompt": 0})
        t["ttft"].append((r["chunk_times"][0] - r["start"]) * 1000)
        t["prompt"] += r["prompt_tokens"]
        t["computed"] += r["prompt_tokens"] - (r["cached_tokens"] or 0)
    return turns


def late_turns(turns: dict[int, dict], first: int) -> dict:
    ttft = [x for t, v in turns.items() if t >= first for x in v["ttft"]]
    return {"mean_ttft_ms": float(np.mean(ttft)), "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "computed": sum(v["computed"] for t, v in turns.items() if t >= first),
            "prompt": sum(v["prompt"] for t, v in turns.items() if t >= first)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-sessions", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--rate", type=float, default=0.5, help="sessions per second")
    ap.add_argument("--max-tokens", type=int, default=32, help="cap on each answer's length")
    ap.add_argument("--max-session-tokens", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=0,
                    help="cap on requests in flight (1 isolates TTFT from other sessions' prefills)")
    ap.add_argument("--server-args", default="", help="extra `memserve up` flags for both runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="multiturn-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    results = {}
    for label, flags in (("caching", []), ("no-cache", ["--no-prefix-cache"])):
        server = start_server(["--dtype", args.dtype, *args.server_args.split(), *flags],
                              out_dir / f"{label}-server.log", cwd=REPO)
        try:
            results[label] = run_bench(server, args, out_dir / f"{label}.json")
        finally:
            stop_server(server)

    on, off = by_turn(results["caching"]), by_turn(results["no-cache"])
    print(f"\n{'turn':>4} {'n':>3} | {'TTFT mean ms':>12} {'no-cache':>9} {'ratio':>6} | {'P99 ms':>8} "
          f"{'no-cache':>9} | {'computed':>8} {'no-cache':>9} {'saved':>6}")
    for turn in sorted(on):
        a, b = on[turn], off.get(turn)
        if b is None:
            continue
        ma, mb = np.mean(a["ttft"]), np.mean(b["ttft"])
        pa, pb = np.percentile(a["ttft"], 99), np.percentile(b["ttft"], 99)
        saved = 1 - a["computed"] / b["computed"] if b["computed"] else 0.0
        print(f"{turn:>4} {len(a['ttft']):>3} | {ma:12.0f} {mb:9.0f} {mb / ma:6.2f} | {pa:8.0f} {pb:9.0f} | "
              f"{a['computed']:8d} {b['computed']:9d} {saved:6.1%}")
    la, lb = late_turns(on, 3), late_turns(off, 3)
    summary = {
        "turns>=3 mean TTFT speed-up (no-cache / caching)": lb["mean_ttft_ms"] / la["mean_ttft_ms"],
        "turns>=3 P99 TTFT speed-up": lb["p99_ttft_ms"] / la["p99_ttft_ms"],
        "turns>=3 computed prompt tokens saved": 1 - la["computed"] / lb["computed"],
        "overall cached-token ratio": results["caching"]["cached_token_ratio"],
    }
    print()
    for k, v in summary.items():
        print(f"{k:52} {v:.3f}")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nresults in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
