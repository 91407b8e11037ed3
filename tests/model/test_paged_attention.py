"""Paged attention against plain per-sequence attention: decode batches whose context
lengths differ widely are split into groups (bounded padding), and every row must still
attend to exactly its own context, in both KV layouts, in bfloat16, with grouped (GQA,
folded into the query rows) as well as one KV head per query head, and when large groups
are attended a few block columns at a time (chunks made small here so that the test's
groups have several, some ending inside one and some before one). Prefill chunks are
attended a block of queries at a time on CPU; blocks made small here too. Decode rows
also go through the compiled CPU kernel where it builds (it has tests of its own)."""

from __future__ import annotations

import pytest
import torch

from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model import attention, cpu_kernels
from memserve.workers.model.attention import (
    DECODE_GROUP_MAX_PAD_TOKENS,
    AttentionMetadata,
    AttentionPlan,
    allocate_kv_cache,
    decode_groups,
    layer_kv,
    paged_attention,
)
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.prefill_probe import probe_cpu_prefill, resolve_cpu_prefill

BLOCK_SIZE, HEADS, KV_HEADS, DIM, LAYERS = 16, 6, 2, 32, 2


def test_decode_groups_bound_padding():
    lens = [700, 20, 690, 300, 40, 310, 25]
    groups = decode_groups(list(range(len(lens))), lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert [sorted(lens[i] for i in g) for g in groups] == [[690, 700], [300, 310], [20, 25, 40]]
    for group in groups:
        longest = max(lens[i] for i in group)
        assert all(longest - lens[i] <= max(DECODE_GROUP_MAX_PAD_TOKENS, 0.25 * longest) for i in group)


def test_decode_groups_keep_close_lengths_together():
    assert decode_groups([0, 1, 2], [100, 200, 150]) == [[0, 1, 2]]  # pads <= 128 tokens: one call


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [heads, dim] against one sequence's keys/values [ctx, kv_heads, dim]."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.softmax((q[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
    return (weights[:, None, :] @ v).squeeze(1)


PREFILL = (40, 9, None)  # tokens cached before the prefill chunk, its new tokens, query block (None: as shipped)


KERNEL = "kernel"  # chunk_blocks value: decode rows through the compiled CPU kernel


@pytest.mark.parametrize(("layout", "dtype", "kv_heads", "chunk_blocks", "prefill"), [
    ("aggregated", torch.float32, KV_HEADS, None, PREFILL), ("layer-major", torch.float32, KV_HEADS, None, PREFILL),
    ("aggregated", torch.bfloat16, KV_HEADS, None, PREFILL), ("aggregated", torch.float32, HEADS, None, PREFILL),
    ("aggregated", torch.bfloat16, HEADS, None, PREFILL),  # one query row per KV head: bf16 decode upcasts
    ("aggregated", torch.float32, KV_HEADS, 1, PREFILL), ("layer-major", torch.float32, KV_HEADS, 4, PREFILL),
    ("aggregated", torch.bfloat16, KV_HEADS, 4, PREFILL), ("aggregated", torch.bfloat16, HEADS, 1, PREFILL),
    # prefill chunks spanning several query blocks, the last one partial, with and without a prefix
    ("aggregated", torch.float32, KV_HEADS, None, (40, 37, 16)), ("aggregated", torch.bfloat16, KV_HEADS, None, (0, 37, 16)),
    ("layer-major", torch.float32, HEADS, None, (0, 50, 16)), ("aggregated", torch.bfloat16, HEADS, None, (23, 50, 16)),
    ("aggregated", torch.float32, KV_HEADS, KERNEL, PREFILL), ("layer-major", torch.bfloat16, KV_HEADS, KERNEL, PREFILL),
    ("aggregated", torch.float32, HEADS, KERNEL, (0, 37, 16)),
    # a prefix of at most a quarter of the chunk: SDPA pads the queries instead of masking
    ("aggregated", torch.float32, KV_HEADS, None, (8, 37, 16)), ("layer-major", torch.bfloat16, KV_HEADS, None, (9, 40, 16)),
])
@pytest.mark.parametrize("cpu_prefill", ["blocked", "sdpa"])
def test_mixed_lengths_decode_and_prefill_match_reference(layout, dtype, kv_heads, chunk_blocks, prefill, cpu_prefill,
                                                          monkeypatch):
    kernel = chunk_blocks == KERNEL
    if kernel and not cpu_kernels.available():
        pytest.skip("the CPU kernels cannot be built here")
    chunk_blocks = None if kernel else chunk_blocks
    if chunk_blocks is not None:
        monkeypatch.setattr(attention, "DECODE_CHUNK_MIN_TOKENS", 0)
        monkeypatch.setattr(attention, "DECODE_CHUNK_BLOCKS", chunk_blocks)
    prefill_cached, prefill_new, query_block = prefill
    if query_block is not None:
        monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", query_block)
    monkeypatch.setattr(attention, "PREFIX_PATH_MIN_QUERIES", 16)  # chunks of 37-50 queries after a prefix: unmasked
    gen = torch.Generator().manual_seed(0)
    contexts = [700, 20, 300, 45, 310]  # decode rows: context includes the new token
    # and one prefill chunk (after a cached prefix when prefill_cached > 0)
    num_blocks = 1 + sum(-(-c // BLOCK_SIZE) for c in contexts) + -(-(prefill_cached + prefill_new) // BLOCK_SIZE)
    cache = allocate_kv_cache(num_blocks, LAYERS, BLOCK_SIZE, kv_heads, DIM, dtype, "cpu", layout)
    cache.normal_(generator=gen)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
    tables, slots, starts = [], [], [0]
    lens = [*contexts, prefill_cached + prefill_new]
    for i, ctx in enumerate(lens):
        tables.append([free.pop() for _ in range(-(-ctx // BLOCK_SIZE))])
        new = prefill_new if i == len(contexts) else 1
        slots += [tables[-1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx - new, ctx)]
        starts.append(starts[-1] + new)
    width = max(map(len, tables))
    meta = AttentionMetadata(torch.tensor(slots), starts, lens,
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), BLOCK_SIZE, layout,
                             "kernel" if kernel else "torch", cpu_prefill)
    plan = AttentionPlan.build(meta, torch.device("cpu"))
    assert plan.blocked_prefill == (cpu_prefill == "blocked")
    unmasked = "" if cpu_prefill == "blocked" or not prefill_cached or prefill_new < 16 else \
        "padded" if 4 * prefill_cached <= prefill_new else "split"
    assert [p.prefix_path for p in plan.prefills] == [unmasked]
    if kernel:  # every decode row in one call, no groups
        assert plan.decodes == [] and plan.kernel_decodes.context_lens.tolist() == contexts
    else:
        assert len(plan.decodes) == 3  # [700], [300, 310], [20, 45]
    if chunk_blocks is not None:  # every group spanning more than one chunk is chunked
        expected = [-(-blocks // chunk_blocks) if blocks > chunk_blocks else 0 for blocks in (44, 20, 3)]
        assert [len(g.chunks) for g in plan.decodes] == expected
        # one-block chunks: rows 300 and 20 end before their group's last chunk
        assert any(c.empty_rows is not None for g in plan.decodes for c in g.chunks) == (chunk_blocks == 1)
    num_tokens, scale = starts[-1], DIM**-0.5
    # a view into a wider tensor, as q is a view into the fused QKV projection
    q = torch.randn(num_tokens, HEADS + 2 * kv_heads, DIM, generator=gen).to(dtype)[:, :HEADS]
    k = torch.randn(num_tokens, kv_heads, DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, DIM, generator=gen).to(dtype)
    k_cache, v_cache = layer_kv(cache, 1, layout)
    out = paged_attention(q, k, v, k_cache, v_cache, plan, scale)

    for i, ctx in enumerate(lens):
        flat_k = k_cache[tables[i]].flatten(0, 1)[:ctx]  # after the write: holds this step's K/V too
        flat_v = v_cache[tables[i]].flatten(0, 1)[:ctx]
        for row in range(starts[i], starts[i + 1]):
            visible = ctx - (starts[i + 1] - 1 - row)  # causal within the new tokens
            expected = reference(q[row].float(), flat_k[:visible].float(), flat_v[:visible].float(), scale)
            tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
            torch.testing.assert_close(out[row].float(), expected, atol=tol, rtol=tol)
        torch.testing.assert_close(flat_k[ctx - (starts[i + 1] - starts[i]):], k[starts[i]:starts[i + 1]])


def test_the_cpu_prefill_probe_keeps_an_explicit_choice_and_picks_a_measured_one_for_auto():
    config = ModelConfig.from_folder(ensure_model_dir(None))
    assert resolve_cpu_prefill("blocked", config, torch.float32, torch.device("cpu")) == "blocked"
    assert resolve_cpu_prefill("sdpa", config, torch.float32, torch.device("cpu")) == "sdpa"
    times = probe_cpu_prefill(config, torch.bfloat16)
    assert set(times) == {"blocked", "sdpa"} and all(0 < t < 10 for t in times.values())
    assert resolve_cpu_prefill("auto", config, torch.float32, torch.device("cpu")) in ("blocked", "sdpa")
    with pytest.raises(ValueError, match="unknown CPU prefill attention 'flash'"):
        resolve_cpu_prefill("flash", config, torch.float32, torch.device("cpu"))
