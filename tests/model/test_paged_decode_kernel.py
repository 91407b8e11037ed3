"""The compiled CPU decode-attention kernel against plain float64 attention: ragged
contexts over shuffled blocks (partial last blocks, contexts spanning several partitions),
GQA and one KV head per query head, both KV layouts' per-layer views (the aggregated one
strided), float32 and bf16, batches of 1 and 33 rows (one row's keys split over the
threads), sliding windows (starting inside a block, spanning partitions, longer than the
context) and soft-capped scores."""

from __future__ import annotations

import pytest
import torch

from memserve.workers.model import cpu_kernels
from memserve.workers.model.attention import allocate_kv_cache, layer_kv

if not cpu_kernels.available():
    pytest.skip("the CPU kernels cannot be built here (no C++ compiler or ninja)", allow_module_level=True)

DIM = 64
THREADS = torch.get_num_threads()


def reference(q, k_cache, v_cache, table, length, scale, softcap=0.0):
    """q [heads, dim] against the first ``length`` tokens of the blocks in ``table``, the
    scaled scores s capped at softcap * tanh(s / softcap) where ``softcap`` is set."""
    keys = k_cache[table].flatten(0, 1)[:length].double()  # [length, kv_heads, dim]
    values = v_cache[table].flatten(0, 1)[:length].double()
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,thd->ht", q.double() * scale, keys)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), values)


def run_case(lengths, heads, kv_heads, block_size, dtype, layout, gen, window=0, softcap=0.0, dim=DIM):
    blocks_per = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(blocks_per) + 3
    cache = allocate_kv_cache(num_blocks, 2, block_size, kv_heads, dim, dtype, "cpu", layout)
    cache.normal_(generator=gen)
    k_cache, v_cache = layer_kv(cache, 1, layout)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
    width = max(blocks_per) + 2  # tables padded past what any row needs
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(blocks_per):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    lens = torch.tensor(lengths, dtype=torch.long)
    cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, dim**-0.5, window, softcap)
    return out, q, k_cache, v_cache, tables


@pytest.mark.parametrize(("dtype", "layout", "heads", "kv_heads", "block_size"), [
    (torch.float32, "aggregated", 9, 3, 16), (torch.float32, "layer-major", 9, 3, 32),
    (torch.bfloat16, "aggregated", 9, 3, 16), (torch.float32, "aggregated", 4, 4, 16),
    (torch.bfloat16, "layer-major", 4, 4, 32),
])
def test_kernel_matches_plain_attention(dtype, layout, heads, kv_heads, block_size):
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 15, 16, 17, 300, 2100, 513, 1024] + [7 + 37 * i for i in range(25)]  # 33 rows
    out, q, k_cache, v_cache, tables = run_case(lengths, heads, kv_heads, block_size, dtype, layout, gen)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lengths):
        expected = reference(q[i], k_cache, v_cache, tables[i, : -(-n // block_size)], n, DIM**-0.5)
        torch.testing.assert_close(out[i].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "dim"), [
    (torch.float32, 80), (torch.bfloat16, 80), (torch.bfloat16, 96), (torch.float32, 256),
])
def test_head_dims_other_than_64(dtype, dim):
    """Head dims without an unrolled instance: multiples of 32 (96, 256) take the vector
    loops with the dim known at run time, others (80) the scalar loops."""
    gen = torch.Generator().manual_seed(4)
    lengths = [1, 17, 530, 1030]
    out, q, k_cache, v_cache, tables = run_case(lengths, 8, 2, 16, dtype, "aggregated", gen, dim=dim)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lengths):
        expected = reference(q[i], k_cache, v_cache, tables[i, : -(-n // 16)], n, dim**-0.5)
        torch.testing.assert_close(out[i].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [40, 600])
def test_window_attends_only_the_last_keys(window):
    """Row i attends to its last ``window`` tokens: the window starts inside a block, may
    span two partitions (600 > 512), or cover the whole context (short rows)."""
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 39, 40, 41, 300, 2100, 613, 1024]
    out, q, k_cache, v_cache, tables = run_case(lengths, 9, 3, 16, torch.float32, "aggregated", gen, window)
    for i, n in enumerate(lengths):
        keys = k_cache[tables[i, : -(-n // 16)]].flatten(0, 1)[max(0, n - window) : n]
        values = v_cache[tables[i, : -(-n // 16)]].flatten(0, 1)[max(0, n - window) : n]
        expected = reference(q[i], keys[None], values[None], [0], len(keys), DIM**-0.5)
        torch.testing.assert_close(out[i].double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_caps_every_score(dtype):
    """Scores soft-capped at 0.5 (scaled scores reach several units here, so the cap
    changes the output), over several partitions and with a window."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 17, 600, 1100]
    out, q, k_cache, v_cache, tables = run_case(lengths, 9, 3, 16, dtype, "aggregated", gen, 700, 0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lengths):
        table, first = tables[i, : -(-n // 16)], max(0, n - 700)
        keys = k_cache[table].flatten(0, 1)[first:n][None]
        values = v_cache[table].flatten(0, 1)[first:n][None]
        expected = reference(q[i], keys, values, [0], n - first, DIM**-0.5, 0.5)
        torch.testing.assert_close(out[i].double(), expected, atol=tol, rtol=tol)
        if n > 1:
            uncapped = reference(q[i], keys, values, [0], n - first, DIM**-0.5)
            assert not torch.allclose(out[i].double(), uncapped, atol=1e-2)


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("window", [0, 100])
def test_few_rows_split_into_short_partitions_give_the_same_attention(threads, window):
    """One or two rows on more threads than their 512-key partitions: the keys are split
    into shorter partitions (down to 64, windows starting inside a block) and merged."""
    torch.set_num_threads(threads)
    try:
        for lengths in ([1], [70], [130, 20], [511], [1000]):
            gen = torch.Generator().manual_seed(sum(lengths))
            out, q, k_cache, v_cache, tables = run_case(lengths, 9, 3, 16, torch.float32, "aggregated", gen, window)
            for i, n in enumerate(lengths):
                first = max(0, n - window) if window else 0
                keys = k_cache[tables[i, : -(-n // 16)]].flatten(0, 1)[first:n][None]
                values = v_cache[tables[i, : -(-n // 16)]].flatten(0, 1)[first:n][None]
                expected = reference(q[i], keys, values, [0], n - first, DIM**-0.5)
                torch.testing.assert_close(out[i].double(), expected, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(THREADS)


def test_single_row_reads_only_its_own_blocks():
    """Batch 1 (partitions spread over the threads); a changed block-table entry changes
    the output, and a block past the context does not."""
    gen = torch.Generator().manual_seed(1)
    out, q, k_cache, v_cache, tables = run_case([1500], 9, 3, 16, torch.float32, "aggregated", gen)
    expected = reference(q[0], k_cache, v_cache, tables[0, :94], 1500, DIM**-0.5)
    torch.testing.assert_close(out[0].double(), expected, atol=2e-5, rtol=2e-5)
    again = torch.empty_like(q)
    past = tables.clone()
    past[0, 94] = past[0, 3]  # the padding after the 94 blocks in use
    cpu_kernels.paged_decode_attention(again, q, k_cache, v_cache, past, torch.tensor([1500]), DIM**-0.5)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    moved = tables.clone()
    moved[0, 10] = moved[0, 11]
    cpu_kernels.paged_decode_attention(again, q, k_cache, v_cache, moved, torch.tensor([1500]), DIM**-0.5)
    assert not torch.allclose(again, out, atol=1e-4)


def test_bad_arguments_raise():
    q = torch.randn(2, 9, DIM)
    cache = torch.zeros(4, 16, 3, DIM)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.paged_decode_attention(torch.empty_like(q), q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                           torch.ones(2, dtype=torch.long), 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.paged_decode_attention(torch.empty_like(q), q, cache.bfloat16(), cache.bfloat16(),
                                           torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long), 0.125)
