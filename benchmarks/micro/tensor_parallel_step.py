"""What splitting a model over tensor-parallel ranks costs on this CPU: prefill and decode
step times of the real engine at one rank (with every thread) against N ranks (the
threads shared out, one rank process per share), and the all-reduce a step pays per
layer, measured alone over gloo.

    python benchmarks/micro/tensor_parallel_step.py [--model DIR] [--tp 2] [--threads 2]

Without ``--model``: the Qwen2.5-0.5B shape with random weights (benchmarks/peers/
random_model.py; 14 query heads over 2 KV heads, so two ranks hold 7 and 1). Each
configuration runs in a process of its own, one after the other; the ratios compare
them within the run. Prints one JSON line per configuration, then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN_ROWS = (1, 8, 512)  # all-reduce sizes: a decode row, a decode batch, a prefill chunk


def _engine_times(spec: dict) -> dict:
    """Child: (median) cold prefill and decode step times of one engine."""
    from memserve.workers.cpu_threads import pin_compute_threads

    pin_compute_threads(None, spec["threads"])
    import random

    from memserve.config import EngineConfig
    from memserve.ipc.messages import AddRequest, SamplingParams
    from memserve.workers.real_engine import build_engine

    cfg = EngineConfig(model=spec["model"], dtype="float32", num_blocks=512, max_num_seqs=64,
                       max_num_batched_tokens=4096, tensor_parallel_size=spec["tp"])
    engine = build_engine(cfg, Path(spec["model"]), 0)
    rng = random.Random(0)
    vocab = engine.runner.vocab_size

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def timed_step() -> float:
        started = time.perf_counter()
        engine.step()
        return time.perf_counter() - started

    prefill = []
    for i in range(spec["reps"] + 1):  # the first warms up
        engine.add_request(AddRequest(f"p{i}", fresh(spec["prefill"]), SamplingParams(max_tokens=1, ignore_eos=True)))
        prefill.append(timed_step())
        while engine.has_work:
            engine.step()
    out = {"tp": spec["tp"], "threads": spec["threads"], "prefill_ms": 1000 * statistics.median(prefill[1:])}
    for batch in spec["batches"]:
        for i in range(batch):
            engine.add_request(AddRequest(f"d{batch}-{i}", fresh(16), SamplingParams(max_tokens=10_000, ignore_eos=True)))
        for _ in range(3):
            engine.step()  # the prefills, and a decode to warm up
        comm = engine.runner.tp.comm_seconds
        steps = [timed_step() for _ in range(spec["reps"] * 4)]
        out[f"decode_x{batch}_ms"] = 1000 * statistics.median(steps)
        out[f"decode_x{batch}_comm_ms"] = 1000 * (engine.runner.tp.comm_seconds - comm) / len(steps)
        for i in range(batch):
            engine.abort(f"d{batch}-{i}")
        while engine.has_work:
            engine.step()
    return out


def _all_reduce_rank(rank: int, size: int, port: int, hidden: int, out: str) -> None:
    """Child of ``_all_reduce_times``: one rank timing all-reduces of each size."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    times = {}
    for rows in HIDDEN_ROWS:
        x = torch.randn(rows, hidden)
        for _ in range(10):
            dist.all_reduce(x)
        reps = []
        for _ in range(200):
            started = time.perf_counter()
            dist.all_reduce(x)
            reps.append(time.perf_counter() - started)
        times[f"all_reduce_{rows}x{hidden}_us"] = 1e6 * statistics.median(reps)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _all_reduce_times(size: int, hidden: int) -> dict:
    import torch.multiprocessing as mp

    from memserve.workers.tensor_parallel_group import free_port

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_all_reduce_rank, args=(size, free_port(), hidden, f.name), nprocs=size)
        return json.loads(Path(f.name).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a model folder (default: the Qwen2.5-0.5B shape, random weights)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads of the one-rank run, shared out among the ranks")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_engine_times(json.loads(args.child))))
        return 0
    model = args.model or Path(tempfile.gettempdir()) / "memserve-qwen2.5-0.5b-random"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).parents[1] / "peers" / "random_model.py"),
                        "qwen2.5-0.5b", str(model)], check=True)
    batches = [int(b) for b in args.batches.split(",")]
    runs = []
    for tp, threads in ((1, args.threads), (args.tp, max(1, args.threads // args.tp))):
        spec = {"model": str(model), "tp": tp, "threads": threads, "prefill": args.prefill, "batches": batches,
                "reps": args.reps}
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                              check=True, env=env)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    print(json.dumps({"tp": args.tp, **_all_reduce_times(args.tp, hidden)}))
    one, split = runs
    print(json.dumps({f"tp{args.tp}/tp1 {key}": round(split[key] / one[key], 3)
                      for key in one if key.endswith("_ms") and "comm" not in key}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
