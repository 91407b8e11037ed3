"""AWQ and GPTQ 4-bit linear layers on CUDA: one Triton kernel that unpacks the weight
as it multiplies, so the weight stays half a byte a value in GPU memory.

Why: torch's int4 weight-only kernel used on the CPU (``int4_linear.Int4Linear``) is the
CPU's; on CUDA the layers were dequantized at load, four times the memory of the
checkpoint in bf16 and four times the bytes every decode step reads.

The weight is held as the codes ``int4_linear`` unpacks both formats into, packed two a
byte along the input (``pack_codes``: byte j of a row holds column 2j in its low nibble,
2j + 1 in its high one), with float32 scales and zeros [out, groups]. A program computes
a BLOCK_M x BLOCK_N tile of the output: for each BLOCK_K columns it loads the rows of x,
the packed bytes of its BLOCK_N weight rows, and each column's group scale and zero,
forms w = (q - z) * s in float32, rounds it to x's dtype (as ``int4_linear.dequantize``
rounds the widened weight) and accumulates ``tl.dot`` in float32 (without TF32, so a
float32 model's product is as exact as ``F.linear``'s); the tile is rounded to x's dtype
once, and the bias added after, as ``F.linear`` over the dequantized weight computes.

Tested on the CPU by Triton's interpreter against that product, and compiled for Ampere
and Hopper there (tests/model/test_triton_int4.py).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from memserve.workers.model.int4_linear import Int4Layer

BLOCK_M = 16  # the smallest tile tl.dot takes on GPUs: a decode step's few rows
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _int4_matmul_kernel(x, packed, scales, zeros, out, M, N, K, stride_xm, GROUP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        rows = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        in_weight = (rk[:, None] < K) & (rn[None, :] < N)  # [BLOCK_K, BLOCK_N]: the weight transposed
        byte = tl.load(packed + rn[None, :] * (K // 2) + rk[:, None] // 2, mask=in_weight, other=0).to(tl.int32)
        code = (byte >> ((rk[:, None] % 2) * 4)) & 0xF
        at = rn[None, :] * groups + rk[:, None] // GROUP
        scale = tl.load(scales + at, mask=in_weight, other=0.0)
        zero = tl.load(zeros + at, mask=in_weight, other=0.0)
        weight = ((code.to(tl.float32) - zero) * scale).to(rows.dtype)
        acc += tl.dot(rows, weight, input_precision="ieee")
    tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (uint8, 0..15; ``in`` even) -> [out, in / 2] uint8, two a byte."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int) -> torch.Tensor:
    """x [M, K] (contiguous rows) times the weight (q - z) * s the packed codes [N, K / 2]
    and float32 scales and zeros [N, K / group] stand for, transposed: [M, N] in x's dtype."""
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int4_matmul_kernel[grid](x, packed, scales, zeros, out, m, n, k, x.stride(0), GROUP=group, BLOCK_M=BLOCK_M,
                              BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


class TritonInt4Linear(Int4Layer):
    """Through the kernel above (see the module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(codes.shape[0], codes.shape[1], codes.shape[1] // scales.shape[1], bias)
        self.register_buffer("packed", pack_codes(codes), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)
        self.register_buffer("zeros", zeros.float().contiguous(), persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return int4_matmul(rows, self.packed, self.scales, self.zeros, self.group)
