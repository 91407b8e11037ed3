"""Step time while saving KV down the tiers: synchronous vs asynchronous (AttentionStore
Fig. 20 shape), on the real engine and model, one run.

For each prompt length, requests of that many (random) tokens decode 20 tokens each,
two at a time, over a device pool that holds about two of them: every admission needs
the KV of a finished request out of the way, and that KV cascades device -> host ->
disk (a host tier of the same size, a disk tier in a temporary directory). Synchronous
saving (``async_save=False``) demotes inside ``alloc_mem``, on the step's critical path;
asynchronous saving starts the copies after each step on a background thread and
allocates only what is free. Prints mean and P90 step time, the time the step's thread
spent in the MemPool's allocation and save calls (where synchronous saving copies), the
total time and the bytes saved per mode; ``--plot`` writes the figure.

    python benchmarks/micro/async_save.py [--lengths 256,512,1024] [--requests 8] [--plot out.png]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

import numpy as np

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.real_engine import build_engine

DECODE_TOKENS = 20
CONCURRENT = 2


def time_calls(obj, names: tuple[str, ...]) -> list[float]:
    """Wrap ``obj``'s methods ``names`` to add their wall time (outermost calls only) to
    the returned one-element list."""
    spent = [0.0]
    depth = [0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - started
        return wrapper

    for name in names:
        setattr(obj, name, timed(getattr(obj, name)))
    return spent


def run(length: int, num_requests: int, async_save: bool, seed: int) -> dict:
    blocks_per_request = -(-(length + DECODE_TOKENS) // 16)
    with tempfile.TemporaryDirectory() as disk_dir:
        cfg = EngineConfig(dtype="float32", num_blocks=CONCURRENT * blocks_per_request + 2,
                           num_host_blocks=blocks_per_request, disk_cache_dir=disk_dir, disk_cache_gb=4.0,
                           max_num_seqs=CONCURRENT, max_num_batched_tokens=max(2048, length), async_save=async_save)
        engine = build_engine(cfg, ensure_model_dir(None))
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        for i in range(num_requests):
            prompt = [rng.randrange(1, engine.runner.vocab_size) for _ in range(length)]
            engine.add_request(AddRequest(f"r{i}", prompt, params))
        in_step = time_calls(engine.mempool, ("alloc_mem", "poll_saves", "kick_saves"))
        steps: list[float] = []
        started = time.perf_counter()
        while engine.scheduler.has_work:
            t0 = time.perf_counter()
            if engine.step():
                steps.append(time.perf_counter() - t0)
        total = time.perf_counter() - started
        engine.mempool.flush_saves()
        io = engine.mempool.stats()["tier_io"]
        engine.close()
    return {"mean_step_ms": 1e3 * float(np.mean(steps)), "p90_step_ms": 1e3 * float(np.percentile(steps, 90)),
            "save_ms_per_step": 1e3 * in_step[0] / len(steps), "total_s": total,
            "saved_mb": (io["host"]["write_bytes"] + io["disk"]["write_bytes"]) / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,512,1024", help="prompt lengths (tokens), comma-separated")
    p.add_argument("--requests", type=int, default=8, help="requests per length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the figure (PNG) here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    print(f"{'prompt':>7} {'mode':>6} {'mean step ms':>13} {'p90 step ms':>12} {'in-step save ms':>16} "
          f"{'total s':>8} {'saved MiB':>10}")
    for length in lengths:
        for mode in ("sync", "async"):
            r = run(length, args.requests, mode == "async", args.seed)
            results[mode].append(r)
            print(f"{length:>7} {mode:>6} {r['mean_step_ms']:>13.1f} {r['p90_step_ms']:>12.1f} "
                  f"{r['save_ms_per_step']:>16.2f} {r['total_s']:>8.2f} {r['saved_mb']:>10.0f}", flush=True)
        s, a = results["sync"][-1], results["async"][-1]
        print(f"{length:>7} async/sync: mean step {a['mean_step_ms'] / s['mean_step_ms']:.2f}, "
              f"total {a['total_s'] / s['total_s']:.2f}", flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = np.arange(len(lengths))
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, key, label in zip(axes, ("mean_step_ms", "save_ms_per_step"),
                                  ("mean step time (ms)", "save time on the step's thread (ms/step)")):
            for i, mode in enumerate(("sync", "async")):
                ax.bar(x + (i - 0.5) * 0.38, [r[key] for r in results[mode]], 0.38, label=f"{mode} saving")
            ax.set_xticks(x, [str(n) for n in lengths])
            ax.set_xlabel("prompt tokens (20 decode steps each)")
            ax.set_ylabel(label)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"figure: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
