"""Scheduler overhead per engine step with N running sequences, against a baseline revision.

The scheduler runs with no runner at all (every scheduled request samples token 1), so
what a step costs here is the scheduler's own Python: scheduling, the KV cache manager,
MemPool and the bookkeeping of results. The baseline is the same measurement run on another git
revision (checked out into a temporary worktree) in the same run, so the ratio compares
like with like on a noisy machine.

    python benchmarks/micro/scheduler_overhead.py --baseline 9fe2496 --running 64  # before the engine seams
    python benchmarks/micro/scheduler_overhead.py --baseline 9fe2496 --callgrind --steps 50  # instruction counts
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(running: int, steps: int, repeats: int) -> dict:
    """Least microseconds (of ``repeats``) of the scheduler's ``schedule`` + ``update`` for one decode step
    of ``running`` sequences. Works on the scheduler of this tree, and on the one before
    the engine seams (``SchedulerOutput`` of live sequences) for the baseline."""
    from memserve.ipc.messages import SamplingParams
    from memserve.kvcache.address import Tier
    from memserve.kvcache.mempool import MemPool
    from memserve.workers.engine import scheduler as sched_mod
    from memserve.workers.engine.sequence import Sequence

    num_blocks = running * (600 + steps) // 16
    samples = []
    for r in range(repeats):
        mempool = MemPool(0, {Tier.DEVICE: num_blocks}, 16)
        if hasattr(sched_mod, "SchedulerConfig"):  # this tree
            from memserve.workers.engine.kv_manager import KVCacheManager
            from memserve.workers.engine.policies import make_schedule_policy
            from memserve.workers.engine.step_plan import StepResult

            sched = sched_mod.Scheduler(KVCacheManager(mempool, True), make_schedule_policy("fcfs"),
                                        sched_mod.SchedulerConfig(running, running * 512, 1 << 20), set(), time.monotonic)

            def one_step(sched=sched) -> int:
                plan = sched.schedule()
                return len(sched.update(plan, StepResult({c.request_id: 1 for c in plan.chunks if c.sample})))
        else:  # before the engine seams
            sched = sched_mod.Scheduler(mempool, num_blocks, 16, running, running * 512, 1 << 20, set(), True,
                                        time.monotonic)

            def one_step(sched=sched) -> int:
                out = sched.schedule()
                return len(sched.update(out, {seq: 1 for seq, _ in out.scheduled}))
        for i in range(running):
            prompt = [(7 * i + j) % 30000 + 100 for j in range(500)]
            params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
            sched.add(Sequence(f"r{r}-{i}", prompt, params, 0.0))
        one_step()  # the prefills
        start = time.perf_counter()
        for _ in range(steps):
            assert one_step() == running
        samples.append((time.perf_counter() - start) / steps * 1e6)
    return {"running": running, "us_per_step": round(min(samples), 1), "us_per_seq": round(min(samples) / running, 2)}


def measure_tree(tree: Path, args: argparse.Namespace) -> dict:
    """``measure`` run by this script's code on the source tree at ``tree``."""
    out = subprocess.run([sys.executable, __file__, "--json", "--running", str(args.running), "--steps", str(args.steps),
                          "--repeats", str(args.repeats)], cwd=tree, check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree)})
    return json.loads(out.stdout)


def instructions_per_step(tree: Path, args: argparse.Namespace) -> float:
    """Instructions of one step, counted by callgrind: the difference between runs of
    ``steps`` and ``3 * steps`` steps, so start-up and prefills cancel out. Counts do
    not depend on what else the machine is doing."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "memserve")], check=True)  # not counted
    counts = []
    for steps in (args.steps, 3 * args.steps):
        out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
                              "--json", "--running", str(args.running), "--steps", str(steps), "--repeats", "1"],
                             cwd=tree, check=True, capture_output=True, text=True,
                             env={"PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"})
        counts.append(int(re.search(r"Collected : (\d+)", out.stderr).group(1)))
    return (counts[1] - counts[0]) / (2 * args.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="alternate baseline and this tree this many times")
    p.add_argument("--baseline", help="git revision to measure the same way in this run")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON only")
    p.add_argument("--callgrind", action="store_true",
                   help="count instructions per step with valgrind instead of timing (immune to a busy machine)")
    args = p.parse_args()
    if args.json:
        print(json.dumps(measure(args.running, args.steps, args.repeats)))
        return
    trees = {"this tree": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            trees[args.baseline] = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(trees[args.baseline]),
                            args.baseline], check=True, capture_output=True)
        try:
            if args.callgrind:
                counts = {name: instructions_per_step(tree, args) for name, tree in trees.items()}
                for name, n in counts.items():
                    print(f"{name}: {n / 1e6:.2f} M instructions per step with {args.running} running")
                if args.baseline:
                    print(f"baseline / this tree = {counts[args.baseline] / counts['this tree']:.2f}x")
                return
            # Alternating rounds and the best of each side: a busy neighbour slows both alike.
            runs: dict[str, list[dict]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(measure_tree(tree, args))
            best = {name: min(ms, key=lambda m: m["us_per_step"]) for name, ms in runs.items()}
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees[args.baseline])],
                               check=True)
    for name, m in best.items():
        print(f"{name}: {m['us_per_step']} us per step with {args.running} running ({m['us_per_seq']} us/seq)")
    if args.baseline:
        ratio = best[args.baseline]["us_per_step"] / best["this tree"]["us_per_step"]
        print(f"baseline / this tree = {ratio:.2f}x")


if __name__ == "__main__":
    main()
