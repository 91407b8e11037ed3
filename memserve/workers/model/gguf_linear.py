"""Linear layers whose weights stay GGUF-quantized in memory (Q4_0, Q4_1, Q8_0 and the
K-quants Q4_K, Q5_K, Q6_K), on the CPU.

A decode step reads every weight once, so its time is the weights' bytes over the memory
bandwidth: kept as the file stores them (4.5-8.5 bits a weight), SmolLM2's linear layers
are about a fifth of their float32 bytes. Steps of few rows (decode batches) multiply the
blocks directly (csrc/gguf_linear.cpp). The kernel's cost grows with the rows where a
oneDNN-packed float weight reuses each weight across rows, so longer chunks (prefills,
larger batches) go elsewhere: under ``--quantization auto`` to the same weight widened and
packed, kept beside the blocks (past ``WIDE_FROM_ROWS`` rows, the crossover measured in
float32 and bf16), under ``gguf`` (the blocks alone, the least memory) through the weight
widened for the one product. Those are the dequantized weight's products up to float
rounding. The decode rows' products of Q4_0, Q4_1, Q8_0, Q4_K and Q5_K weights are
integer dot products (VNNI, on a CPU with AVX-512 VNNI) over activations quantized per
32-block as llama.cpp does (int8, d = max|x| / 127), by default with the rounding error
quantized again into a second int8 digit: about twice as fast as float32 activations per
row for the 32-weight blocks (1.2-1.4x for the K-quants), and
within 1/256 of int8's error, so the tokens stay the float32 folder's (converted from the
same file, ``model_files/gguf_convert.py``, what ``--quantization none`` runs); int8 alone
is faster still but changed the greedy tokens of 10 of 32 ShareGPT prompts on SmolLM2.
``activation_bits`` 8 chooses it, 32 float32 (Q6_K always has float32).

``quantize_linears`` makes these the kernels of a loaded model's linear layers
(``linear.py``) where the converted folder holds their blocks, cut to the rank's shard as
its float weight is; fused projections (q/k/v, gate/up) take their parts' blocks
concatenated by rows, when all parts share one type.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from safetensors import safe_open
from torch import nn

from memserve.model_files.gguf_convert import QUANTIZED_FILE, QUANTIZED_TYPES
from memserve.workers.model import cpu_kernels
from memserve.workers.model.fused_names import fused_parts
from memserve.workers.model.linear import ParallelLinear
from memserve.workers.model.packed_linear import PackedLinear

QUANTIZATIONS = ("auto", "none", "gguf", "fp8", "awq", "gptq")  # the last three: quantization_config.py


# Rows past which a layer that keeps its weight widened multiplies by it rather than by the
# blocks, by activation dtype: on one SmolLM2 gate/up layer (576 x 3,072, in cache, one
# thread; benchmarks/micro/gguf_int8_micro.py --packed) the blocks' integer products took
# 0.59x the packed float32 weight's time at 8 rows, 0.91x at 16; against bf16's packed
# weight (AMX) 1.2x at 8, 1.8x at 12, 2.3x at 16. A decode step reads its weights from
# memory, where the blocks' fewer bytes gain (float32 decode x16: 0.71x --quantization none).
WIDE_FROM_ROWS = {torch.float32: 16, torch.bfloat16: 8}


class GGUFLinear(nn.Module):
    """``nn.Linear`` (no bias) over GGUF blocks [out_features, row bytes] of one ggml type;
    ``wide``: the same weight widened (oneDNN-packed), for chunks past ``WIDE_FROM_ROWS`` rows;
    ``activation_bits``: how decode rows' activations are held where the kernel has integer
    products (see above): 8, 16 (two int8 digits) or 32 (float32)."""

    blocks: torch.Tensor  # a buffer, registered in __init__: it moves with the module

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype,
                 wide: nn.Module | None = None, activation_bits: int = 16):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, blocks.shape[0]
        self.dtype = dtype
        self.wide = wide
        self.activation_bits = activation_bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.wide is not None and rows.shape[0] > WIDE_FROM_ROWS.get(self.dtype, 8):
            out = self.wide(rows)
        elif rows.shape[0] <= cpu_kernels.GGUF_MATMUL_MAX_ROWS:
            out = cpu_kernels.gguf_matmul(rows.contiguous(), self.blocks, self.ggml_type, self.activation_bits)
        else:
            weight = cpu_kernels.gguf_dequantize(self.blocks, self.ggml_type, self.in_features, x.dtype)
            out = F.linear(rows, weight)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ggml_type={self.ggml_type}"


def read_blocks(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The quantized linear weights a converted GGUF folder holds, and their ggml types;
    empty where it holds none (a Hugging Face checkpoint, a float GGUF)."""
    path = folder / QUANTIZED_FILE
    if not path.is_file():
        return {}, {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        blocks = {name: f.get_tensor(name) for name in f.keys()}
    return blocks, {name: int(metadata[name]) for name in blocks}


def fused_blocks(blocks: dict[str, torch.Tensor],
                 types: dict[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """``blocks`` under the model's parameter names: the parts of each fused projection
    (``fused_names``, as the loader fuses float weights) concatenated by rows where they
    share one type, dropped otherwise (that projection then runs on its float weights)."""
    out, out_types = dict(blocks), dict(types)
    for name in blocks:
        fused = fused_parts(name)
        if fused is None:
            continue
        ours, parts = fused
        found = [part for part in parts if part in blocks]
        for part in found:
            out.pop(part)
            out_types.pop(part)
        if len(found) == len(parts) and len({types[part] for part in parts}) == 1:
            out[ours] = torch.cat([blocks[part] for part in parts])
            out_types[ours] = types[parts[0]]
    return out, out_types


def use_quantized(quantization: str, folder: Path, device: torch.device) -> bool:
    """Whether the model in ``folder`` runs its GGUF-quantized weights as they are:
    ``auto`` where it has some and this is a CPU with the kernels; ``gguf`` insists; the
    other methods (``quantization_config.py``) run its float weights."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")
    if quantization not in ("auto", "gguf"):
        return False
    has_blocks = (folder / QUANTIZED_FILE).is_file()
    runnable = device.type == "cpu" and cpu_kernels.available()
    if quantization == "gguf" and not (has_blocks and runnable):
        types = ", ".join(t.name for t in sorted(QUANTIZED_TYPES))
        why = (f"it holds no GGUF weights of a type run quantized ({types})" if not has_blocks
               else "GGUF weights run quantized only on the CPU, with memserve's CPU kernels built")
        raise ValueError(f"--quantization gguf cannot serve {folder}: {why}")
    return has_blocks and runnable


def quantize_linears(model: nn.Module, blocks: dict[str, torch.Tensor], types: dict[str, int],
                     dtype: torch.dtype, keep_wide: bool = False) -> int:
    """Give each bias-free linear layer of ``model`` whose weight (by parameter name) is in
    ``blocks`` a ``GGUFLinear`` kernel over its shard of them, with its float weight packed
    for oneDNN beside them when ``keep_wide``; returns how many got one."""
    replaced = 0
    for name, layer in model.named_modules():
        weight = f"{name}.weight"
        if not isinstance(layer, ParallelLinear) or weight not in blocks or layer.bias is not None:
            continue
        shard = layer.shard_blocks(blocks[weight], types[weight])
        if shard is not None:
            wide = PackedLinear(layer.weight, None) if keep_wide and layer.weight is not None else None
            layer.set_kernel(GGUFLinear(shard, types[weight], layer.in_features, dtype, wide))
            replaced += 1
    return replaced


def describe(types: dict[str, int]) -> str:
    """Counts of the quantized weights by ggml type, for the log."""
    return json.dumps(Counter(GGMLQuantizationType(t).name for t in types.values()))
