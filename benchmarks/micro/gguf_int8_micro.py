"""The GGUF decode kernel (``csrc/gguf_linear.cpp``) with float32 activations against
integer products over activations in one int8 digit (llama.cpp's) or two, on the
default SmolLM2 file's own blocks.

    python benchmarks/micro/gguf_int8_micro.py [--rows 1,4,8,16] [--threads 1,2] [--reps 15]
    python benchmarks/micro/gguf_int8_micro.py --packed --rows 8,12,16 --threads 1  # WIDE_FROM_ROWS

Two workloads per row count and thread count: one gate/up layer (Q4_1, 3,072 x 576, its
1.1 MB of blocks in the L2 cache, where the kernel's arithmetic is what is timed) and every
quantized product of a decode step (the 30 layers' q/k/v, o, gate/up and down in Q4_1
and the tied Q8_0 lm_head: 96 MB, read from memory). Rounds alternate the paths, and
each ratio is the median of per-round ratios, so that a shared machine's load falls on
all alike. ``--packed`` instead times the gate/up layer's integer products (two digits)
against the same weight widened and oneDNN-packed in float32 and bf16, what
``--quantization auto`` multiplies chunks of more than ``WIDE_FROM_ROWS`` rows by.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model import cpu_kernels
from memserve.workers.model.gguf_linear import fused_blocks, read_blocks
from memserve.workers.model.packed_linear import PackedLinear

GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"


BITS = (32, 16, 8)  # float32, two int8 digits, one


def run(layers: list[tuple[torch.Tensor, int, int]], rows: int, bits: int, repeat: int) -> float:
    """Seconds for one of ``repeat`` passes over ``layers`` (blocks, ggml type, in_features)."""
    inputs = {k: torch.randn(rows, k) for _, _, k in layers}
    start = time.perf_counter()
    for _ in range(repeat):
        for blocks, ggml_type, k in layers:
            cpu_kernels.gguf_matmul(inputs[k], blocks, ggml_type, bits)
    return (time.perf_counter() - start) / repeat


def compare(layers: list[tuple[torch.Tensor, int, int]], rows: int, reps: int, repeat: int) -> list[str]:
    """Median times (us) of each of BITS over ``reps`` alternating rounds, and the median
    per-round ratios of the integer paths to float32."""
    times: dict[int, list[float]] = {bits: [] for bits in BITS}
    for bits in BITS:
        run(layers, rows, bits, 1)  # warm up
    for _ in range(reps):
        for bits in BITS:
            times[bits].append(run(layers, rows, bits, repeat))
    cells = [f"{statistics.median(times[bits]) * 1e6:,.0f}" for bits in BITS]
    for bits in BITS[1:]:
        cells.append(f"**{statistics.median(i / f for i, f in zip(times[bits], times[32])):.2f}x**")
    return cells


def against_packed(blocks: torch.Tensor, ggml_type: int, k: int, rows_list: list[int], reps: int) -> None:
    """The blocks' products (two int8 digits) against the packed widened weight, per dtype."""
    print("| dtype | rows | blocks us | packed us | blocks / packed |\n| --- | ---: | ---: | ---: | ---: |")
    for dtype in (torch.float32, torch.bfloat16):
        weight = cpu_kernels.gguf_dequantize(blocks, ggml_type, k, dtype)
        packed = PackedLinear(torch.nn.Parameter(weight, requires_grad=False), None)
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)
            paths = {"blocks": lambda: cpu_kernels.gguf_matmul(x.float(), blocks, ggml_type, 16).to(dtype),
                     "packed": lambda: packed(x)}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(reps):
                for name, path in paths.items():
                    path()
                    start = time.perf_counter()
                    for _ in range(100):
                        path()
                    times[name].append((time.perf_counter() - start) / 100)
            ratio = statistics.median(b / p for b, p in zip(times["blocks"], times["packed"]))
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {statistics.median(times['blocks']) * 1e6:,.0f} | "
                  f"{statistics.median(times['packed']) * 1e6:,.0f} | **{ratio:.2f}x** |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--packed", action="store_true", help="the gate/up layer against its packed widened weight")
    args = p.parse_args()
    if not cpu_kernels.available() or not cpu_kernels.gguf_int8_types():
        raise SystemExit("the CPU kernels have no int8 path here (they need AVX-512 VNNI)")
    blocks, types = fused_blocks(*read_blocks(ensure_model_dir(None)))
    widths = {name: b.shape[1] // {2: 18, 3: 20, 8: 34}[types[name]] * 32 for name, b in blocks.items()}
    step = [(b, types[name], widths[name]) for name, b in blocks.items()]
    if args.packed:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        return against_packed(blocks[GATE_UP], types[GATE_UP], widths[GATE_UP], list(map(int, args.rows.split(","))),
                              args.reps)
    workloads = {"gate/up 3072x576 (Q4_1, in cache)": ([(blocks[GATE_UP], types[GATE_UP], widths[GATE_UP])], 200),
                 "decode step's products (96 MB)": (step, 1)}
    print("| workload | threads | rows | float32 us | 2 x int8 us | int8 us | 2 x int8 / float32 | int8 / float32 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, (layers, repeat) in workloads.items():
            for rows in map(int, args.rows.split(",")):
                cells = compare(layers, rows, args.reps, repeat)
                print(f"| {name} | {threads} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
