"""Decode step time on a GPU: CUDA graphs against eager steps, one run.

Runs ``ModelRunner.execute`` in-process over hand-built decode plans (``--context`` tokens
per sequence on average, spread over [context/2, 3*context/2] as in serving) for each
batch size, with the runner's decode graphs and with the same runner eager (its graphs
set aside), interleaved. Prints the graphs' capture time and count, the median step time
of each side (sampling included: every step ends with a sync) and the speedup. On a CPU
(``--device cpu``) both sides are eager: that checks the script, not the speed.

    python benchmarks/micro/decode_graphs.py [--model DIR] [--dtype bfloat16] [--batches 1,8,32,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_step_profile import PlanMaker

from memserve.config import EngineConfig
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model_runner import ModelRunner


def contexts(mean: int, batch: int) -> list[int]:
    if batch == 1:
        return [mean]
    return [mean // 2 + i * mean // (batch - 1) for i in range(batch)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    import torch

    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(3 * args.context // 2 + 1) // 16)
    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_blocks=2 + max(batches) * per_seq,
                       max_num_seqs=max(batches), async_save=False)
    start = time.perf_counter()
    runner = ModelRunner(cfg, ensure_model_dir(args.model))
    graphs = runner.graphs
    print(f"runner ready in {time.perf_counter() - start:.1f} s; "
          f"{graphs.num_graphs if graphs else 0} decode graphs; device {args.device}, {args.dtype}")
    maker = PlanMaker(runner.num_blocks, 16, runner.vocab_size)
    print(f"{'batch':>6}{'eager ms':>10}{'graph ms':>10}{'speedup':>9}")
    speedups = []
    for batch in batches:
        plan = maker.plan([maker.chunk(ctx, 1) for ctx in contexts(args.context, batch)])
        runner.execute(plan)  # registers the requests
        plan.new_requests = []
        times: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(args.reps + 2):
            for use_graphs in (False, True):
                runner.graphs = graphs if use_graphs else None
                begin = time.perf_counter()
                runner.execute(plan)
                if rep >= 2:  # the first two of each side warm up
                    times[use_graphs].append(time.perf_counter() - begin)
        eager, graph = statistics.median(times[False]), statistics.median(times[True])
        speedups.append(eager / graph)
        print(f"{batch:>6}{eager * 1e3:>10.2f}{graph * 1e3:>10.2f}{eager / graph:>8.2f}x")
    runner.graphs = graphs
    if torch.cuda.is_available():
        print(f"GPU memory reserved: {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    print("summary: decode speedup " + ", ".join(f"x{b} {s:.2f}" for b, s in zip(batches, speedups)))


if __name__ == "__main__":
    main()
