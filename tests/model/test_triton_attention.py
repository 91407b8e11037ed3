"""The Triton paged-attention kernel, run on CPU tensors by Triton's interpreter, against
float64 attention over each sequence's gathered blocks: mixed batches (decode rows,
prefill chunks after a cached context, prompts with none, chunks longer than one query
block), shuffled block ids, first blocks shared between sequences, contexts ending inside
and at the end of a block, GQA groups of 1, 2, 3 and 4, head dims 32, 48 and 64, block
sizes 8, 16 and 32, both KV layouts' per-layer views, q a strided view, sliding windows
(inside the context and longer than it), soft-caps, float32 and float16, a bfloat16 and
an FP8 cache. Every cache slot no sequence holds is NaN, and block tables are padded with
an all-NaN block: a kernel reading a key it should not would turn its rows into NaN.

Beside the interpreter, the kernel is compiled for Ampere and Hopper GPUs (no GPU needed),
which checks what only the compiler checks."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memserve.workers.model.attention import allocate_kv_cache, layer_kv

# Triton decides at each @triton.jit whether it is interpreted, its own library's
# functions (tl.zeros...) included when triton is imported: triton is imported here with
# TRITON_INTERPRET set, which is put back at once so that the tests collected after this
# file (and the processes they start) do not see it. Triton stays interpreted in this
# process; no other test imports it.
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1: run this file in a process of its own",
                allow_module_level=True)
with pytest.MonkeyPatch.context() as _patch:
    _patch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")

MODULE = "memserve.workers.model.triton_attention"


@pytest.fixture(scope="module")
def paged_attention():
    """The kernel as Triton's interpreter runs it, on CPU tensors. The interpreter reads
    TRITON_INTERPRET as the kernel is decorated and as it runs: it is set only while this
    file's tests run, the module imported afresh under it and dropped after them, so that
    no other test imports an interpreted kernel (nor this file a compiled one)."""
    parent = importlib.import_module(MODULE.rsplit(".", 1)[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.delitem(sys.modules, MODULE, raising=False)
        patch.delattr(parent, "triton_attention", raising=False)
        module = importlib.import_module(MODULE)
        yield module.paged_attention
    if sys.modules.get(MODULE) is module:
        del sys.modules[MODULE]
    if getattr(parent, "triton_attention", None) is module:
        delattr(parent, "triton_attention")


def make_batch(gen, block_size):
    """(query tokens, context length) per sequence, and which of them shares the first
    two blocks of another: decode rows, a chunk after a cached context, a prompt longer
    than one query block, a context of whole blocks, random lengths up to 80."""
    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))
    prompt = rand(17, 24)  # nothing cached before it
    specs = [(1, rand(2 * block_size + 1, 80)), (rand(5, 12), rand(2 * block_size + 1, 80)), (1, rand(2, 15)),
             (prompt, prompt), (1, 3 * block_size), (rand(2, 6), rand(2 * block_size + 1, 80))]
    return specs, {5: 1, 0: 1}  # sequences 5 and 0 start with sequence 1's first two blocks


def build_cache(specs, shared, heads, kv_heads, dim, block_size, dtype, layout, gen):
    """Block tables over shuffled block ids, and one layer's K/V views of a pool whose
    slots hold random values where a sequence's context lies and NaN everywhere else."""
    blocks_per = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(blocks_per) + 4
    cache = allocate_kv_cache(num_blocks, 2, block_size, kv_heads, dim, dtype, "cpu", layout)
    cache.fill_(float("nan"))
    k_cache, v_cache = layer_kv(cache, 1, layout)
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    poison = num_blocks - 1  # never written: table padding points here
    tables = torch.full((len(specs), max(blocks_per) + 2), poison, dtype=torch.int32)
    for s, n in enumerate(blocks_per):
        tables[s, :n] = torch.tensor([free.pop() for _ in range(n)])
    for s, owner in shared.items():
        tables[s, :2] = tables[owner, :2]
    for s, (_, ctx) in enumerate(specs):
        slots = torch.arange(ctx)
        blocks = tables[s, slots // block_size].long()
        for pool in (k_cache, v_cache):
            # A shared block holds the same keys for every sequence: those written first.
            values = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
            keep = pool[blocks, slots % block_size].float().sum((-1, -2)).isnan()
            pool[blocks[keep], slots[keep] % block_size] = values[keep]
    return k_cache, v_cache, tables


def reference(q, k_cache, v_cache, specs, tables, scale, window, softcap):
    """Dense attention in float64 over each sequence's gathered context: causal
    (bottom-right), keys p - window < j <= p where a window is set, capped scores."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out, start = [], 0
    for s, (q_len, ctx) in enumerate(specs):
        blocks = tables[s, : -(-ctx // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        values = v_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len].double(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(ctx - q_len, ctx)[:, None]
        key_pos = torch.arange(ctx)[None, :]
        seen = key_pos <= query_pos
        if window:
            seen &= key_pos > query_pos - window
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), values))
        start += q_len
    return torch.cat(out)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}


F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size", "window", "softcap", "dtypes", "layout"), [
    (2, 2, 32, 16, 0, 0.0, (F32, F32), "aggregated"),
    (4, 2, 64, 16, 0, 0.0, (F32, F32), "layer-major"),
    (4, 1, 32, 16, 0, 0.0, (F32, F32), "aggregated"),
    (6, 2, 48, 16, 0, 0.0, (F32, F32), "aggregated"),
    (4, 2, 32, 8, 0, 0.0, (F32, F32), "aggregated"),
    (2, 1, 32, 32, 0, 0.0, (F32, F32), "aggregated"),
    (4, 2, 32, 16, 19, 0.0, (F32, F32), "aggregated"),
    (2, 2, 32, 16, 100, 0.0, (F32, F32), "layer-major"),
    (4, 1, 64, 16, 0, 5.0, (F32, F32), "aggregated"),
    (2, 2, 64, 16, 7, 3.0, (F32, F32), "aggregated"),
    (4, 2, 32, 16, 0, 0.0, (F16, F16), "aggregated"),
    (4, 2, 64, 16, 19, 0.0, (F32, BF16), "aggregated"),
    (4, 2, 32, 16, 0, 2.0, (F16, FP8), "aggregated"),
])
def test_mixed_batch_matches_dense_attention(paged_attention, heads, kv_heads, dim, block_size, window, softcap,
                                             dtypes, layout):
    """(q's dtype, the cache's): Triton's interpreter computes no bfloat16 arithmetic (its
    tl.dot multiplies bfloat16 bit patterns), so bfloat16 is tested as a cache widened to
    float32 queries as loaded, and bfloat16 queries need a GPU."""
    dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(heads * 1000 + dim + block_size + window)
    specs, shared = make_batch(gen, block_size)
    k_cache, v_cache, tables = build_cache(specs, shared, heads, kv_heads, dim, block_size, cache_dtype, layout,
                                           gen)
    num_tokens = sum(q_len for q_len, _ in specs)
    # q as the model has it: a strided view into the fused q/k/v projection's output.
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q = qkv[:, :heads]
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    query_start_loc = torch.tensor([0] + [q_len for q_len, _ in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([ctx for _, ctx in specs], dtype=torch.int32)
    scale = dim ** -0.5
    paged_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, tables, scale, window, softcap)
    expected = reference(q, k_cache, v_cache, specs, tables, scale, window, softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_metadata_must_be_int32(paged_attention):
    q = torch.zeros(1, 2, 32)
    cache = torch.zeros(2, 16, 2, 32)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention(q, cache, cache, torch.empty_like(q), torch.tensor([0, 1], dtype=torch.int32),
                        torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.long), 1.0)


# Compiles the kernel (not interpreted: TRITON_INTERPRET is not set there) for each
# (compute capability, q dtype, cache dtype, GQA group, head dim) in argv[1], down to a
# cubin through the ptxas that triton's wheel ships: no GPU is needed to compile.
COMPILE_FOR_CUDA = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from memserve.workers.model import triton_attention as ta
kernel = ta._paged_attention_kernel
for arch, q_type, cache_type, group, dim in json.loads(sys.argv[1]):
    pointers = {"q": q_type, "out": q_type, "k_cache": cache_type, "v_cache": cache_type}
    constants = ta.kernel_constants(group, dim)
    signature = {name: "constexpr" if name in constants else "*" + pointers[name] if name in pointers
                 else "*i32" if name in ("query_start_loc", "seq_lens", "block_tables")
                 else "fp32" if name in ("scale", "softcap") else "i32" for name in kernel.arg_names}
    compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32))
"""


def test_kernel_compiles_for_cuda(tmp_path):
    """The interpreter runs the kernel as Python and would not see what only the compiler
    refuses (a type that changes in a loop, a tile too small for tl.dot): compile it for
    Ampere and Hopper, every dtype and a GQA group up to 32. An FP8 cache only for Hopper:
    triton has no float8_e4m3 on Ampere."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    cases = [(80, "fp32", "fp32", 1, 64), (80, "bf16", "bf16", 4, 128), (90, "fp16", "fp16", 8, 128),
             (90, "bf16", "fp8e4nv", 3, 80), (90, "fp16", "fp16", 32, 64)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_CUDA, json.dumps(cases)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
