"""Layer-wise preloading (AttentionStore Fig. 19 shape) on the real engine and model, one run.

A conversation's history of ``--history`` tokens sits in the host tier; its next turn adds
``--new`` tokens. Its prefill time (TTFT: request added -> first token, one token asked,
nothing else running) is measured with

- NO-PL: ``--layerwise-preload off``: the whole history is copied, then the prefill runs;
- PL-B0: preloading without a buffer: the copy starts with the request's step, one layer
  ahead of the compute;
- PL-B<N>: preloading with a read buffer of N layers (``--preload-buffer-layers``), and
  PL-auto, the buffer §3.2's formula gives from the measured rates;

plus the pure load time (the history's host->device copy alone, as NO-PL does it) and the
pure compute time (the same prefill with the history already on the device). Prints the
medians over ``--reps`` interleaved repetitions and "% of load time hidden" =
(NO-PL - PL) / load time (the median of the per-repetition ratios), and, as a check that
does not depend on run-to-run noise, the share of the load time the step did not spend
waiting in ``before_layer``.

    python benchmarks/micro/layerwise_preload.py [--history 1024] [--new 100] [--reps 9] [--buffers 0,4,30]
        [--model DIR] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.engine.engine import Engine
from memserve.workers.layer_preload import AUTO
from memserve.workers.real_engine import build_engine


def ttft(engine: Engine, rid: str, prompt: list[int]) -> float:
    """Seconds from adding the request to its first token, stepping the engine alone."""
    engine.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    start = time.perf_counter()
    first = None
    while engine.has_work:
        steps = engine.num_steps
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
        if engine.num_steps == steps:
            time.sleep(0.0002)  # waiting for a copy: leave the CPU to it
    assert first is not None
    return first


def to_host(engine: Engine) -> None:
    """Move every cached device block to the host tier (the history is 'older')."""
    engine.mempool.flush_saves()
    engine.mempool.swap_out(engine.mempool.stats()["device"]["total"])


def pure_load_s(engine: Engine, history: list[int]) -> float:
    """The history's host->device copy alone, as NO-PL's load does it."""
    addrs = engine.mempool.match(history, take_ref=True)
    assert len(addrs) == len(history) // 16 and {addr_tier(a) for a in addrs} == {Tier.HOST}
    dst = engine.mempool.alloc_mem(len(addrs))
    start = time.perf_counter()
    engine.runner.mover.copy_blocks(Tier.HOST, [addr_block(a) for a in addrs], Tier.DEVICE,
                                    [addr_block(a) for a in dst])
    if engine.cfg.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()  # the copy into the device is asynchronous
    took = time.perf_counter() - start
    engine.mempool.free_mem(dst + addrs)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--new", type=int, default=100)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--buffers", default="0,4,30", help="read buffer depths (layers) to measure, and auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    history_blocks = -(-(args.history + args.new + 1) // 16)
    cfg = EngineConfig(dtype=args.dtype, device=args.device, num_blocks=history_blocks + 8, num_host_blocks=history_blocks * (args.reps + 2) * 4,
                       max_num_batched_tokens=args.history + args.new + 16, max_model_len=args.history + args.new + 16)
    engine = build_engine(cfg, ensure_model_dir(args.model))
    pre = engine.runner.preloader
    num_layers = pre.num_layers
    rng = random.Random(args.seed)
    vocab = engine.runner.vocab_size
    history = [rng.randrange(1, vocab) for _ in range(args.history)]
    ttft(engine, "history", history)  # cache it (and warm the model up)
    buffers = [int(b) for b in args.buffers.split(",") if b] + [AUTO]
    modes = [("NO-PL", False, 0)] + [(f"PL-B{b}" if b != AUTO else "PL-auto", True, b) for b in buffers]
    times: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    waits: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    loads: list[float] = []
    computes: list[float] = []
    autos: list[int] = []
    for rep in range(args.reps):
        computes.append(ttft(engine, f"compute-{rep}", history + [rng.randrange(1, vocab) for _ in range(args.new)]))
        to_host(engine)
        loads.append(pure_load_s(engine, history))
        for name, layerwise, ahead in modes:
            to_host(engine)
            pre.layerwise, pre.ahead = layerwise, ahead
            waited = pre.stats.wait_s
            times[name].append(ttft(engine, f"{name}-{rep}", history + [rng.randrange(1, vocab) for _ in range(args.new)]))
            waits[name].append(pre.stats.wait_s - waited)
            if ahead == AUTO:
                autos.append(pre.stats.ahead[-1])
    load, compute = statistics.median(loads), statistics.median(computes)
    no_pl = statistics.median(times["NO-PL"])
    print(f"history {args.history} tokens in the host tier + {args.new} new tokens; {num_layers} layers; "
          f"median of {args.reps} interleaved reps")
    print(f"pure load (host->device copy)   {load * 1e3:8.1f} ms")
    print(f"pure compute (prefill, on dev.) {compute * 1e3:8.1f} ms")
    print(f"{'mode':<10}{'TTFT ms':>10}{'vs NO-PL':>10}{'% load hidden':>15}{'waited ms':>11}{'% hidden (waits)':>18}")
    for name, _, _ in modes:
        t, w = statistics.median(times[name]), statistics.median(waits[name])
        # paired within each repetition (NO-PL ran just before), so slow drift cancels
        paired = statistics.median((n - p) / ld for n, p, ld in zip(times["NO-PL"], times[name], loads))
        hidden = "" if name == "NO-PL" else f"{100 * paired:.0f}%"
        by_wait = "" if name == "NO-PL" else f"{100 * (1 - w / load):.0f}%"
        print(f"{name:<10}{t * 1e3:>10.1f}{t / no_pl:>10.2f}{hidden:>15}{w * 1e3:>11.2f}{by_wait:>18}")
    print(f"PL-auto's buffer (per load: §3.2's formula and the measured hand-off costs): {autos} layers")
    best = min((statistics.median(times[name]), name) for name, _, _ in modes[1:])
    print(f"summary: TTFT NO-PL {no_pl * 1e3:.1f} ms, best {best[1]} {best[0] * 1e3:.1f} ms, "
          f"load {load * 1e3:.1f} ms, compute {compute * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
