"""Linear layers over FP8 (e4m3) weights: Hugging Face's block-scaled FP8 checkpoints
(Qwen3-FP8, DeepSeek: ``weight_scale_inv`` per 128x128 block), compressed-tensors'
float-quantized ones (``weight_scale`` per output channel or per tensor), and float
checkpoints quantized at load by ``--quantization fp8``.

The CPU has no FP8 product, so the weight stays FP8 in memory (1 byte a value, plus its
scales, held as [out, groups]: one column per block of input columns, one for a channel's
or the tensor's scale) and every product widens it: fp8 * scale computed in float32,
rounded once to the model's dtype, then ``F.linear``. That is the dequantized model's
product, so a checkpoint served this way gives the tokens of its weights dequantized.
The widening costs far more than the product it feeds (torch has no fast FP8 path on
the CPU): on a 2048x2048 layer, one thread, about 8 ms against 0.5-1 ms for a product
with the float weight held widened.

Activations: a checkpoint's dynamic per-token activation scheme is not applied. vLLM
quantizes activations so that GPUs with FP8 units multiply FP8 by FP8; widening the weight
on the CPU gains nothing from it, and leaving it out keeps the dequantized model's tokens
exactly. Quantizing at load (``quantize_linears_at_load``) is vLLM's online FP8 instead,
simulated as it computes: weights per output channel, and each token's activations rounded
to e4m3 at its own scale (amax / 448) and back before the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memserve.workers.model.linear import ParallelLinear, ParallelLMHead

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale
# ``bits_as_bfloat16`` reads e4m3 bits as a bfloat16 2^-120 times the value (the
# exponent biases are 7 and 127); the scales carry the factor back.
_BIAS_FACTOR = 2.0**120


def fp8_scales(scale: torch.Tensor, out_features: int, in_features: int,
               block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor: one value; per channel: [out, 1]; per
    block: [ceil(out / rows), in / columns]) as [out, groups] float32, each row its output's."""
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(out_features, 1).contiguous()
    if block is None:
        return scale.float().reshape(out_features, 1)
    rows, columns = block
    if in_features % columns or scale.shape[1] * columns != in_features:
        raise ValueError(f"FP8 block scales {tuple(scale.shape)} of {columns}-column blocks do not tile "
                         f"{in_features} input columns")
    return scale.float().repeat_interleave(rows, dim=0)[:out_features].contiguous()


def bits_as_bfloat16(values: torch.Tensor) -> torch.Tensor:
    """e4m3 ``values`` as bfloat16s of 2^-120 times their value, subnormals included: the
    sign moved to bit 15, exponent and mantissa to bits 4-10. Four integer passes over
    int16 take a third of the time of torch's float8 conversion on the CPU."""
    bits = values.view(torch.uint8).to(torch.int16)
    magnitude = (bits & 0x7F).bitwise_left_shift_(4)
    return bits.bitwise_and_(0x80).bitwise_left_shift_(8).bitwise_or_(magnitude).view(torch.bfloat16)


def quantize_to_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as e4m3 values with one scale per output channel (amax / 448)."""
    scales = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return (weight.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def round_per_token(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` quantized to e4m3 at its own scale and widened back (vLLM's dynamic
    per-token activation quantization, as its product sees it)."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return ((x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scales).to(x.dtype)


class Fp8Linear(nn.Module):
    """``F.linear(x, fp8 * scale, bias)``: the FP8 weight [out, in] widened at each product."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, per_token_activations: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % scales.shape[1]:
            raise ValueError(f"{scales.shape[1]} scale groups do not tile {self.in_features} input columns")
        if weight.dtype != FP8:
            raise ValueError(f"FP8 weights of {weight.dtype} are not supported (memserve runs {FP8})")
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales * _BIAS_FACTOR, persistent=False)  # exact: a power of two
        self.bias, self.dtype, self.per_token_activations = bias, dtype, per_token_activations

    def widened(self) -> torch.Tensor:
        """The dequantized weight in the model's dtype: fp8 * scale in float32, rounded once."""
        groups = self.scales.shape[1]
        weight = bits_as_bfloat16(self.weight).view(self.out_features, groups, -1) * self.scales[:, :, None]
        return weight.view(self.out_features, self.in_features).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_token_activations:
            x = round_per_token(x)
        return F.linear(x, self.widened(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scale_groups={self.scales.shape[1]}, per_token_activations={self.per_token_activations}")


def quantize_linears_at_load(model: nn.Module, dtype: torch.dtype) -> int:
    """Give each linear layer of ``model`` but the lm_head and MoE routers (which vLLM keeps
    in float too) an ``Fp8Linear`` over its shard quantized per channel, activations per
    token; returns how many got one."""
    replaced = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, ParallelLinear) or isinstance(layer, ParallelLMHead) or name.endswith("mlp.gate"):
            continue
        assert layer.weight is not None
        weight, scales = quantize_to_fp8(layer.weight)
        layer.set_kernel(Fp8Linear(weight, scales, layer.product_bias, dtype, per_token_activations=True))
        replaced += 1
    return replaced
