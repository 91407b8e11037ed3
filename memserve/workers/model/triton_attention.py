"""Paged attention as one Triton kernel that reads K/V in place through the block tables.

One launch attends every query row of a step: prefill chunks (several new tokens of a
sequence, causal against its cached context and themselves) and decode rows (one new
token) alike. Query row i of sequence s sits at absolute position
``seq_lens[s] - q_len + i`` and sees the keys at positions j with j <= position, and with
a sliding window W > 0 only those with position - W < j (as attention.py's window). A
soft-cap C > 0 turns each scaled score x into C * tanh(x / C) before the softmax.

Why: the CUDA path in attention.py gathers every sequence's blocks into a padded copy per
layer and step. Here each key is read from its block where it lies, found by
``block_tables[s, j // block_size]``, so nothing is gathered and nothing is padded.

Grid: (query blocks, KV heads). A program owns BLOCK_Q query tokens of one sequence and
one KV head with all the GROUP query heads that share it (GQA): its BLOCK_Q * GROUP rows
are attended against each K/V tile loaded once, so no K/V is repeated per query head. The
query blocks are numbered without host data: sequence s owns the numbers from
``query_start_loc[s] // BLOCK_Q + s`` on, at least as many as its query tokens need, so
``T // BLOCK_Q + S`` programs cover any batch of T tokens and S sequences; a program finds
its sequence by binary search over query_start_loc and returns at once where its block
lies past its sequence's tokens. It walks the keys from its first query's window (0
without one) to its last query's position, TILE_N at a time, with an online softmax in
float32 (FlashAttention's running max and sum), and writes each row once.

Invariants the caller keeps: a sequence's query rows are contiguous in q and out, in
query_start_loc's order; the cache holds every key up to ``seq_lens[s]`` (the step's
new K/V written first, as ``write_kv`` does); q, the caches and out share one head dim,
at least 16 (tl.dot's smallest tile); H is a multiple of KVH.

Dtypes: q and out float32, float16 or bfloat16; K/V are read in the cache's dtype (the
same, or FP8 e4m3, which triton has from Hopper on) and widened to q's as loaded. Both
products take q's dtype with float32 accumulation, float32 ones without TF32, so that a
float32 model's attention is as exact as the reference's.

Tested on the CPU by Triton's interpreter against dense attention, and compiled for
Ampere and Hopper there (tests/model/test_triton_attention.py); the interpreter computes
no bfloat16 arithmetic, so bfloat16 queries are checked only by compiling.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

# Rows (query tokens x query heads of a KV head) per program: 16 is the smallest tile
# tl.dot takes on GPUs; the query tokens per program follow from it and the GQA group.
BLOCK_M = 16
TILE_N = 16  # keys per step of the loop over the context


@triton.jit
def _find_sequence(query_start_loc, num_seqs, block, BLOCK_Q: tl.constexpr):
    """The sequence s that owns query block ``block``: the last s whose first block number,
    query_start_loc[s] // BLOCK_Q + s, is at most ``block``."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first <= block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _softcap(x, cap):
    """cap * tanh(x / cap), with tanh(y) as 1 - 2 / (e^2y + 1): exp is in every backend, and
    the form saturates to +-1 where e^2y overflows or vanishes."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))


@triton.jit
def _paged_attention_kernel(
    q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
    scale, softcap, window, num_seqs, block_size,
    q_stride_t, q_stride_h, q_stride_d,
    kv_stride_b, kv_stride_s, kv_stride_h, kv_stride_d,
    o_stride_t, o_stride_h, o_stride_d, bt_stride,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc, num_seqs, block, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    first_token = (block - q_start // BLOCK_Q - seq) * BLOCK_Q
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)

    # Row m is query token first_token + m // GROUP_P2 under head kv_head * GROUP + m % GROUP_P2.
    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (token < q_len) & (rows % GROUP_P2 < GROUP)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    row_token = (q_start + token).to(tl.int64)
    q_ptrs = q + row_token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :] * q_stride_d
    queries = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    position = seq_len - q_len + token  # each row's absolute position
    last_pos = seq_len - q_len + tl.minimum(first_token + BLOCK_Q, q_len) - 1
    key_start = tl.where(window > 0, tl.maximum(seq_len - q_len + first_token - window + 1, 0), 0)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table = block_tables + seq * bt_stride
    for tile_start in range(key_start, last_pos + 1, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)
        key_ok = keys <= last_pos
        physical = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)  # a pool passes 2^31 elements
        kv_offset = physical * kv_stride_b + (keys % block_size) * kv_stride_s + kv_head * kv_stride_h
        k_tile = tl.load(k_cache + kv_offset[None, :] + dims[:, None] * kv_stride_d,
                         mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        scores = tl.dot(queries, k_tile.to(queries.dtype), input_precision="ieee").to(tl.float32) * scale
        if softcap > 0:
            scores = _softcap(scores, softcap)
        seen = (keys[None, :] <= position[:, None]) & row_ok[:, None]
        if window > 0:
            seen &= keys[None, :] > position[:, None] - window
        scores = tl.where(seen, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no key yet keeps max -inf: subtract 0 there, not -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v_tile = tl.load(v_cache + kv_offset[:, None] + dims[None, :] * kv_stride_d,
                         mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(queries.dtype)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v_tile.dtype), v_tile, input_precision="ieee")
        row_max = new_max

    acc = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    o_ptrs = out + row_token[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :] * o_stride_d
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attend q [T, H, D] to each sequence's paged K/V ([num_blocks, block_size, KVH, D]
    views, as ``layer_kv`` gives them) and write out [T, H, D]. query_start_loc [S + 1],
    seq_lens [S] (context including the new tokens) and block_tables [S, max_blocks] are
    int32 on q's device; nothing here reads them on the host, so the launch never waits."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % kv_heads or k_cache.shape[3] != head_dim or out.shape != q.shape:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, out {tuple(out.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, not {t.dtype}")
    num_seqs = seq_lens.shape[0]
    constants = kernel_constants(num_heads // kv_heads, head_dim)
    grid = (num_tokens // constants["BLOCK_Q"] + num_seqs, kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        scale, softcap, window, num_seqs, block_size,
        *q.stride(), *k_cache.stride(), *out.stride(), block_tables.stride(0), **constants,
    )


def kernel_constants(group: int, head_dim: int) -> dict[str, int]:
    """The kernel's compile-time parameters for a GQA group and head dim (one compiled
    kernel per model, whatever the batch)."""
    group_p2 = triton.next_power_of_2(group)
    block_m = max(BLOCK_M, group_p2)
    return dict(HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), GROUP=group, GROUP_P2=group_p2,
                BLOCK_Q=block_m // group_p2, BLOCK_M=block_m, TILE_N=TILE_N)
