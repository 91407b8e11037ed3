"""Scheduler overhead per engine step with N running sequences, against a baseline revision.

The engine runs over the simulator's runner, which computes nothing, so what a step
costs here is the engine's own Python: scheduling, the KV cache manager, MemPool and
the bookkeeping of results. The baseline is the same measurement run on another git
revision (checked out into a temporary worktree) in the same run, so the ratio compares
like with like on a noisy machine.

    python benchmarks/scheduler_overhead.py --baseline 65c2e5e --running 64
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(running: int, steps: int, repeats: int) -> dict:
    """Median microseconds of one decode step with ``running`` sequences (runner excluded)."""
    from memserve.config import EngineConfig
    from memserve.gateway.cost_model import CostModel
    from memserve.ipc.messages import AddRequest, SamplingParams
    from memserve.sim.runner import SimulatedRunner
    from memserve.workers.engine import Engine

    logging.disable(logging.WARNING)  # the engine says the pool caps the context: expected here
    cost = CostModel.load("llama2-13b-h800")
    samples = []
    for r in range(repeats):
        now = [0.0]
        cfg = EngineConfig(num_blocks=running * (600 + steps) // 16, max_num_seqs=running, max_num_batched_tokens=running * 512)
        runner = SimulatedRunner(cost, cfg.num_blocks, cfg.block_size, 1 << 20, lambda: now[0])
        engine = Engine(cfg, runner, set(), 0, lambda: now[0])
        for i in range(running):
            prompt = [(7 * i + j) % 30000 + 100 for j in range(500)]
            engine.add_request(AddRequest(f"r{r}-{i}", prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                                            ignore_eos=True)), 0.0)
        engine.step()  # the prefills
        in_runner = 0.0
        execute = runner.execute

        def timed_execute(plan, _execute=execute):  # noqa: ANN001, ANN202
            nonlocal in_runner
            t = time.perf_counter()
            out = _execute(plan)
            in_runner += time.perf_counter() - t
            return out

        runner.execute = timed_execute  # type: ignore[method-assign]
        start = time.perf_counter()
        for _ in range(steps):
            assert len(engine.step()) == running
        samples.append((time.perf_counter() - start - in_runner) / steps * 1e6)
    return {"running": running, "us_per_step": round(statistics.median(samples), 1),
            "us_per_seq": round(statistics.median(samples) / running, 2)}


def measure_at(rev: str, args: argparse.Namespace) -> dict:
    """``measure`` run by this script's code on the tree of ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            out = subprocess.run([sys.executable, __file__, "--json", "--running", str(args.running),
                                  "--steps", str(args.steps), "--repeats", str(args.repeats)],
                                 cwd=tree, check=True, capture_output=True, text=True, env={"PYTHONPATH": str(tree)})
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
        return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", help="git revision to measure the same way in this run")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON only")
    args = p.parse_args()
    if args.json:
        print(json.dumps(measure(args.running, args.steps, args.repeats)))
        return
    base = measure_at(args.baseline, args) if args.baseline else None
    now = measure(args.running, args.steps, args.repeats)
    print(f"this tree: {now['us_per_step']} us per step with {args.running} running ({now['us_per_seq']} us/seq)")
    if base:
        print(f"{args.baseline}: {base['us_per_step']} us per step ({base['us_per_seq']} us/seq); "
              f"ratio baseline/this = {base['us_per_step'] / now['us_per_step']:.2f}x")


if __name__ == "__main__":
    main()
