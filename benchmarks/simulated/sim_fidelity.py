"""Simulator fidelity: the same workload served for real and simulated on this machine's
profiled cost model; prints TTFT and JCT medians and the simulated/real ratios.

For each workload a fresh ``memserve up`` (one worker, ``OMP_NUM_THREADS`` as profiled)
serves ``memserve bench``; then ``memserve simulate`` replays the same sessions with the
same seed, token lengths from the served model's tokenizer and the same engine sizes.
Both write results.json files (``memserve bench compare`` reads them too).

    memserve profile --dtype float32 --threads 1 --output cost.json
    python benchmarks/simulated/sim_fidelity.py --cost-model cost.json --out-dir fidelity/
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from memserve.bench.server_process import serving
from memserve.model_files.gguf_convert import ensure_model_dir

WORKLOADS = {
    "sharegpt": ["--workload", "sharegpt", "--num-sessions", "16", "--max-turns", "4", "--rate", "0.5"],
    "shared-prefix": ["--workload", "shared-prefix", "--num-requests", "48", "--num-prefixes", "4",
                      "--prefix-len", "512", "--request-rate", "1"],
}


def run(cmd: list[str], **kw) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def medians(path: Path) -> dict[str, float]:
    d = json.loads(path.read_text())
    return {"ttft_ms": d["ttft_ms"]["p50"], "jct_ms": d["jct_ms"]["p50"], "tbt_ms": d["tbt_ms"]["p50"],
            "requests": d["ttft_ms"]["count"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", required=True)
    p.add_argument("--out-dir", type=Path, default=Path("fidelity"))
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker (as profiled)")
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model_dir(None)
    common = ["--seed", str(args.seed), "--max-tokens", str(args.max_tokens), "--fixed-output-len",
              "--tokenizer", str(model_dir)]
    rows = []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name] + common
        real, sim = args.out_dir / f"{name}-real.json", args.out_dir / f"{name}-sim.json"
        flags = ["--num-blocks", str(args.num_blocks), "--log-level", "WARNING"]
        with serving(flags, args.out_dir / f"{name}-server.log", threads=args.threads, timeout_s=600) as server:
            run([sys.executable, "-m", "memserve.cli", "bench", "--base-url", server.base_url, *workload,
                 "--no-progress", "--label", f"real:{name}", "--output", str(real)], stdout=subprocess.DEVNULL)
        run([sys.executable, "-m", "memserve.cli", "simulate", "--cost-model", args.cost_model, "--instances", "1",
             "--num-blocks", str(args.num_blocks), *workload, "--label", f"sim:{name}", "--output", str(sim)],
            stdout=subprocess.DEVNULL)
        r, s = medians(real), medians(sim)
        rows.append((name, r, s))
    print(f"\n{'workload':14} {'metric':8} {'real':>9} {'sim':>9} {'sim/real':>9}")
    for name, r, s in rows:
        for metric in ("ttft_ms", "jct_ms", "tbt_ms"):
            print(f"{name:14} {metric:8} {r[metric]:9.1f} {s[metric]:9.1f} {s[metric] / r[metric]:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
