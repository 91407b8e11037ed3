"""The shape every quantized linear kernel shares: ``F.linear(x, W, bias)`` where a kernel
computes the product from W's quantized form over contiguous rows [M, in], and the bias
is added after (as ``F.linear`` over the dequantized weight adds it). The kernels are the
subclasses: int4 on the CPU (``int4_linear.py``), int4 and FP8 weight-only on CUDA
(``triton_weight_only.py``), FP8 by FP8 on GPUs with FP8 units (``fp8_linear.py``)."""

from __future__ import annotations

import torch
from torch import nn


class QuantizedLayer(nn.Module):
    """A layer of ``out_features`` x ``in_features`` whose weight a subclass holds quantized
    in groups of ``group`` input columns, computing its product in ``product``."""

    def __init__(self, out_features: int, in_features: int, group: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features, self.group, self.bias = out_features, in_features, group, bias

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"bias={self.bias is not None}")
