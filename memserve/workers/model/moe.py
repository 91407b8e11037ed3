"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): each token runs through the
``num_experts_per_tok`` experts its router picks, and their outputs are summed, weighted.

Routing follows transformers exactly: softmax over the router logits in float32, the top k
probabilities, renormalised to sum to 1 where the family does (``norm_topk_prob``; Mixtral
always). Each expert is a SwiGLU MLP like the dense one. An expert's output is weighted in
float32 and then rounded to the model's dtype, as transformers' Mixtral does (its
Qwen3-MoE rounds the weight to bf16 first: one bf16 rounding apart, equal in float32).

Invariants:

- Experts' weights are stacked per layer, ``experts.gate_up_proj`` [E, 2 * I, H] (gate
  rows first) and ``experts.down_proj`` [E, H, I]: transformers 5's own layout and names;
  the loader stacks the per-expert tensors of Hugging Face checkpoints into them.
- No expert computes a token it was not chosen for: the T * k (token, expert) pairs are
  sorted by expert, and one grouped GEMM (``F.grouped_mm``) runs each expert over its
  contiguous slice of rows. Cost is that of the chosen experts only, never E dense MLPs.
- The grouping is computed on the device (no host round trip of per-expert counts here);
  torch's generic grouped-GEMM kernel (any dtype but bf16 on Hopper and Blackwell) still
  reads the offsets on the host, so only there are MoE models captured in CUDA graphs
  (``decode_graphs.eager_reason``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memserve.workers.model.linear import OutputPart, replicated_linear
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.tensor_parallel import SINGLE, TensorParallel


class Experts(nn.Module):
    """The stacked weights of a layer's experts: with tensor parallelism every rank holds
    every expert, cut by the intermediate size (its share of gate's and of up's rows, the
    same share of down's columns), so the experts' outputs are partial sums."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.width = OutputPart.split(intermediate_size, tp, "the experts' intermediate size")
        local = self.width.local
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local), requires_grad=False)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint's stacked ``name`` (gate_up_proj or down_proj)."""
        if self.width.local == self.width.size:
            return full
        if name == "down_proj":
            return self.width.cut(full, 0, 2).contiguous()
        return torch.cat([self.width.cut(full, 0, 1), self.width.cut(full, self.width.size, 1)], dim=1)


class SparseMoE(nn.Module):
    """Router (``gate``) and experts of one layer: down(silu(gate(x)) * up(x)) per chosen expert."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.tp = tp
        self.gate = replicated_linear(config.hidden_size, config.num_experts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights, expert ids), both [T, k], of the experts each token goes to."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat_experts = experts.flatten()  # pair p = token p // k, its (p % k)-th expert
        order = torch.argsort(flat_experts, stable=True)
        tokens = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat_experts.to(torch.int32), torch.ones_like(flat_experts, dtype=torch.int32))
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # end of each expert's rows
        rows = x[tokens]
        gate, up = F.grouped_mm(rows, self.experts.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, self.experts.down_proj.transpose(1, 2), offs=offsets)
        weighted = (out * weights.flatten()[order, None]).to(x.dtype)
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, tokens, weighted))
