"""Linear layers over AWQ and GPTQ 4-bit weights, run by torch's int4 weight-only CPU kernel.

Both formats store, per group of ``group`` input columns and per output row, a scale s
and an integer zero z, and a weight as its 4-bit code q: w = (q - z) * s. They differ only
in how the codes are packed into int32 (``unpack_awq``, ``unpack_gptq``), so both are
first unpacked into one form, codes [out, in] (uint8, 0..15) with scales and zeros
[out, groups], in which the loader fuses q/k/v and gate/up and cuts a rank's shard as it
does the float weights (``quantization_config.py``).

torch's kernel (``_weight_int4pack_mm_for_cpu``) computes w = (q - 8) * scale + zero per
group, from ``scales_and_zeros`` [groups, out, 2] in the activations' dtype; so AWQ/GPTQ's
zero z is passed as zero = (8 - z) * s, which is (q - z) * s up to the rounding of the
scale and zero to that dtype. It takes output widths that are a multiple of 16 and groups
of 32, 64, 128 or 256 columns, and it is fast only with bfloat16 activations: float32 and
float16 take a scalar path (on a 2048x2048 layer, one thread: 0.5 ms a row in bfloat16,
10 ms in float32, where the dequantized float32 weight's product takes 1.1 ms). On CUDA
the layers run a Triton kernel of memserve's instead (``triton_weight_only.py``), which takes any
dtype and any group dividing the input. A layer neither kernel takes (on the CPU a float32
or float16 model or other groups; on CUDA without Triton) gets its weight dequantized to
the model's dtype once, at load (``int4_kernel_refusal`` says why, for the log): the
dequantized model's tokens, at the float weight's memory.
"""

from __future__ import annotations

import importlib.util

import torch

from memserve.workers.model.quantized_layer import QuantizedLayer

# The nibble each of 8 consecutive output columns is stored in within an AWQ int32
# (AutoAWQ packs columns in the order 0, 2, 4, 6, 1, 3, 5, 7).
_AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
KERNEL_GROUPS = (32, 64, 128, 256)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] int32 -> [..., n, 8] uint8: each int32's eight 4-bit values, lowest bits first."""
    return ((packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF).to(torch.uint8)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ (GEMM) qweight [in, out/8], qzeros [groups, out/8], scales [groups, out] -> codes
    [out, in], scales and zeros [out, groups] (float32)."""
    order = list(_AWQ_NIBBLE_OF_COLUMN)
    codes = _nibbles(qweight)[..., order].flatten(1)
    zeros = _nibbles(qzeros)[..., order].flatten(1)
    return codes.t().contiguous(), scales.float().t().contiguous(), zeros.float().t().contiguous()


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                zeros_minus_one: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ qweight [in/8, out] (packed along the input), qzeros [groups, out/8] (along the
    output), scales [groups, out] -> codes [out, in], scales and zeros [out, groups]. The
    v1 checkpoint format (AutoGPTQ's) stores each zero minus one: read back as AutoGPTQ
    does, (stored + 1) mod 16."""
    codes = _nibbles(qweight.t()).flatten(1)  # [out, in/8, 8] -> [out, in]
    zeros = _nibbles(qzeros).flatten(1)
    if zeros_minus_one:
        zeros = (zeros + 1) & 0xF
    return codes.contiguous(), scales.float().t().contiguous(), zeros.float().t().contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] the codes stand for, (q - z) * s computed in float32, then ``dtype``."""
    group = codes.shape[1] // scales.shape[1]
    zeros, scales = zeros.repeat_interleave(group, dim=1), scales.repeat_interleave(group, dim=1)  # [out, in]
    return ((codes.float() - zeros) * scales).to(dtype)


def int4_kernel_refusal(out_features: int, in_features: int, group: int, dtype: torch.dtype,
                        device: torch.device) -> str | None:
    """Why no int4 kernel can run this layer (None: ``quantization_config.int4_kernel``
    has one): torch's on the CPU, the Triton one (``triton_weight_only.py``) on CUDA."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "Triton, which runs int4 layers on CUDA, is not installed"
        if in_features % group or in_features % 2:
            return f"groups of {group} columns over {in_features} (the Triton kernel takes groups dividing the input)"
        return None
    if device.type != "cpu":
        return f"no int4 kernel for {device.type}"
    if dtype != torch.bfloat16:
        return (f"torch's int4 CPU kernel is vectorized for bfloat16 only; with {dtype} activations it runs "
                "9-50x slower than the dequantized weight's product")
    if group not in KERNEL_GROUPS or in_features % group:
        return f"groups of {group} columns over {in_features} (the kernel takes 32, 64, 128 or 256 dividing the input)"
    if out_features % 16:
        return f"{out_features} output rows (the kernel packs multiples of 16)"
    return None


class Int4Linear(QuantizedLayer):
    """Through torch's int4 weight-only CPU kernel: the weight stays 4 bits (half a byte) a
    value, plus a scale and a zero per group."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(codes.shape[0], codes.shape[1], codes.shape[1] // scales.shape[1], bias)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        torch_zeros = (8.0 - zeros) * scales  # the kernel's (q - 8) * s + zero is then (q - z) * s
        scales_and_zeros = torch.stack([scales.t(), torch_zeros.t()], dim=-1).to(dtype).contiguous()  # [groups, out, 2]
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
