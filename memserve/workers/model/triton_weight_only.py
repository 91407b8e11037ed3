"""Weight-only quantized linear layers on CUDA: AWQ/GPTQ 4-bit codes and FP8 (e4m3)
values, multiplied by one Triton kernel that widens the weight as it reads it, so the
weight stays half a byte (int4) or one byte (FP8) a value in GPU memory and every decode
step reads that many bytes.

Why: torch's int4 kernel (``int4_linear.Int4Linear``) is the CPU's, and ``torch._scaled_mm``
needs FP8 units (Ada, Hopper) and per-channel scales; without this kernel such layers
were widened at load (int4: four times the checkpoint's memory in bf16) or at each product
(FP8: a widened copy of the weight written and read every step).

Both formats are held as a byte matrix [out, in / per byte] with float32 scales [out,
groups] (and, for int4, zeros): int4 codes packed two a byte along the input
(``pack_codes``: byte j of a row holds column 2j in its low nibble, 2j + 1 in its high
one), w = (q - z) * s; FP8 values one a byte as stored, w = e4m3 * s, the e4m3 bits decoded
with integer operations (normal: exponent + 120 into a float32's exponent; subnormal:
mantissa * 2^-9), exact for every finite value. A program computes a BLOCK_M x BLOCK_N
tile of the output: for each BLOCK_K columns it loads the rows of x, the bytes of its
BLOCK_N weight rows and each column's group scale (and zero), forms w in float32, rounds
it to x's dtype (as the dequantized weight is rounded) and accumulates ``tl.dot`` in
float32 (without TF32, so a float32 model's product is as exact as ``F.linear``'s); the
tile is rounded to x's dtype once, and the bias added after, as ``F.linear`` over the
dequantized weight computes.

Tested on the CPU by Triton's interpreter against that product, and compiled for Ampere
and Hopper there (tests/model/test_triton_weight_only.py).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from memserve.workers.model.quantized_layer import QuantizedLayer

BLOCK_M = 16  # the smallest tile tl.dot takes on GPUs: a decode step's few rows
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _e4m3_value(byte):
    """The e4m3 value of ``byte`` (int32, 0..255; 0x7F and 0xFF, NaN, not expected) in float32."""
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((byte & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _weight_only_matmul_kernel(x, weight, scales, zeros, out, M, N, K, stride_xm, GROUP: tl.constexpr,
                               FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        rows = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        in_weight = (rk[:, None] < K) & (rn[None, :] < N)  # [BLOCK_K, BLOCK_N]: the weight transposed
        at = rn[None, :] * groups + rk[:, None] // GROUP
        scale = tl.load(scales + at, mask=in_weight, other=0.0)
        if FP8:
            byte = tl.load(weight + rn[None, :] * K + rk[:, None], mask=in_weight, other=0).to(tl.int32)
            value = _e4m3_value(byte)
        else:
            byte = tl.load(weight + rn[None, :] * (K // 2) + rk[:, None] // 2, mask=in_weight, other=0).to(tl.int32)
            code = (byte >> ((rk[:, None] % 2) * 4)) & 0xF
            value = code.to(tl.float32) - tl.load(zeros + at, mask=in_weight, other=0.0)
        acc += tl.dot(rows, (value * scale).to(rows.dtype), input_precision="ieee")
    tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (uint8, 0..15; ``in`` even) -> [out, in / 2] uint8, two a byte."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       group: int) -> torch.Tensor:
    """x [M, K] (contiguous rows) times the transposed weight that ``weight``'s bytes stand
    for: FP8 values [N, K] (``zeros`` None), or packed int4 codes [N, K / 2] with float32
    ``zeros``; float32 ``scales`` [N, K / group]. Returns [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _weight_only_matmul_kernel[grid](x, weight, scales, scales if zeros is None else zeros, out, m, n, k, x.stride(0),
                                     GROUP=group, FP8=zeros is None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                     BLOCK_K=BLOCK_K)
    return out


class TritonInt4Linear(QuantizedLayer):
    """AWQ/GPTQ codes through the kernel above (see the module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(codes.shape[0], codes.shape[1], codes.shape[1] // scales.shape[1], bias)
        self.register_buffer("packed", pack_codes(codes), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)
        self.register_buffer("zeros", zeros.float().contiguous(), persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return weight_only_matmul(rows, self.packed, self.scales, self.zeros, self.group)


class TritonFp8Linear(QuantizedLayer):
    """FP8 (e4m3) values [out, in] with float32 scales [out, groups] (per tensor, per
    channel or per block, as ``fp8_linear.fp8_scales`` lays them out) through the kernel
    above: the dequantized weight's product, one byte a weight read."""

    values: torch.Tensor
    scales: torch.Tensor

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(values.shape[0], values.shape[1], values.shape[1] // scales.shape[1], bias)
        self.register_buffer("values", values.contiguous().view(torch.uint8), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return weight_only_matmul(rows, self.values, self.scales, None, self.group)
