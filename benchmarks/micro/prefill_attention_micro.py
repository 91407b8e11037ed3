"""Prefill attention on this CPU: torch's SDPA against the blocked path
(``attention._blocked_prefill``: query blocks, both products through oneDNN; which of the
two a server runs, ``prefill_probe`` measures at start), and the GEMM engines under
both, as ratios measured in one run. A chunk after a cached prefix is timed through SDPA
twice: with the bottom-right mask, and as SDPA plans run it (``PrefillSequence.prefix_path``:
padded or split, where either is faster than the mask).

Each case is one prefill chunk of ``new`` tokens after ``cached`` tokens already in the
paged cache (SmolLM2-135M's shape: 9 query heads, 3 KV heads, head dim 64), attended
through ``paged_attention`` for ``--layers`` layers (the block gather included). Calls
are taken in turns and the best of ``--reps`` kept, so that a busy moment on a shared
machine hits both alike. ``--gemm`` first prints float32 GEMM GFLOP/s of torch's matmul
(MKL) and of oneDNN's linear at attention-like shapes: on AMD CPUs MKL runs its AVX2
path, which is why the blocked path calls oneDNN directly.

    python benchmarks/micro/prefill_attention_micro.py [--cases 2048+0,512+1536,256+1024]
        [--dtypes float32,bfloat16] [--threads 1] [--reps 5] [--gemm]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from memserve.workers.model import attention
from memserve.workers.model.attention import (
    AttentionMetadata,
    AttentionPlan,
    allocate_kv_cache,
    layer_kv,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 9, 3, 64, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="2048+0,1024+0,512+1536,256+1024,64+448",
                   help="NEW+CACHED tokens per prefill chunk, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--layers", type=int, default=30, help="attention calls per step")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gemm", action="store_true", help="also time MKL against oneDNN GEMMs")
    return p.parse_args()


def best_in_turns(fns: list, reps: int) -> list[float]:
    """The best time of each function, calling them in turns."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [min(t) for t in times]


def gemm_rates(reps: int) -> None:
    print("float32 GEMM GFLOP/s  (m x k) @ (k x n): torch matmul (MKL) | oneDNN linear")
    for m, k, n in ((384, 64, 2048), (64, 2048, 384), (1024, 1024, 1024)):
        a, w = torch.randn(m, k), torch.randn(n, k)
        flops = 2 * m * k * n
        mkl, onednn = best_in_turns([lambda: a @ w.t(), lambda: attention._onednn_linear(a, w)], reps)
        print(f"  {m:5d} x {k:5d} x {n:5d}: {flops / mkl / 1e9:6.0f} | {flops / onednn / 1e9:6.0f}")


def prefill_plans(new: int, cached: int, dtype: torch.dtype) -> tuple:
    """The cache, q/k/v of the chunk and the plans (SDPA as planned, SDPA with the mask,
    blocked) for one case."""
    gen = torch.Generator().manual_seed(0)
    context = new + cached
    blocks = -(-context // BLOCK_SIZE)
    cache = allocate_kv_cache(blocks + 1, 2, BLOCK_SIZE, KV_HEADS, DIM, dtype, "cpu")
    cache.normal_(generator=gen)
    table = torch.randperm(blocks, generator=gen).add(1)
    slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, context)])
    meta = AttentionMetadata(slots, [0, new], [context], table[None], BLOCK_SIZE)
    blocked = AttentionPlan.build(meta, torch.device("cpu"))
    sdpa_prefill = attention._plan_prefill(slice(0, new), table, context, BLOCK_SIZE, torch.device("cpu"), False)
    sdpa = dataclasses.replace(blocked, prefills=[sdpa_prefill], blocked_prefill=False, _buffers={})
    masked = sdpa
    if sdpa_prefill.prefix_path:
        seen = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None]
        masked_prefill = dataclasses.replace(sdpa_prefill, causal_mask=seen[None, None], prefix_path="")
        masked = dataclasses.replace(sdpa, prefills=[masked_prefill], _buffers={})
    qkv = [torch.randn(new, h, DIM, generator=gen).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
    return cache, qkv, sdpa, masked, blocked


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.gemm:
        gemm_rates(args.reps)
    print(f"prefill attention, {args.layers} layers, {args.threads} thread(s), best of {args.reps}")
    print(f"{'dtype':9s} {'new':>5s} {'cached':>6s} {'masked ms':>9s} {'SDPA ms':>8s} {'vs masked':>9s} "
          f"{'blocked ms':>10s} {'SDPA/blocked':>12s} {'max diff':>9s}")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for case in args.cases.split(","):
            new, cached = (int(x) for x in case.split("+"))
            cache, (q, k, v), sdpa, masked, blocked = prefill_plans(new, cached, dtype)
            kc, vc = layer_kv(cache, 1, "aggregated")
            outputs = {}

            def step(plan: AttentionPlan, name: str) -> None:
                for _ in range(args.layers):
                    outputs[name] = paged_attention(q, k, v, kc, vc, plan, DIM**-0.5)

            t_masked, t_sdpa, t_blocked = best_in_turns(
                [lambda: step(masked, "masked"), lambda: step(sdpa, "sdpa"), lambda: step(blocked, "blocked")],
                args.reps)
            diff = max((outputs[name].float() - outputs["blocked"].float()).abs().max().item()
                       for name in ("sdpa", "masked"))
            print(f"{str(dtype)[6:]:9s} {new:5d} {cached:6d} {t_masked * 1e3:9.1f} {t_sdpa * 1e3:8.1f} "
                  f"{t_masked / t_sdpa:8.2f}x {t_blocked * 1e3:10.1f} {t_sdpa / t_blocked:11.2f}x {diff:9.1e}")


if __name__ == "__main__":
    main()
