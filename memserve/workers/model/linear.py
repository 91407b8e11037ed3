"""The model's linear layers, one family: each holds this rank's shard of its weight and
says how a checkpoint's full tensor is cut to it (``shard``), so one loader serves every
tensor-parallel size (nano-vllm's ``layers/linear.py`` and vLLM's are the shape).

- ``ColumnParallelLinear``: the output rows split across the ranks, part by part: a fused
  projection (q/k/v, gate/up) is several parts, each cut on its own, so rank r holds its
  heads' q, k and v rows side by side. KV heads fewer than the ranks are replicated
  (``tensor_parallel.kv_heads_per_rank``). No communication: each rank's output is its
  heads' (or its share of the MLP's width).
- ``RowParallelLinear``: the input columns split (the heads', the width's share a column
  layer produced); the partial products are summed over the group, then the bias added.
- ``ParallelLMHead`` and ``VocabParallelEmbedding``: the vocabulary's rows split (padded
  to a multiple of the ranks); the head's logits are gathered, the embedding's lookups
  summed (each token's row lives on one rank, the others add zeros).

At one rank every cut is the whole tensor, returned as it is (no copy), and every
product is the ``nn.Linear`` it replaces. LoRA adapters (``lora.py``) add their rows'
low-rank updates to the product, cut to the shard as the weight is: a column layer's B
by its output rows, a row layer's A by its input columns (vLLM's split), so a row
layer's updates are summed over the ranks with its product. How the product is computed is the layer's
``kernel`` where one is set: a oneDNN-packed weight (``packed_linear.py``) or GGUF blocks
(``gguf_linear.py``), made from the shard after loading, in place of the float weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from memserve.workers.model.tensor_parallel import SINGLE, TensorParallel, split_evenly


@dataclass(frozen=True)
class OutputPart:
    """One part of a column layer's output (q, k or v; gate or up; the vocabulary): its
    rows in the full tensor, and which of them this rank holds (``start``, ``local``)."""

    size: int
    start: int
    local: int

    @classmethod
    def split(cls, size: int, tp: TensorParallel, what: str) -> OutputPart:
        local = split_evenly(size, tp.size, what)
        return cls(size, tp.rank * local, local)

    @classmethod
    def padded(cls, size: int, tp: TensorParallel) -> OutputPart:
        """Split into equal shards of ``ceil(size / ranks)`` rows, the last padded with zeros."""
        local = -(-size // tp.size)
        return cls(size, tp.rank * local, local)

    @classmethod
    def whole(cls, size: int) -> OutputPart:
        return cls(size, 0, size)

    def cut(self, full: torch.Tensor, offset: int, dim: int) -> torch.Tensor:
        """This rank's rows of the part found at ``offset`` of ``full`` along ``dim``, zero-padded."""
        end = min(self.start + self.local, self.size)
        rows = full.narrow(dim, offset + self.start, max(0, end - self.start))
        if rows.shape[dim] == self.local:
            return rows
        pad = list(rows.shape)
        pad[dim] = self.local - rows.shape[dim]
        return torch.cat([rows, rows.new_zeros(pad)], dim=dim)


@dataclass
class LoRABatch:
    """Which adapter slot each of the step's rows runs (-1: the base model); None when no
    row runs one. The masks that pick each row's adapter columns are made once a step per
    column layout (``mask``) and shared by the layers of that layout."""

    row_slots: torch.Tensor | None = None
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def set(self, row_slots: torch.Tensor | None) -> None:
        self.row_slots, self.masks = row_slots, {}

    def mask(self, layout: tuple, column_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, columns]: 1 where the column belongs to the row's adapter."""
        assert self.row_slots is not None
        mask = self.masks.get(layout)
        if mask is None:
            mask = self.masks[layout] = (column_slots[None, :] == self.row_slots[:, None]).to(dtype)
        return mask


class ParallelLinear(nn.Module):
    """What the family shares: a weight [out, in] of this rank's shard, an optional bias,
    and the product through ``kernel`` where one replaced the float weight."""

    weight: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel: nn.Module | None = None
        self.loras: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # adapter slot -> this shard's (A, B)
        self.lora_batch: LoRABatch | None = None
        # Every slot's A stacked by rows and B by columns, with each column's slot and the
        # layout's key: a step's updates are two products whatever its mix of adapters.
        self.lora_stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple] | None = None

    @property
    def product_bias(self) -> torch.Tensor | None:
        """The bias added inside the product (a row layer at several ranks adds it after the sum)."""
        return self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            out = self.kernel(x)
        else:
            assert self.weight is not None
            out = F.linear(x, self.weight, self.product_bias)
        batch = self.lora_batch
        if self.lora_stack is not None and batch is not None and batch.row_slots is not None:
            a, b, column_slots, layout = self.lora_stack
            out.addmm_(F.linear(x, a) * batch.mask(layout, column_slots, x.dtype), b.t())
        return out

    def set_lora(self, slot: int, lora: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Hold this shard's (A, B) of the adapter in ``slot`` (None: drop it)."""
        if lora is None:
            self.loras.pop(slot, None)
        else:
            self.loras[slot] = lora
        if not self.loras:
            self.lora_stack = None
            return
        slots = sorted(self.loras)
        a = torch.cat([self.loras[s][0] for s in slots])
        b = torch.cat([self.loras[s][1] for s in slots], dim=1)
        widths = [self.loras[s][0].shape[0] for s in slots]
        column_slots = torch.tensor([s for s, w in zip(slots, widths) for _ in range(w)], device=a.device)
        self.lora_stack = (a, b, column_slots, tuple(zip(slots, widths)))

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's full (A [r, in], B [out, r]) for this layer."""
        raise NotImplementedError

    def set_kernel(self, kernel: nn.Module) -> None:
        """Compute the product through ``kernel`` (made from this shard), dropping the float weight."""
        self.kernel = kernel
        self.weight = None

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint's full ``name`` ("weight" or "bias")."""
        raise NotImplementedError

    def shard_blocks(self, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
        """This rank's part of the weight's GGUF blocks [out, row bytes]; None where the
        cut falls inside a block (the layer then keeps its float weight)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (f", tp={self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else ""))


class ColumnParallelLinear(ParallelLinear):
    """Output rows split across the ranks, each part of a fused output on its own."""

    def __init__(self, in_features: int, parts: Sequence[OutputPart], bias: bool, tp: TensorParallel = SINGLE):
        super().__init__(in_features, sum(p.local for p in parts), bias, tp)
        self.parts = tuple(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return self._cut(full)

    def shard_blocks(self, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
        return self._cut(blocks)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a, self._cut(b)

    def _cut(self, full: torch.Tensor) -> torch.Tensor:
        if all(p.local == p.size for p in self.parts):
            return full
        cuts, offset = [], 0
        for part in self.parts:
            cuts.append(part.cut(full, offset, 0))
            offset += part.size
        return torch.cat(cuts)


def replicated_linear(in_features: int, out_features: int, bias: bool = False) -> ColumnParallelLinear:
    """A layer every rank holds whole (the MoE router)."""
    return ColumnParallelLinear(in_features, [OutputPart.whole(out_features)], bias)


class RowParallelLinear(ParallelLinear):
    """Input columns split across the ranks; the partial products summed over the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 what: str = "the input width"):
        super().__init__(split_evenly(in_features, tp.size, what), out_features, bias, tp)
        self.start = tp.rank * self.in_features

    @property
    def product_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp.size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        if self.tp.size == 1:
            return out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "bias" or self.tp.size == 1:
            return full
        return full.narrow(1, self.start, self.in_features).contiguous()

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shard("weight", a), b

    def shard_blocks(self, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
        if self.tp.size == 1:
            return blocks
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        if self.in_features % block_size:
            return None
        per_rank = self.in_features // block_size * block_bytes
        return blocks.narrow(1, self.tp.rank * per_rank, per_rank).contiguous()


class ParallelLMHead(ColumnParallelLinear):
    """The vocabulary's rows split; the ranks' logits gathered and the padding cut off."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = SINGLE):
        super().__init__(hidden_size, [OutputPart.padded(vocab_size, tp)], False, tp)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.product(x)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[..., : self.vocab_size]


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows split as ``ParallelLMHead``'s are (so a tied head shares
    the shard); a token's row is looked up on the rank that holds it, zeros elsewhere,
    and summed over the group."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.part, self.tp = OutputPart.padded(vocab_size, tp), tp
        self.weight = nn.Parameter(torch.empty(self.part.local, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.part.start
        mine = (local >= 0) & (local < self.part.local)
        rows = F.embedding(local.clamp(0, self.part.local - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(rows)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full if self.part.local == self.part.size else self.part.cut(full, 0, 0)
