"""A model's decode steps and a long prefill against what the device allows, in one run.

A model of ``--shape`` (default Llama-3-8B's: 32 layers, hidden 4096, 32 query heads over
8 KV heads, FFN 14336, vocabulary 128256) is built from its config.json alone with
``--load-format dummy`` (random weights on the device: no 16 GB of files to read), once
per ``--backends`` entry (``--attention-backend``), and timed through
``ModelRunner.execute`` as the engine runs it (CUDA graphs where the runner captures them):

- **copy bandwidth**: a device-to-device copy of ``--copy-mib`` MiB (it reads and writes
  each byte), the rate the roofline below assumes;
- **decode** at each ``--batches`` size, contexts spread over [context/2, 3*context/2]:
  the roofline time is the bytes a step must read (every weight once, every sequence's
  KV) over that bandwidth; ``% roofline`` = roofline time / measured step time;
- **prefill** of ``--prefill`` tokens in one chunk against a square bf16 matmul's
  FLOP/s measured in the same run: MFU = (2 x linear weights x tokens + causal attention's
  2 x tokens^2 x heads x head dim per layer) / step time / that ceiling.

Goals (a GPU user's questions): decode at least 70% of the roofline at batch 1 and 50% at
64, prefill at least 50% MFU. On the CPU (``--device cpu --shape tiny``) it checks the
script, not the figures.

    python benchmarks/micro/gpu_roofline.py [--device cuda] [--shape llama3-8b] [--dtype bfloat16]
        [--batches 1,16,64] [--context 1024] [--prefill 4096] [--backends auto,sdpa] [--reps 10]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from engine_step_profile import PlanMaker

from memserve.config import EngineConfig
from memserve.workers.model_runner import ModelRunner

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True),
}
BLOCK_SIZE = 16


def write_config(shape: str, folder: Path) -> None:
    """config.json of a Llama model of ``shape`` (no weights: they are drawn on the device)."""
    import transformers

    transformers.LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5).save_pretrained(folder)


def timed(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after two to warm up."""
    times = []
    for rep in range(reps + 2):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if rep >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_ceilings(device: torch.device, dtype: torch.dtype, copy_mib: int, matmul_n: int, reps: int,
                    sync: Callable[[], None]) -> tuple[float, float]:
    """(bytes/s a copy moves, reads plus writes; FLOP/s of an n x n x n matmul) on ``device``."""
    src = torch.empty(copy_mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), reps, sync)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, dtype=dtype, device=device)
    b = torch.randn(matmul_n, matmul_n, dtype=dtype, device=device)
    matmul_s = timed(lambda: a @ b, reps, sync)
    return 2 * (copy_mib << 20) / copy_s, 2 * matmul_n**3 / matmul_s


def contexts(mean: int, batch: int) -> list[int]:
    return [mean] if batch == 1 else [mean // 2 + i * mean // (batch - 1) for i in range(batch)]


def weight_bytes(runner: ModelRunner) -> tuple[int, int]:
    """(bytes of every distinct weight, parameters of the layers' linear weights)."""
    seen: dict[int, torch.Tensor] = {p.data_ptr(): p for p in runner.model.parameters()}
    total = sum(p.numel() * p.element_size() for p in seen.values())
    linear = sum(p.numel() for name, p in runner.model.named_parameters()
                 if p.dim() == 2 and ".layers." in f".{name}")
    return total, linear


def measure(args: argparse.Namespace, folder: Path, backend: str, sync: Callable[[], None],
            copy_bps: float, flops: float) -> list[tuple[str, float, float]]:
    """(step, ms, % of its ceiling) of each decode batch and the prefill, on ``backend``."""
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(3 * args.context // 2 + 1) // BLOCK_SIZE)
    num_blocks = 2 + max(max(batches) * per_seq, -(-args.prefill // BLOCK_SIZE))
    cfg = EngineConfig(model=str(folder), dtype=args.dtype, device=args.device, num_blocks=num_blocks,
                       max_num_seqs=max(batches), max_num_batched_tokens=max(args.prefill, max(batches)),
                       async_save=False, load_format="dummy", attention_backend=backend)
    runner = ModelRunner(cfg, folder)
    weights, linear = weight_bytes(runner)
    cfg_model = runner.model_config
    kv_per_token = 2 * cfg_model.num_layers * cfg_model.num_kv_heads * cfg_model.head_dim * runner.pools.dtype.itemsize
    maker = PlanMaker(runner.num_blocks, BLOCK_SIZE, runner.vocab_size)
    rows = []
    for batch in batches:
        ctx = contexts(args.context, batch)
        plan = maker.plan([maker.chunk(c, 1) for c in ctx])
        runner.execute(plan)  # registers the requests
        plan.new_requests = []
        step_s = timed(lambda: runner.execute(plan), args.reps, sync)
        roofline_s = (weights + kv_per_token * sum(ctx)) / copy_bps
        rows.append((f"decode x{batch}", step_s * 1e3, 100 * roofline_s / step_s))
    plan = maker.plan([maker.chunk(0, args.prefill)])
    step_s = timed(lambda: runner.execute(plan), max(2, args.reps // 3), sync)
    heads_dim = cfg_model.num_heads * cfg_model.head_dim
    work = 2 * linear * args.prefill + cfg_model.num_layers * 2 * args.prefill**2 * heads_dim
    rows.append((f"prefill {args.prefill}", step_s * 1e3, 100 * work / step_s / flops))
    del runner
    gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--backends", default="auto", help="--attention-backend values, each timed in turn")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--matmul", type=int, default=8192, help="side of the square matmul that sets the FLOP ceiling")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dtype = getattr(torch, args.dtype)
    copy_bps, flops = device_ceilings(device, dtype, args.copy_mib, args.matmul, args.reps, sync)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}: copy {copy_bps / 1e9:.0f} GB/s (read + write), {args.dtype} matmul {flops / 1e12:.3g} TFLOP/s")
    print(f"{'backend':>9} {'step':>14} {'ms':>9} {'% ceiling':>10}")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_config(args.shape, folder)
        for backend in args.backends.split(","):
            for step, ms, share in measure(args, folder, backend, sync, copy_bps, flops):
                print(f"{backend:>9} {step:>14} {ms:>9.2f} {share:>9.1f}%")
                summary.append(f"{backend} {step} {share:.0f}%")
    print("summary: " + ", ".join(summary))


if __name__ == "__main__":
    main()
