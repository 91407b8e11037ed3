"""How fast the simulator runs: an hour of traffic on 8 instances against a 30 s target.

Runs ``memserve simulate`` on MemServe's preset (Llama-2-13B on H800s), 8 colocated
instances, the ``random`` workload at 10 requests/s for 36,000 requests (an hour), a few
times, and prints each run's wall time: the simulation's own (``simulation.wall_s`` of the
results, what ``memserve simulate`` prints as "in ... s of wall time") and the whole
command's (start-up, workload and results included), with the minimum and the median and
their ratio to the target (below 1: faster than it). Every run must give the same results
(the simulator is deterministic): they are checked equal, wall-clock fields aside.

    python benchmarks/simulated/sim_speed.py                     # 3 runs of the hour
    python benchmarks/simulated/sim_speed.py --num-requests 3600 --runs 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 30.0
COMMAND = ["--cost-model", "llama2-13b-h800", "--instances", "8", "--workload", "random", "--request-rate", "10"]


def run_once(num_requests: int, out: Path) -> tuple[float, float, dict]:
    """One ``memserve simulate`` run: (the simulation's wall s, the command's wall s, results
    without the wall-clock fields)."""
    args = [sys.executable, "-m", "memserve.cli", "simulate", *COMMAND, "--num-requests", str(num_requests),
            "--no-progress", "--output", str(out)]
    started = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True)
    command_s = time.perf_counter() - started
    result = json.loads(out.read_text())
    sim = result["simulation"]
    wall_s = sim.pop("wall_s")
    del sim["requests_per_wall_s"], result["config"]["output"]
    return wall_s, command_s, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=36000, help="requests at 10/s (36,000: an hour)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    print("memserve simulate " + " ".join(COMMAND) + f" --num-requests {args.num_requests}")
    walls, commands, first = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            wall_s, command_s, result = run_once(args.num_requests, Path(tmp) / f"run{k}.json")
            if first is None:
                first = result
            elif result != first:
                raise SystemExit(f"run {k + 1} gave other results than run 1: the simulator must be deterministic")
            walls.append(wall_s)
            commands.append(command_s)
            print(f"run {k + 1}: simulation {wall_s:.2f} s, command {command_s:.2f} s "
                  f"({result['simulation']['steps']} steps, {result['num_requests']['ok']} requests ok)")
    for name, values in (("simulation", walls), ("command", commands)):
        low, mid = min(values), statistics.median(values)
        print(f"{name}: min {low:.2f} s, median {mid:.2f} s; to the hour's {TARGET_S:.0f} s target: "
              f"min {low / TARGET_S:.2f}, median {mid / TARGET_S:.2f}")


if __name__ == "__main__":
    main()
