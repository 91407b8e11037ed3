"""Which CPU prefill attention is faster here, measured once when a worker starts.

The two paths trade places with the CPU. On AMD EPYC, torch's float32 matmul (and with it
the SDPA CPU kernel) runs MKL's AVX2 path, and the blocked path (oneDNN products over
query blocks, scores in float32) measured 1.3-1.9x SDPA. On an Intel Xeon with AMX,
SDPA's flash kernel multiplies bf16 on the tile units and measured 5x the blocked path in
bf16 and 1.1-1.7x in float32 (``benchmarks/micro/prefill_attention_micro.py``). So
``--cpu-prefill-attention auto`` times both on this model's head shape, through
``paged_attention`` itself, and keeps the faster: a few tens of milliseconds at start-up.

In bf16 the paths also round differently: the blocked one attends in float32, SDPA keeps
scores and sums in float32 but multiplies bf16 inputs and rounds the probabilities to
bf16 before the second product (as vLLM's CPU attention does)."""

from __future__ import annotations

import time

import torch

from memserve.workers.model.attention import AttentionMetadata, AttentionPlan, allocate_kv_cache, paged_attention
from memserve.workers.model.model_config import ModelConfig

CPU_PREFILLS = ("auto", "blocked", "sdpa")
# The probe's chunks (new tokens, tokens already cached): a first turn, and a follow-up
# after a cached prefix. Long enough that the products dominate, short enough to be quick.
PROBE_CHUNKS = ((384, 0), (128, 384))
PROBE_REPS = 3
_BLOCK_SIZE = 16


def resolve_cpu_prefill(choice: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> str:
    """``choice`` itself unless it is "auto"; then the faster path on this CPU ("blocked"
    only where oneDNN is available, which it needs)."""
    if choice not in CPU_PREFILLS:
        raise ValueError(f"unknown CPU prefill attention {choice!r}; expected one of {CPU_PREFILLS}")
    if choice != "auto":
        return choice
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "sdpa"
    times = probe_cpu_prefill(config, dtype)
    return min(times, key=times.__getitem__)


def probe_cpu_prefill(config: ModelConfig, dtype: torch.dtype) -> dict[str, float]:
    """Seconds per round of ``PROBE_CHUNKS`` for each path, best of ``PROBE_REPS``, the
    paths taken in turns so a busy moment falls on both."""
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    longest = max(new + cached for new, cached in PROBE_CHUNKS)
    blocks = -(-longest // _BLOCK_SIZE)
    cache = allocate_kv_cache(blocks + 1, 1, _BLOCK_SIZE, kv_heads, dim, dtype, "cpu")
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    table = torch.arange(1, blocks + 1)[None]
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(new, heads, dim, generator=gen).to(dtype), torch.randn(new, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(new, kv_heads, dim, generator=gen).to(dtype), new, cached) for new, cached in PROBE_CHUNKS]
    best = {"blocked": float("inf"), "sdpa": float("inf")}
    for _ in range(PROBE_REPS):
        for path in best:
            start = time.perf_counter()
            for q, k, v, new, cached in inputs:
                slots = torch.arange(_BLOCK_SIZE + cached, _BLOCK_SIZE + cached + new)
                meta = AttentionMetadata(slots, [0, new], [cached + new], table, _BLOCK_SIZE, cpu_prefill=path)
                plan = AttentionPlan.build(meta, torch.device("cpu"), 0, config.attn_logit_softcapping or 0.0)
                paged_attention(q, k, v, k_cache, v_cache, plan, config.attention_scale)
            best[path] = min(best[path], time.perf_counter() - start)
    return best
