"""Hugging Face quantized checkpoints (FP8, AWQ, GPTQ) and ``--quantization fp8`` at load:
which scheme a model runs, and its quantized tensors from the checkpoint to the layers.

``read_scheme`` reads ``config.json``'s ``quantization_config`` at start and refuses, in
one line naming it, a method or variant memserve does not run, and a ``--quantization``
that contradicts the checkpoint. ``take_quantized`` takes the quantized layers' tensors out
of the checkpoint before the float weights are fused, each layer's unpacked into one form
(values [out, in], scales and zeros [out, groups]) and fused as the float weights are
(q/k/v, gate/up: concatenated along the output); ``set_kernels`` cuts each to its rank's
shard as the layer cuts its weight (a row layer's input by whole groups) and makes it the
layer's kernel (``fp8_linear.py``, ``int4_linear.py``, ``triton_weight_only.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memserve.workers.model.fp8_linear import fp8_kernel, fp8_scales, quantize_linears_at_load
from memserve.workers.model.fused_names import fused_parts
from memserve.workers.model.gguf_linear import QUANTIZATIONS
from memserve.workers.model.int4_linear import (
    Int4Linear,
    dequantize,
    int4_kernel_refusal,
    unpack_awq,
    unpack_gptq,
)
from memserve.workers.model.linear import ParallelLinear, RowParallelLinear
from memserve.workers.model.quantized_layer import QuantizedLayer

_INT4_TENSORS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class Scheme:
    """How the model's linear layers run quantized: ``method`` (fp8, awq, gptq); FP8 weights'
    scale tensor name and block shape (rows, columns; None: per channel or per tensor);
    GPTQ v1's zeros stored minus one; ``at_load``: FP8 made from float weights at load."""

    method: str
    scale_name: str = ""
    block: tuple[int, int] | None = None
    zeros_minus_one: bool = False
    at_load: bool = False

    def keeps(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether the checkpoint's floating ``tensor`` is kept as stored, not cast to the
        model's dtype: FP8 values and the quantized weights' scales."""
        if self.method == "fp8":
            return tensor.element_size() == 1 or (bool(self.scale_name) and name.endswith("." + self.scale_name))
        return name.endswith(".scales")


def read_scheme(folder: Path, quantization: str) -> Scheme | None:
    """The scheme the model in ``folder`` runs under ``--quantization``; None: float weights
    (or a converted GGUF file's, ``gguf_linear.py``'s business)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")
    config = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if config is None:
        if quantization in ("awq", "gptq"):
            raise ValueError(f"--quantization {quantization} cannot serve {folder}: it has no quantization_config "
                             "(memserve quantizes float weights at load only to fp8)")
        return Scheme("fp8", at_load=True) if quantization == "fp8" else None
    method = config.get("quant_method")
    if method not in _PARSERS:
        raise ValueError(f"{folder}: quantization_config with quant_method {method!r} is not supported (memserve "
                         "runs fp8, compressed-tensors FP8, awq and gptq checkpoints, GGUF files and float ones)")
    try:
        scheme = _PARSERS[method](config)
    except ValueError as why:
        raise ValueError(f"{folder}: quantization_config with quant_method {method!r}: {why}") from None
    if quantization == "none":
        raise ValueError(f"{folder}: quantization_config with quant_method {method!r} is not supported with "
                         f"--quantization none: its weights ship quantized (serve it with auto or {scheme.method})")
    if quantization not in ("auto", scheme.method):
        raise ValueError(f"--quantization {quantization} contradicts {folder}'s quantization_config "
                         f"(quant_method {method!r}, served as {scheme.method})")
    return scheme


def _fp8_scheme(config: dict[str, Any]) -> Scheme:
    """Hugging Face's FP8 (transformers' FineGrainedFP8, Qwen3-FP8): block scales
    ``weight_scale_inv`` where ``weight_block_size`` is set, else a ``weight_scale`` per tensor."""
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise ValueError(f"activation_scheme {activations!r} (static activation scales) is not built; dynamic is")
    block = config.get("weight_block_size")
    if block is None:
        return Scheme("fp8", scale_name="weight_scale")
    if len(block) != 2:
        raise ValueError(f"weight_block_size {block} is not [rows, columns]")
    return Scheme("fp8", scale_name="weight_scale_inv", block=(int(block[0]), int(block[1])))


def _compressed_tensors_scheme(config: dict[str, Any]) -> Scheme:
    """compressed-tensors' float-quantized FP8 weights, scaled per tensor, channel or block."""
    if config.get("format") != "float-quantized":
        raise ValueError(f"format {config.get('format')!r} is not supported (memserve runs float-quantized FP8)")
    if config.get("kv_cache_scheme"):
        raise ValueError("kv_cache_scheme is not supported: its calibrated KV scales are not read "
                         "(--kv-cache-dtype fp8 stores KV in e4m3 with scale 1.0)")
    blocks: set[tuple[int, int] | None] = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"config group {name!r}: {weights.get('num_bits')}-bit {weights.get('type')} weights "
                             "are not supported (memserve runs 8-bit float)")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"config group {name!r}: weight strategy {weights.get('strategy')!r} is not supported")
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic"):
            raise ValueError(f"config group {name!r}: static input activation scales are not built; dynamic are")
        blocks.add(_block(name, weights) if weights["strategy"] == "block" else None)
    if len(blocks) > 1:
        raise ValueError(f"config groups of different weight blocks {sorted(map(str, blocks))} are not supported")
    return Scheme("fp8", scale_name="weight_scale", block=blocks.pop() if blocks else None)


def _block(group: str, weights: dict[str, Any]) -> tuple[int, int]:
    structure = weights.get("block_structure")
    if not isinstance(structure, list) or len(structure) != 2:
        raise ValueError(f"config group {group!r}: block_structure {structure!r} is not [rows, columns]")
    return int(structure[0]), int(structure[1])


def _int4_bits(config: dict[str, Any]) -> None:
    if config.get("bits") != 4:
        raise ValueError(f"bits {config.get('bits')!r} is not supported (memserve runs 4-bit)")


def _awq_scheme(config: dict[str, Any]) -> Scheme:
    """AutoAWQ's GEMM format with zero points (transformers' AwqConfig defaults)."""
    _int4_bits(config)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"version {version!r} is not supported (memserve runs AWQ's gemm packing)")
    if not config.get("zero_point", True):
        raise ValueError("zero_point false is not supported")
    return Scheme("awq")


def _gptq_scheme(config: dict[str, Any]) -> Scheme:
    """GPTQ with the input's groups in order; v1 (AutoGPTQ's) or v2 checkpoint format."""
    _int4_bits(config)
    if config.get("desc_act"):
        raise ValueError("desc_act true (groups in activation order) is not supported")
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format {checkpoint_format!r} is not supported (memserve runs gptq, gptq_v2)")
    return Scheme("gptq", zeros_minus_one=checkpoint_format == "gptq")


# A checkpoint's quant_method -> its scheme (served by --quantization auto or the scheme's method).
_PARSERS = {"fp8": _fp8_scheme, "compressed-tensors": _compressed_tensors_scheme, "awq": _awq_scheme,
            "gptq": _gptq_scheme}


@dataclass
class QuantizedWeight:
    """One layer's quantized weight: values [out, in] (FP8, or 4-bit codes in uint8), scales
    [out, groups] (float32) and, for 4-bit codes, zeros [out, groups]."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]

    def cut(self, layer: ParallelLinear, name: str) -> QuantizedWeight:
        """This rank's shard: the layer's cut of the values; of the scales and zeros, a
        column layer's output rows, a row layer's whole groups (one group: kept whole)."""
        values = layer.shard("weight", self.values)
        if not isinstance(layer, RowParallelLinear):
            return QuantizedWeight(values, layer.shard("weight", self.scales),
                                   None if self.zeros is None else layer.shard("weight", self.zeros))
        if layer.tp.size == 1 or self.scales.shape[1] == 1:
            return QuantizedWeight(values, self.scales, self.zeros)
        if layer.start % self.group or layer.in_features % self.group:
            raise ValueError(f"{name}: this rank's {layer.in_features} input columns from {layer.start} cut "
                             f"groups of {self.group}; use another --tensor-parallel-size")
        first, count = layer.start // self.group, layer.in_features // self.group
        return QuantizedWeight(values, self.scales.narrow(1, first, count).contiguous(),
                               None if self.zeros is None else self.zeros.narrow(1, first, count).contiguous())


def take_quantized(checkpoint: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, QuantizedWeight]:
    """The quantized layers' tensors, popped from ``checkpoint`` (what is left are float
    weights), unpacked, by the model's weight names (fused projections fused)."""
    if scheme.method == "fp8":
        names = [n for n in checkpoint if n.endswith(".weight") and checkpoint[n].is_floating_point()
                 and checkpoint[n].element_size() == 1]
    else:
        names = [n for n in checkpoint if n.endswith(".qweight")]
    layers = {}
    for name in names:
        prefix = name.rsplit(".", 1)[0]
        if ".experts." in prefix:
            raise ValueError(f"{prefix}: quantized mixture-of-experts experts are not supported")
        layers[f"{prefix}.weight"] = _unpack(checkpoint, prefix, scheme)
    return _fused(layers)


def _pop(checkpoint: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in checkpoint:
        raise ValueError(f"the quantized checkpoint has no {name}")
    return checkpoint.pop(name)


def _unpack(checkpoint: dict[str, torch.Tensor], prefix: str, scheme: Scheme) -> QuantizedWeight:
    """One checkpoint layer's quantized tensors in ``QuantizedWeight``'s form."""
    if scheme.method == "fp8":
        values = checkpoint.pop(f"{prefix}.weight")
        scale = _pop(checkpoint, f"{prefix}.{scheme.scale_name}")
        return QuantizedWeight(values, fp8_scales(scale, values.shape[0], values.shape[1], scheme.block), None)
    qweight, qzeros, scales = (_pop(checkpoint, f"{prefix}.{kind}") for kind in _INT4_TENSORS)
    checkpoint.pop(f"{prefix}.g_idx", None)  # with desc_act false, the groups in order: the shapes say it
    if scheme.method == "awq":
        return QuantizedWeight(*unpack_awq(qweight, qzeros, scales))
    return QuantizedWeight(*unpack_gptq(qweight, qzeros, scales, scheme.zeros_minus_one))


def _fused(layers: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """``layers`` with each fused projection's parts concatenated along the output."""
    out = dict(layers)
    for name in layers:
        fused = fused_parts(name)
        if fused is None:
            continue
        ours, parts = fused
        if any(part not in layers for part in parts):
            raise ValueError(f"{ours}: some of {parts} are quantized, some not")
        weights = [out.pop(part) for part in parts]
        zeros = [w.zeros for w in weights if w.zeros is not None]
        out[ours] = QuantizedWeight(torch.cat([w.values for w in weights]), torch.cat([w.scales for w in weights]),
                                    torch.cat(zeros) if zeros else None)
    return out


def int4_kernel(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> QuantizedLayer:
    """A layer's int4 product where ``int4_kernel_refusal`` found nothing against one:
    Triton's on CUDA, torch's on the CPU."""
    if codes.device.type == "cuda":
        from memserve.workers.model.triton_weight_only import TritonInt4Linear  # imports triton: only where it runs

        return TritonInt4Linear(codes, scales, zeros, bias)
    return Int4Linear(codes, scales, zeros, bias, dtype)


def set_kernels(model: nn.Module, weights: dict[str, QuantizedWeight], scheme: Scheme, dtype: torch.dtype) -> str:
    """Give each linear layer of ``model`` whose weight is in ``weights`` (all of them, with
    ``scheme.at_load``) the kernel over its shard; returns what was done, for the log."""
    if scheme.at_load:
        return f"{quantize_linears_at_load(model, dtype)} linear layers quantized to fp8 at load"
    kernels, widened = 0, Counter[str]()
    for name, layer in model.named_modules():
        if not isinstance(layer, ParallelLinear) or f"{name}.weight" not in weights:
            continue
        weight = weights.pop(f"{name}.weight").cut(layer, name)
        if weight.zeros is None:
            layer.set_kernel(fp8_kernel(weight.values, weight.scales, layer.product_bias, dtype))
            kernels += 1
            continue
        out_features, in_features = weight.values.shape
        refusal = int4_kernel_refusal(out_features, in_features, weight.group, dtype, weight.values.device)
        if refusal is None:
            layer.set_kernel(int4_kernel(weight.values, weight.scales, weight.zeros, layer.product_bias, dtype))
            kernels += 1
        else:
            layer.weight = nn.Parameter(dequantize(weight.values, weight.scales, weight.zeros, dtype),
                                        requires_grad=False)
            widened[refusal] += 1
    if weights:
        raise ValueError(f"quantized weights the model has no linear layer for: {sorted(weights)[:5]}")
    done = f"{kernels} linear layers run {scheme.method} quantized"
    return done + "".join(f"; {n} dequantized at load ({why})" for why, n in widened.items())
