"""Decode attention over the paged KV cache on this CPU: the grouped gather of the
first paged decode path, what ships now, and paths that read the blocks in place, as ratios measured in
one run (speed-ups are over the first method named).

Candidates, each attending B single-token queries to B contexts held in scattered
16-token blocks (SmolLM2-135M's shape: 9 query heads, 3 KV heads, head dim 64):

- ``gather``: the first paged decode path (``index_select`` the group's blocks into a
  padded dense buffer, then one SDPA call with ``enable_gqa``; bf16 upcast to float32
  first), kept here as the reference;
- ``fold``: ``attention.paged_attention`` with chunking off: the same gather, GQA folded
  into the query length (the 3 heads of a KV head are its 3 query rows), bf16 attended
  in bf16;
- ``loop-N``: ``paged_attention`` with every group chunked, N block columns at a time: no
  padded context ever exists; each chunk is gathered (a small, cache-resident copy),
  attended by torch's CPU flash kernel with its log-sum-exp, and merged into the output
  (flash-decoding); ``loop-1`` is the one-block-column-at-a-time loop;
- ``shipped``: ``paged_attention`` as shipped (chunks of ``DECODE_CHUNK_BLOCKS`` for groups
  of at least ``DECODE_CHUNK_MIN_TOKENS`` context tokens, else ``fold``);
- ``flex``: ``flex_attention`` compiled by inductor for CPU, the cache viewed in place as one
  long key sequence and each sequence's block table given as the BlockMask's KV block
  indices (full blocks unmasked, the last one masked by position); the mask is built once
  per step. Its compile time per batch size is printed too (a new batch size recompiles);
- ``kernel``: the compiled decode kernel alone (``cpu_kernels.paged_decode_attention``), no
  KV write or plan.

A "step" runs ``--layers`` attention calls (the model's 30 layers), cycling over the
cache's ``--cache-layers`` layers, after building the per-step plan once. The default 2
keep the cache small; the per-layer views keep their real strides. ``--cache-layers 30``
reads every layer's K and V from memory as a model does, not from the last-level cache.
Calls are taken in turns and the best of ``--reps`` kept, so that a busy moment on a
shared machine hits all alike.

``--kernel-libs OLD.so,NEW.so`` times the ``kernel`` method of builds of the kernels
(``~/.cache/memserve/kernels/<hash>/*.so``, e.g. one kept from before a change): each in
its own process (a library registers the op's name once per process), the processes
taking one step each in turn; its rate also as GB/s of K and V read, beside the machine's
copy bandwidth for scale.

    python benchmarks/micro/paged_attention_micro.py [--batches 1,8,32] [--contexts 256,1024,2048]
        [--dtypes float32,bfloat16] [--methods gather,fold,shipped,loop-1,loop-16,flex,kernel] [--reps 5]
    python benchmarks/micro/paged_attention_micro.py --kernel-libs old.so,new.so --cache-layers 30
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from engine_step_profile import memory_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from memserve.workers.model import attention, cpu_kernels
from memserve.workers.model.attention import (
    AttentionMetadata,
    AttentionPlan,
    allocate_kv_cache,
    layer_kv,
    paged_attention,
    write_kv,
)

HEADS, KV_HEADS, DIM, BLOCK_SIZE, CACHE_LAYERS = 9, 3, 64, 16, 2
LAYOUT = "aggregated"  # --layout


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="256,1024,2048")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--methods", default="gather,fold,shipped,loop-16")
    p.add_argument("--layers", type=int, default=30, help="attention calls per step")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layout", default="aggregated", choices=["aggregated", "layer-major"])
    p.add_argument("--cache-layers", type=int, default=2, help="layers the cache holds (30: read from memory)")
    p.add_argument("--kernel-libs", default="", help="OLD.so,NEW.so: time these builds' kernel in turns")
    p.add_argument("--serve-kernel", default="", help=argparse.SUPPRESS)  # one side of --kernel-libs
    return p.parse_args()


class Case:
    """B decode rows of one context length over scattered blocks of a shared pool."""

    def __init__(self, cache: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> None:
        num_blocks = layer_kv(cache, 0, LAYOUT)[0].shape[0]
        per_seq = -(-context // BLOCK_SIZE)
        ids = torch.randperm(num_blocks - 1, generator=gen)[: batch * per_seq].add(1)
        self.tables = ids.view(batch, per_seq)
        self.lens = self.lengths(batch, context)
        slots = [int(self.tables[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                 for i, n in enumerate(self.lens)]
        self.meta = AttentionMetadata(torch.tensor(slots), list(range(batch + 1)), self.lens, self.tables,
                                      BLOCK_SIZE, LAYOUT)
        self.q = torch.randn(batch, HEADS, DIM, generator=gen).to(cache.dtype)
        self.k = torch.randn(batch, KV_HEADS, DIM, generator=gen).to(cache.dtype)
        self.v = torch.randn(batch, KV_HEADS, DIM, generator=gen).to(cache.dtype)

    @staticmethod
    def lengths(batch: int, context: int) -> list[int]:
        return [context - i % 7 for i in range(batch)]  # a few tokens apart: one group, partial blocks


# ------------------------------------------------------------------ the reference
def gather_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                     scale: float) -> torch.Tensor:
    """Decode attention as the first paged decode path computed it (one decode group)."""
    group = plan.decodes[0]
    queries = q[group.tokens].unsqueeze(2)
    keys = plan.gather(k_cache, group.block_tables, "decode-0-k")
    values = plan.gather(v_cache, group.block_tables, "decode-0-v")
    if q.dtype != torch.float32:
        queries = queries.float()
        keys, values = plan.to_float32(keys, "decode-0-k32"), plan.to_float32(values, "decode-0-v32")
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.key_mask, scale=scale,
                                              enable_gqa=True)
    return attended.squeeze(2).to(q.dtype)


# ------------------------------------------------------------------ flex_attention
class FlexPaged:
    """flex_attention over the cache in place. A layer's K (V) cache [num_blocks, bs, kv_heads,
    dim] has a block stride that is a multiple of one block; viewed as a strided
    [1, kv_heads, tokens, dim] sequence from that layer's offset, physical block b is key
    block b * mult, so a block table (scaled) is directly the BlockMask's index list."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.fn = torch.compile(flex_attention, dynamic=False)

    def mask(self, tables: torch.Tensor, lens: list[int], mult: int, num_tokens: int):
        from torch.nn.attention.flex_attention import BlockMask

        # at batch 1, inductor (torch 2.13) fails to compile the mask (it drops the captured
        # lengths from the kernel's inputs): pad with an empty row
        batch = max(tables.shape[0], 2)
        lens_t = torch.tensor(lens + [0] * (batch - len(lens)))
        full = (lens_t // BLOCK_SIZE).to(torch.int32)
        partial = (lens_t % BLOCK_SIZE > 0).to(torch.int32)
        # inductor's CPU kernel wants an index row as wide as the whole key sequence (the
        # whole cache, all layers) in blocks; being fixed, it also never recompiles
        width = num_tokens // BLOCK_SIZE
        full_idx = torch.zeros(batch, 1, 1, width, dtype=torch.int32)
        part_idx = torch.zeros(batch, 1, 1, width, dtype=torch.int32)
        scaled = (tables * mult).to(torch.int32)
        for i, n in enumerate(full.tolist()[: tables.shape[0]]):
            full_idx[i, 0, 0, :n] = scaled[i, :n]
            if partial[i]:
                part_idx[i, 0, 0, 0] = scaled[i, n]
        last_len = lens_t % BLOCK_SIZE
        last_block = part_idx[:, 0, 0, 0].long()

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx // BLOCK_SIZE != last_block[b]) | (kv_idx % BLOCK_SIZE < last_len[b])

        return BlockMask.from_kv_blocks(partial.view(batch, 1, 1), part_idx, full.view(batch, 1, 1), full_idx,
                                        BLOCK_SIZE=(1, BLOCK_SIZE), mask_mod=mask_mod,
                                        seq_lengths=(1, num_tokens), compute_q_blocks=False)

    @staticmethod
    def geometry(cache: torch.Tensor) -> tuple[int, int]:
        """(mult, tokens): key-block stride of one physical block, and a sequence length that
        every layer's view fits in."""
        k_cache = layer_kv(cache, 0, LAYOUT)[0]
        mult = k_cache.stride(0) // (BLOCK_SIZE * KV_HEADS * DIM)
        return mult, ((k_cache.shape[0] - 1) * mult + 1) * BLOCK_SIZE

    @staticmethod
    def view(kv: torch.Tensor, num_tokens: int, batch: int) -> torch.Tensor:
        seq = kv.as_strided((1, KV_HEADS, num_tokens, DIM), (0, DIM, KV_HEADS * DIM, 1), kv.storage_offset())
        return seq.expand(batch, -1, -1, -1)

    def __call__(self, q, k_cache, v_cache, block_mask, num_tokens, scale) -> torch.Tensor:
        rows = q.shape[0]
        if rows == 1:
            q = torch.cat([q, q])
        batch = q.shape[0]
        out = self.fn(q[:, :, None], self.view(k_cache, num_tokens, batch), self.view(v_cache, num_tokens, batch),
                      block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[:rows, :, 0]


# ------------------------------------------------------------------ timing
def step_fn(method: str, cache: torch.Tensor, case: Case, layers: int, flex: FlexPaged | None) -> Callable[[], torch.Tensor]:
    scale = DIM**-0.5
    views = [layer_kv(cache, i % CACHE_LAYERS, LAYOUT) for i in range(layers)]
    if method == "gather":
        def step():
            plan = AttentionPlan.build(case.meta, torch.device("cpu"))
            outs = []
            for kc, vc in views:
                write_kv(kc, vc, case.k, case.v, plan)
                outs.append(gather_attention(case.q, kc, vc, plan, scale))
            return outs
    elif method in ("fold", "shipped") or method.startswith("loop-"):
        shipped = (attention.DECODE_CHUNK_MIN_TOKENS, attention.DECODE_CHUNK_BLOCKS)
        if method == "fold":
            min_tokens, blocks = 1 << 62, shipped[1]
        elif method == "shipped":
            min_tokens, blocks = shipped
        else:
            min_tokens, blocks = 0, int(method.removeprefix("loop-"))

        def step():
            attention.DECODE_CHUNK_MIN_TOKENS, attention.DECODE_CHUNK_BLOCKS = min_tokens, blocks
            try:
                plan = AttentionPlan.build(case.meta, torch.device("cpu"))
                return [paged_attention(case.q, case.k, case.v, kc, vc, plan, scale) for kc, vc in views]
            finally:
                attention.DECODE_CHUNK_MIN_TOKENS, attention.DECODE_CHUNK_BLOCKS = shipped
    elif method == "kernel":
        lens = torch.tensor(case.lens)
        out = torch.empty_like(case.q)

        def step():
            for kc, vc in views:
                cpu_kernels.paged_decode_attention(out, case.q, kc, vc, case.tables, lens, scale)
            return [out]
    elif method == "flex":
        mult, num_tokens = FlexPaged.geometry(cache)

        def step():
            plan = AttentionPlan.build(case.meta, torch.device("cpu"))
            mask = flex.mask(case.tables, case.lens, mult, num_tokens)
            outs = []
            for kc, vc in views:
                write_kv(kc, vc, case.k, case.v, plan)
                outs.append(flex(case.q, kc, vc, mask, num_tokens, scale))
            return outs
    else:
        raise ValueError(method)
    return step


def kv_bytes(lens: list[int], dtype: torch.dtype) -> int:
    """Bytes of K and V one layer call must read: every context token's, once."""
    return sum(lens) * 2 * KV_HEADS * DIM * torch.finfo(dtype).bits // 8


def serve_kernel(args: argparse.Namespace) -> None:
    """One side of --kernel-libs: load that build, then time one kernel step per line
    "dtype batch context" read from stdin, answering its seconds."""
    torch.ops.load_library(args.serve_kernel)
    cache_dtype, cache, steps = "", None, {}
    for line in sys.stdin:
        dtype_name, batch, context = line.split()
        if dtype_name != cache_dtype:  # one dtype's cache at a time
            cache_dtype, cache, steps = dtype_name, None, {}
            cache = new_cache(args, getattr(torch, dtype_name), torch.Generator().manual_seed(0))
        if line not in steps:  # the same case on every side
            case = Case(cache, int(batch), int(context), torch.Generator().manual_seed(int(context)))
            steps[line] = step_fn("kernel", cache, case, args.layers, None)
            steps[line]()
        start = time.perf_counter()
        steps[line]()
        seconds = time.perf_counter() - start
        time.sleep(0.05)  # this side's OpenMP threads spin a while after a step: not into the other's
        print(seconds, flush=True)


def compare_kernels(args: argparse.Namespace) -> None:
    """ms per layer call and GB/s of K and V of each build in --kernel-libs, in turns."""
    libs = args.kernel_libs.split(",")
    argv = [sys.executable, __file__, "--layers", str(args.layers), "--threads", str(args.threads), "--layout",
            LAYOUT, "--cache-layers", str(CACHE_LAYERS), "--batches", args.batches, "--contexts", args.contexts]
    sides = [subprocess.Popen([*argv, "--serve-kernel", lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for lib in libs]
    print(f"copy bandwidth {memory_bandwidth() / 1e9:.1f} GB/s (read + write); ms per layer call, best of "
          f"{args.reps} steps of {args.layers}, and GB/s of K and V read; {CACHE_LAYERS} cache layers")
    print("| dtype | batch | context | K+V MB | " + " | ".join(f"{Path(lib).name} ms | GB/s" for lib in libs)
          + " | speed-up |")
    print("|" + " ---: |" * (4 + 2 * len(libs) + 1))
    for dtype_name in args.dtypes.split(","):
        for batch in [int(x) for x in args.batches.split(",")]:
            for context in [int(x) for x in args.contexts.split(",")]:
                best = [float("inf")] * len(libs)
                for _ in range(args.reps):
                    for i, side in enumerate(sides):
                        side.stdin.write(f"{dtype_name} {batch} {context}\n")
                        side.stdin.flush()
                        best[i] = min(best[i], float(side.stdout.readline()) / args.layers)
                nbytes = kv_bytes(Case.lengths(batch, context), getattr(torch, dtype_name))
                print(f"| {dtype_name} | {batch} | {context} | {nbytes / 1e6:.1f} | "
                      + " | ".join(f"{1e3 * t:.3f} | {nbytes / t / 1e9:.1f}" for t in best)
                      + f" | {best[0] / best[-1]:.2f}x |", flush=True)
    for side in sides:
        side.stdin.close()
        side.wait()


def new_cache(args: argparse.Namespace, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    num_blocks = 2 + max(int(x) for x in args.batches.split(",")) * -(-max(int(x) for x in args.contexts.split(","))
                                                                       // BLOCK_SIZE)
    cache = allocate_kv_cache(num_blocks, CACHE_LAYERS, BLOCK_SIZE, KV_HEADS, DIM, dtype, "cpu", LAYOUT)
    return cache.normal_(generator=gen)


def main() -> None:
    global LAYOUT, CACHE_LAYERS
    args = parse_args()
    LAYOUT, CACHE_LAYERS = args.layout, args.cache_layers
    torch.set_num_threads(args.threads)
    if args.serve_kernel:
        return serve_kernel(args)
    if args.kernel_libs:
        return compare_kernels(args)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    methods = args.methods.split(",")
    if "kernel" in methods and not cpu_kernels.available():
        sys.exit("the kernel method needs the CPU kernels, which do not build here")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); ms per layer call "
          f"(best of {args.reps} steps of {args.layers} calls) and speed-up vs {methods[0]} (>1 = faster)")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(0)
        cache = new_cache(args, dtype, gen)
        flex = FlexPaged() if "flex" in methods else None
        print(f"\n{dtype_name}\n| batch | context | " + " | ".join(methods) + " | "
              + " | ".join(f"{m} speed-up" for m in methods[1:]) + " |")
        print("|" + " ---: |" * (2 + 2 * len(methods) - 1))
        for batch in batches:
            for context in contexts:
                case = Case(cache, batch, context, gen)
                steps = {m: step_fn(m, cache, case, args.layers, flex) for m in methods}
                reference = steps["gather"]()[0].float() if "gather" in methods else None
                for m, fn in steps.items():
                    start = time.perf_counter()
                    out = fn()[0].float()
                    first = time.perf_counter() - start
                    if m == "flex" and first > 1.0:
                        print(f"  (flex first call at batch {batch}: {first:.1f} s, compile included)")
                    if reference is not None:
                        err = (out - reference).abs().max().item()
                        assert err < (1e-4 if dtype == torch.float32 else 3e-2), (m, err)
                best = {m: float("inf") for m in methods}
                for _ in range(args.reps):
                    for m, fn in steps.items():
                        start = time.perf_counter()
                        fn()
                        best[m] = min(best[m], time.perf_counter() - start)
                per_call = {m: 1e3 * t / args.layers for m, t in best.items()}
                base = best[methods[0]]
                print(f"| {batch} | {context} | " + " | ".join(f"{per_call[m]:.3f}" for m in methods) + " | "
                      + " | ".join(f"{base / best[m]:.2f}x" for m in methods[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
