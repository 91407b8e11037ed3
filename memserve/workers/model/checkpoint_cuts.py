"""Each rank of a tensor-parallel group reads only its part of the checkpoint's tensors.

A rank holds 1/N of every split layer; reading whole tensors and cutting them afterwards
would have each rank read (and hold, while the model is assembled) the whole model. For
each checkpoint tensor a split layer is made of, ``checkpoint_cuts`` gives the read of
this rank's part: the layer's own cut (``linear.py``: an ``OutputPart``'s rows, a row
layer's input columns, the embedding's vocabulary rows) applied to a ``FileSlice``, whose
``narrow`` reads only those bytes from the safetensors file. A fused projection's parts
(q/k/v, gate/up) are each cut as the fused layer cuts them, so the fused shard is their
cuts side by side, what cutting the fused tensor gives (a checkpoint that stores it
fused, Phi-3's, is cut as the layer cuts it).

Read whole, then cut by the layers (``loader.shard_weights``): everything at one rank,
the checkpoint tensors of a mixture-of-experts' experts (renamed and stacked before they
are cut) and a quantized checkpoint's (``quantization_config.py`` unpacks them first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memserve.workers.model.fused_names import FUSED
from memserve.workers.model.linear import ColumnParallelLinear, OutputPart, RowParallelLinear, VocabParallelEmbedding

Cut = Callable[["FileSlice"], torch.Tensor]


class FileSlice:
    """A checkpoint tensor not read yet (safetensors' slice): ``narrow`` reads one range."""

    def __init__(self, file_slice: Any) -> None:
        self.file_slice = file_slice
        self.shape = tuple(file_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.file_slice[index]


def checkpoint_cuts(model: nn.Module) -> tuple[dict[str, Cut], set[str]]:
    """(checkpoint tensor name -> the read of this rank's part, the model's parameters
    those reads make up) for the split layers of ``model``; nothing at one rank (every
    tensor is read whole)."""
    cuts: dict[str, Cut] = {}
    covered: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear) and module.tp.size > 1:
            # A checkpoint that stores the projection fused (Phi-3's qkv_proj) is cut as the layer cuts it.
            cuts[f"{prefix}.weight"] = cuts[f"{prefix}.bias"] = _fused(module)
            for name, part in zip(_part_names(prefix, len(module.parts)), module.parts):
                cuts[f"{name}.weight"] = cuts[f"{name}.bias"] = _rows(part)
            covered |= {f"{prefix}.weight", f"{prefix}.bias"}
        elif isinstance(module, RowParallelLinear) and module.tp.size > 1:
            cuts[f"{prefix}.weight"] = _columns(module.start, module.in_features)
            covered.add(f"{prefix}.weight")
        elif isinstance(module, VocabParallelEmbedding) and module.tp.size > 1:
            cuts[f"{prefix}.weight"] = _rows(module.part)
            covered.add(f"{prefix}.weight")
    return cuts, covered


def _part_names(prefix: str, count: int) -> list[str]:
    """The checkpoint names of a column layer's parts: a fused projection's separate
    projections, else the layer itself."""
    for fused, parts in FUSED.items():
        if prefix.endswith("." + fused) and len(parts) == count:
            stem = prefix[: -len(fused)]
            return [stem + part for part in parts]
    return [prefix]


def _fused(layer: ColumnParallelLinear) -> Cut:
    return lambda tensor: layer.shard("weight", tensor)  # type: ignore[arg-type]  # narrows as a tensor does


def _rows(part: OutputPart) -> Cut:
    return lambda tensor: part.cut(tensor, 0, 0)  # type: ignore[arg-type]  # FileSlice narrows as a tensor does


def _columns(start: int, width: int) -> Cut:
    return lambda tensor: tensor.narrow(1, start, width)
