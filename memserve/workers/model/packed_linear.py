"""Linear layers whose weights are prepacked for oneDNN, the CPU path vLLM takes too.

torch's ``F.linear`` on CPU multiplies by the row-major weight as stored; oneDNN, given the
weight once reordered into its blocked layout, runs the same float32 (or bf16) product
1.9-2.5x faster on this machine's AVX-512 core at every batch from 1 to 256 rows
(``benchmarks/micro/packed_linear_micro.py``). The reorder is done once, when the model is
loaded; the packed weight becomes the layer's kernel (``linear.py``) and the plain one is
dropped, so memory stays the same except for a tied ``lm_head``, which gets a packed copy
of the embedding (the embedding lookup needs the plain table). Results equal ``F.linear``'s up to float rounding (a different summation
order), so greedy outputs still match Hugging Face's in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from memserve.workers.model.linear import ParallelLinear

# The batch size oneDNN picks its blocking for: from 8 up every hint measured the same at
# 1-256 rows; hint 1 picks a matrix-vector layout that is 1.6x slower from 8 rows on.
_BATCH_HINT = 32
CPU_GEMMS = ("onednn", "torch")


class PackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` over a oneDNN-packed copy of ``weight``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packs float32 on any x86 CPU it supports, bf16 only where the CPU has it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> int:
    """Give every linear layer of ``model`` that multiplies its float weight a packed copy
    of it as its kernel; returns how many were packed."""
    targets = [m for m in model.modules() if isinstance(m, ParallelLinear) and m.kernel is None]
    for layer in targets:
        assert layer.weight is not None
        layer.set_kernel(PackedLinear(layer.weight, layer.product_bias))
    return len(targets)
