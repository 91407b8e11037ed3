"""Each ``--attention-backend`` against ``sdpa`` on one device, in one run: the same
layer's attention over a paged KV pool, as the model calls it (``paged_attention``: the
new tokens' K/V written, then attended; the step's plan built once, as the runner builds
it once per step for every layer).

Batches (Llama-3-8B's attention by default: 32 query heads over 8 KV heads of 128, blocks
of 16, bf16), their blocks scattered over the pool:

- ``decode``: ``--decodes`` rows of one new token, contexts spread over
  [context/2, 3*context/2];
- ``mixed``: the same decode rows, verify rows of decodes with 3 drafts, a 512-token chunk
  after a cached prefix of ``--context`` tokens and a 512-token prompt.

For each backend that runs here: the largest difference from a float32 SDPA reference (on
the same inputs widened), relative to the reference's largest magnitude, sdpa in the
model's dtype included as the yardstick; the median time of one call over ``--reps``
(``gpu_roofline.timed``, whose shapes these are); and its speed against sdpa's. Backends that cannot run here
(xformers not installed, triton on the CPU without ``TRITON_INTERPRET=1``) are named and
skipped. On the CPU (``--device cpu --shape tiny --dtype float32``) it checks the script,
not the figures.

    python benchmarks/micro/attention_backends.py [--device cuda] [--backends sdpa,triton,xformers]
        [--dtype bfloat16] [--context 1024] [--decodes 64] [--reps 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from gpu_roofline import BLOCK_SIZE, SHAPES, timed

from memserve.testing.paged_batch import PagedBatch, paged_batch
from memserve.workers.model.attention import AttentionPlan, allocate_kv_cache, layer_kv, paged_attention
from memserve.workers.model.attention_backend import choose_attention_backend

LAYOUT = "aggregated"


def attention_shape(shape: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of gpu_roofline's model ``shape``."""
    config = SHAPES[shape]
    heads = config["num_attention_heads"]
    return heads, config["num_key_value_heads"], config["hidden_size"] // heads


def batches(args: argparse.Namespace, gen: torch.Generator) -> dict[str, PagedBatch]:
    spread = torch.randint(args.context // 2, 3 * args.context // 2 + 1, (args.decodes,), generator=gen).tolist()
    decodes = [(1, n) for n in spread]
    chunk = min(512, args.context)
    mixed = decodes + [(4, n) for n in spread[:4]] + [(chunk, args.context + chunk), (chunk, chunk)]
    return {"decode": paged_batch(gen, decodes, BLOCK_SIZE), "mixed": paged_batch(gen, mixed, BLOCK_SIZE)}


def attend(batch: PagedBatch, backend: str, pool: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           device: torch.device) -> Callable[[], torch.Tensor]:
    """One layer's call on ``backend`` over a copy of ``pool`` (its plan built now)."""
    plan = AttentionPlan.build(batch.metadata(BLOCK_SIZE, LAYOUT, backend, device), device)
    k_cache, v_cache = layer_kv(pool.clone(), 0, LAYOUT)
    return lambda: paged_attention(q, k, v, k_cache, v_cache, plan, q.shape[-1] ** -0.5)


def runnable(backends: list[str], device: torch.device, dim: int, dtype: torch.dtype) -> dict[str, str]:
    """Each backend that runs here by name, and why each other does not."""
    out = {}
    for name in backends:
        try:
            out[name] = choose_attention_backend(name, device, dim, dtype)
        except ValueError as why:
            print(f"{name}: skipped ({why})")
    return out


def compare(args: argparse.Namespace) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    heads, kv_heads, dim = attention_shape(args.shape)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    backends = runnable(args.backends, device, dim, dtype)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for case, batch in batches(args, gen).items():
        pool = allocate_kv_cache(batch.num_blocks, 1, BLOCK_SIZE, kv_heads, dim, dtype, device, LAYOUT).normal_()
        qkv = torch.randn(batch.query_start_loc[-1], heads + 2 * kv_heads, dim, device=device, dtype=dtype)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # strided views, as the model has them
        reference = attend(batch, "sdpa", pool.float(), q.float(), k.float(), v.float(), device)().double()
        scale = float(reference.abs().max())
        for name, backend in backends.items():
            call = attend(batch, backend, pool, q, k, v, device)
            error = float((call().double() - reference).abs().max()) / scale
            rows.append({"case": case, "backend": name, "error": error, "ms": 1e3 * timed(call, args.reps, sync)})
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'case':<8} {'backend':<9} {'rel err':>9} {'ms':>9} {'vs sdpa':>8}")
    sdpa = {r["case"]: r["ms"] for r in rows if r["backend"] == "sdpa"}
    for r in rows:
        speed = sdpa[r["case"]] / r["ms"] if r["case"] in sdpa else float("nan")
        print(f"{r['case']:<8} {r['backend']:<9} {r['error']:>9.1e} {r['ms']:>9.3f} {speed:>7.2f}x")
    others = [r for r in rows if r["backend"] != "sdpa" and r["case"] in sdpa]
    print("summary: " + ("; ".join(f"{r['backend']} {r['case']} {sdpa[r['case']] / r['ms']:.2f}x sdpa, "
                                   f"err {r['error']:.0e}" for r in others) or "sdpa alone"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["sdpa", "triton", "xformers"])
    p.add_argument("--context", type=int, default=1024, help="decode rows' mean context, the chunk's cached prefix")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    report(compare(args))


if __name__ == "__main__":
    main()
