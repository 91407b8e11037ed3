"""Linear layers over FP8 (e4m3) weights: Hugging Face's block-scaled FP8 checkpoints
(Qwen3-FP8, DeepSeek: ``weight_scale_inv`` per 128x128 block), compressed-tensors'
float-quantized ones (``weight_scale`` per output channel or per tensor), and float
checkpoints quantized at load by ``--quantization fp8``. The weight stays FP8 in memory
(1 byte a value, plus its scales, held as [out, groups]: one column per block of input
columns, one for a channel's or the tensor's scale); ``fp8_product`` picks the product:

- **On GPUs with FP8 units** (Ada, Hopper), one scale a channel: FP8 by FP8 through
  ``torch._scaled_mm`` (``Fp8ScaledMmLinear``), each token's activations quantized at its
  own scale (amax / 448), as vLLM computes.
- **On other GPUs, and for block scales**: the weight-only Triton kernel
  (``triton_weight_only.TritonFp8Linear``), the dequantized weight's product read at one
  byte a weight.
- **On the CPU**: every product widens the weight (``Fp8Linear``): fp8 * scale computed in
  float32, rounded once to the model's dtype, then ``F.linear``. That is the dequantized
  model's product, so a checkpoint served this way gives the tokens of its weights
  dequantized; the widening costs far more than the product it feeds (on a 2048x2048
  layer, one thread, about 8 ms against 0.5-1 ms for a product with the float weight
  held widened).

Activations: where the product is not FP8 by FP8, a checkpoint's dynamic per-token
activation scheme is not applied (widening the weight gains nothing from it, and leaving
it out keeps the dequantized model's tokens exactly). Quantizing at load
(``quantize_linears_at_load``) is vLLM's online FP8: weights per output channel, and on
the CPU each token's activations rounded to e4m3 at its own scale and back before the
product, as FP8 units would see them.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from memserve.workers.model.linear import ParallelLinear, ParallelLMHead
from memserve.workers.model.quantized_layer import QuantizedLayer

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


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` as e4m3 values at its own scale (amax / 448), and the scales [rows,
    1] in float32: vLLM's dynamic per-token activation quantization."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def round_per_token(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` quantized to e4m3 at its own scale and widened back (the
    activations as an FP8 by FP8 product sees them)."""
    values, scales = quantize_per_token(x)
    return (values.float() * scales).to(x.dtype)


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


class Fp8ScaledMmLinear(QuantizedLayer):
    """FP8 by FP8 products through ``torch._scaled_mm`` over a weight with one scale per
    output channel (or per tensor): each token's activations quantized to e4m3 at its own
    scale, the product's float32 sums scaled by the token's and the channel's scales.
    vLLM's product on GPUs with FP8 units (Ada, Hopper): twice bf16's tensor throughput and
    one byte a weight read. torch runs the same call on the CPU, which the tests use."""

    weight: torch.Tensor
    channel_scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        out_features, in_features = weight.shape
        if scales.shape[1] != 1:
            raise ValueError(f"torch._scaled_mm takes one scale a channel, not {scales.shape[1]} groups")
        super().__init__(out_features, in_features, in_features, bias)
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("channel_scales", scales.float().reshape(1, out_features).contiguous(), persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        values, scales = quantize_per_token(rows)
        return torch._scaled_mm(values, self.weight.t(), scale_a=scales, scale_b=self.channel_scales,
                                out_dtype=rows.dtype)


def fp8_product(out_features: int, in_features: int, groups: int, dtype: torch.dtype,
                capability: tuple[int, int] | None) -> str:
    """Which product an FP8 layer runs where ``capability`` is the CUDA device's (None: the
    CPU): "scaled_mm" with FP8 units (compute capability 8.9 and up) for one scale a
    channel, bf16 and dimensions in multiples of 16 (what ``torch._scaled_mm`` takes there);
    "triton" (weight-only, ``triton_weight_only.py``) on other GPUs and for block scales;
    "widen" (``Fp8Linear``) on the CPU and where Triton is missing."""
    if capability is None:
        return "widen"
    if (capability >= (8, 9) and groups == 1 and dtype == torch.bfloat16
            and out_features % 16 == 0 and in_features % 16 == 0):
        return "scaled_mm"
    return "triton" if importlib.util.find_spec("triton") is not None else "widen"


def fp8_kernel(weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               per_token_activations: bool = False) -> nn.Module:
    """A layer's FP8 product on the weight's device (``fp8_product`` says which).
    ``per_token_activations`` (quantized at load): the widening product rounds each
    token's activations as ``_scaled_mm`` quantizes them; the weight-only kernel leaves
    them as they are, as vLLM's FP8 on GPUs without FP8 units does."""
    device = weight.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    product = fp8_product(weight.shape[0], weight.shape[1], scales.shape[1], dtype, capability)
    if product == "scaled_mm":
        return Fp8ScaledMmLinear(weight, scales, bias)
    if product == "triton":
        from memserve.workers.model.triton_weight_only import TritonFp8Linear  # imports triton: only where it runs

        return TritonFp8Linear(weight, scales, bias)
    return Fp8Linear(weight, scales, bias, dtype, per_token_activations=per_token_activations)


def quantize_linears_at_load(model: nn.Module, dtype: torch.dtype) -> int:
    """Give each linear layer of ``model`` but the lm_head and MoE routers (which vLLM keeps
    in float too) an FP8 product over its shard quantized per channel, activations per
    token; returns how many got one."""
    replaced = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, ParallelLinear) or isinstance(layer, ParallelLMHead) or name.endswith("mlp.gate"):
            continue
        assert layer.weight is not None
        weight, scales = quantize_to_fp8(layer.weight)
        layer.set_kernel(fp8_kernel(weight, scales, layer.product_bias, dtype, per_token_activations=True))
        replaced += 1
    return replaced
