"""Per-request overhead of `memserve up --ray` against the local spawn, on a ShareGPT replay.

Serves the default model with ``--cpu-workers N`` twice per round, its workers spawned as
local processes and then placed by Ray (``--ray local``: a Ray instance of the gateway's
own), and replays the same ShareGPT multi-turn workload (same seed, same sessions) against
each with ``memserve bench``. Only one server runs at a time. Both run ``--cpu-threads 1``
by default: ``--ray`` gives each worker one thread unless told otherwise, the local spawn
torch's default (every core), so the two defaults differ in more than Ray. Prints each
run's TTFT and TBT means, then per deployment the median over the rounds, and the ratios
--ray / local: the worker processes are the same either way, so a ratio away from 1 is
what Ray adds to each request (its actors, TCP instead of ipc between gateway and
workers), within the noise of a shared machine.

    python benchmarks/real/ray_overhead.py [--rounds 1] [--cpu-workers 2] [--cpu-threads 1] [-- extra memserve up flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cold_start import REPO

from memserve.bench.server_process import serving

BENCH = ["--workload", "sharegpt", "--num-sessions", "8", "--max-turns", "3", "--rate", "0.5",
         "--max-tokens", "32", "--seed", "0", "--no-progress"]


def replay(flags: list[str], tmp: Path, name: str) -> tuple[float, float]:
    """(TTFT mean, TBT mean) in ms of the ShareGPT replay against a server started with ``flags``."""
    out = tmp / f"{name}.json"
    with serving(flags, tmp / f"{name}.log", cwd=REPO) as server:
        subprocess.run([sys.executable, "-m", "memserve.cli", "bench", "--base-url", server.base_url,
                        "--model", server.model, "--output", str(out), *BENCH], check=True, cwd=REPO)
    result = json.loads(out.read_text())
    return result["ttft_ms"]["mean"], result["tbt_ms"]["mean"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="compute threads per worker, for both (--ray's default is 1, the local spawn's torch's)")
    ap.add_argument("--ray-address", default="local", help="--ray's address (default: a Ray instance of its own)")
    ap.add_argument("--rounds", type=int, default=1, help="local then --ray, this many times alternately")
    ap.add_argument("extra", nargs="*", help="flags passed to memserve up (after --)")
    args = ap.parse_args()
    flags = ["--cpu-workers", str(args.cpu_workers), "--cpu-threads", str(args.cpu_threads), *args.extra]
    deployments = {"local": flags, "--ray": ["--ray", args.ray_address, *flags]}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in deployments}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name, f in deployments.items():
                ttft, tbt = replay(f, Path(tmp), f"{name.strip('-')}-{i}")
                runs[name].append((ttft, tbt))
                print(f"round {i} {name:6} TTFT mean {ttft:8.1f} ms  TBT mean {tbt:6.1f} ms", flush=True)
    med = {name: (statistics.median(t for t, _ in r), statistics.median(b for _, b in r)) for name, r in runs.items()}
    label = "median" if args.rounds > 1 else "mean"
    print(f"\n{'':8} {'TTFT ' + label:>14} {'TBT ' + label:>12}   ({args.rounds} run(s) each)")
    for name, (ttft, tbt) in med.items():
        print(f"{name:8} {ttft:11.1f} ms {tbt:9.1f} ms")
    print(f"{'ratio':8} {med['--ray'][0] / med['local'][0]:13.3f}x {med['--ray'][1] / med['local'][1]:11.3f}x"
          "   (--ray / local)")


if __name__ == "__main__":
    main()
