"""An hour of a 256-instance cluster on the simulator: 32 hosts of 8 instances, one host
lost halfway through, against a 10-minute wall-time target.

Runs ``memserve simulate`` on MemServe's preset (Llama-2-13B, TP 2 on H800s): 256
colocated instances, 8 a host (the preset's NVLink transfer within a host, a 25 GB/s
cross-host link between hosts), the ``cost`` router (MemServe eqs. 1-2: it pulls a prefix
from another instance when that beats recomputing it), a host tier behind each device pool
saved to by the asynchronous saver on the virtual clock, and the ``shared-prefix``
workload: 512 system prompts of 1,024 tokens, questions of 32-256 tokens, answers of 128
tokens on average, at ``--rate`` requests/s for ``--minutes`` (an hour by default). One
host is lost every simulated hour (``--node-loss-every``, 3,600 s: the first at 30 minutes);
its requests move to live instances at the heartbeat timeout, as the gateway moves a dead
worker's.

Prints the wall time (the simulation's own, as ``memserve simulate`` prints it, and the
whole command's), the requests served, the requests moved off the lost host (sent again
or resumed), TTFT and JCT P50/P99 of all requests and of the moved ones, the cached-token
share, the prefix pulls by link, and the blocks dropped unsaved with the saver's waits.
``--profile N`` instead runs the simulation in this process under cProfile and prints its
N costliest functions (own time).

    python benchmarks/simulated/cluster_hour.py                       # the hour
    python benchmarks/simulated/cluster_hour.py --minutes 2 --profile 25
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 600.0
CLUSTER = ["--cost-model", "llama2-13b-h800", "--instances", "256", "--instances-per-host", "8", "--router", "cost",
           "--num-blocks", "1024", "--num-host-blocks", "2048", "--async-saver"]
WORKLOAD = ["--workload", "shared-prefix", "--num-prefixes", "512", "--prefix-len", "1024",
            "--input-len", "uniform:32:256", "--output-len", "exp:128"]


def command(rate: float, minutes: float, loss_every_s: float, out: Path) -> list[str]:
    return ["simulate", *CLUSTER, "--node-loss-every", f"{loss_every_s:g}", *WORKLOAD, "--request-rate", f"{rate:g}",
            "--num-requests", str(round(rate * minutes * 60)), "--no-progress", "--output", str(out)]


def profile(argv: list[str], top: int) -> None:
    """Run ``memserve`` in this process under cProfile; print the ``top`` functions by own time."""
    from memserve.cli import main as memserve

    profiler = cProfile.Profile()
    with contextlib.redirect_stdout(io.StringIO()):
        profiler.runcall(memserve, argv)
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(top)


def report(result: dict, command_s: float) -> None:
    sim = result["simulation"]
    loss, tiers = sim["node_loss"], sim["tiers"]
    wall = sim["wall_s"]
    print(f"wall time: simulation {wall:.1f} s, command {command_s:.1f} s "
          f"({wall / TARGET_S:.2f}x the {TARGET_S:.0f} s target); simulated {sim['simulated_s']:.0f} s, "
          f"{sim['steps']} engine steps")
    print(f"requests served: {result['num_requests']['ok']} ok of {result['num_requests']['finished']}")
    lost = ", ".join(f"host {x['host']} at {x['at_s']:.0f} s" for x in loss["lost"])
    print(f"hosts lost: {lost or 'none'}; requests moved: {loss['moved_requests']} {loss['moves']}")
    for name, key in (("TTFT", "ttft_ms"), ("JCT", "jct_ms")):
        every = result[key]
        moved = loss["moved"][key]
        line = f"{name} ms: p50 {every['p50']:.0f}, p99 {every['p99']:.0f}"
        if moved["count"]:
            line += f"; moved requests p50 {moved['p50']:.0f}, p99 {moved['p99']:.0f}"
        print(line)
    print(f"cached-token share: {result['cached_token_ratio']:.3f}; prefix pulls: {sim['hosts']['pulls']}")
    saver = tiers["saver"]
    print(f"blocks dropped unsaved: {tiers['dropped_unsaved']}; saver: {saver['jobs']} copies, "
          f"{saver['waits']} waits for it, {saver['stall_s']:.3f} s waited")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--minutes", type=float, default=60.0, help="simulated minutes of arrivals")
    p.add_argument("--node-loss-every", type=float, default=3600.0, metavar="S",
                   help="lose a host every S simulated seconds, the first at S/2")
    p.add_argument("--profile", type=int, metavar="N", help="profile the run instead; print the N costliest")
    p.add_argument("--output", help="keep the results JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.output or Path(tmp) / "cluster_hour.json")
        argv = command(args.rate, args.minutes, args.node_loss_every, out)
        print("memserve " + " ".join(argv[:-2]))
        if args.profile:
            profile(argv, args.profile)
            return
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memserve.cli", *argv], check=True, capture_output=True)
        report(json.loads(out.read_text()), time.perf_counter() - started)


if __name__ == "__main__":
    main()
