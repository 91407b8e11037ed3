"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3/4; Qwen3-MoE and
Mixtral; Gemma 2 and 3) in plain torch, over a paged KV cache.

The batch is flattened: T new tokens of several sequences back to back, each with its
position; ``AttentionMetadata`` says where each sequence starts and where its K/V lives.
Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); the
loader concatenates the Hugging Face weights accordingly (Phi-3's come fused). The
families differ only by ``ModelConfig`` options (biases, q/k norms, partial rotary, a
sliding window, Gemma's activation, norms, scales and soft-caps); a layer listed in
``sparse_layers`` has a sparse mixture-of-experts MLP (``moe.py``) in place of the dense
one.

Layers differ in their attention window (Mistral: all sliding; Gemma: sliding and global
layers interleaved) and, for Gemma 3, in their rotary base: a forward pass builds one
attention plan per distinct window and one cos/sin table per distinct rotary, and gives
each layer its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache, partial

import torch
import torch.nn.functional as F
from torch import nn

from memserve.workers.engine.layer_hooks import NO_HOOKS, LayerHooks
from memserve.workers.model import cpu_kernels
from memserve.workers.model.attention import (
    AttentionMetadata,
    AttentionPlan,
    layer_kv,
    paged_attention,
    tanh_softcap,
)
from memserve.workers.model.linear import (
    ColumnParallelLinear,
    OutputPart,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.moe import SparseMoE
from memserve.workers.model.rope import RotaryEmbedding, apply_rotary
from memserve.workers.model.tensor_parallel import SINGLE, TensorParallel, kv_heads_per_rank, split_evenly

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """Normalised in float32 like Hugging Face's, so low-precision runs match it: Llama's
    (LlamaRMSNorm) scales the result by ``weight`` after casting it back; Gemma's
    (``unit_offset``, GemmaRMSNorm) by ``1 + weight`` before, in float32. With ``fused``
    (set by ``use_fused_pointwise``) a contiguous input takes the one-pass CPU kernel,
    which rounds as these eager ops do."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_contiguous():
            return cpu_kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + residual, x + residual): the residual stream's add and the
        next norm, in one pass where fused."""
        if self.fused and x.is_contiguous() and residual.is_contiguous():
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        total = residual + x
        return self(total), total


class Attention(nn.Module):
    """This rank's heads: its query heads and the KV heads they read (``rank_config``)."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer = layer
        local = rank_config(config, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, config.head_dim
        self.q_size = local.num_heads * config.head_dim
        self.kv_size = local.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        kv_replicas = kv_heads_per_rank(config.num_kv_heads, tp.size)[1]
        kv = OutputPart(config.num_kv_heads * config.head_dim, tp.rank // kv_replicas * self.kv_size, self.kv_size)
        q = OutputPart.split(config.num_heads * config.head_dim, tp, "the number of attention heads")
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q, kv, kv], config.qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, config.o_proj_bias, tp)
        norm = partial(RMSNorm, config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm else None
        # The rotary embedding and the K/V stores through the one-pass CPU kernel (``use_fused_pointwise``)
        self.fused = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent: one rotation for both (fewer, larger kernels).
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3, Gemma 3: each head normalised first
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        k_cache, v_cache = layer_kv(kv_cache, self.layer, plan.layout)
        if self.fused:  # rotated, and K/V stored at their slots, in one pass
            qk = cpu_kernels.rotary_write_kv(qk, v, cos[:, 0], sin[:, 0], k_cache, v_cache, plan.write_blocks,
                                             plan.write_offsets)
        else:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, k_cache, v_cache, plan, self.scale, kv_written=self.fused)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU (or Gemma's GeGLU): down(act(gate(x)) * up(x)), with gate and up fused."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        width = OutputPart.split(config.intermediate_size, tp, "the MLP's intermediate size")
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [width, width], config.mlp_bias, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp)
        self.act = ACTIVATIONS[config.hidden_act]
        self.fused = False  # silu(gate) * up through the one-pass CPU kernel (``use_fused_pointwise``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused and gate_up.is_contiguous():
            return self.down_proj(cpu_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Llama's pre-norm residual blocks. With ``sandwich_norms`` (Gemma) the attention's
    output is normalised too (Gemma's ``post_attention_layernorm``; Llama's is the MLP's
    input norm), and the MLP has norms of its own before and after."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        norm = partial(RMSNorm, config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = norm()
        self.mlp: MLP | SparseMoE = SparseMoE(config, tp) if layer in config.sparse_layers else MLP(config, tp)
        self.pre_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if config.sandwich_norms else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, plan)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            normed, x = self.post_attention_layernorm.add_forward(attended, x)
            return x + self.mlp(normed)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face (``model.layers.N...``, ``lm_head``) except for the
    fused ``qkv_proj`` and ``gate_up_proj``. With ``tp`` of several ranks this is one rank's
    shard (``linear.py``); ``rank_config`` gives the heads and widths it holds."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.rank_config = rank_config(config, tp)
        self.model = LlamaModel(config, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.rotary = RotaryEmbedding(config.rope_parameters, config.rotary_dim)
        local = self.rotary
        if config.local_rope_parameters is not None:
            local = RotaryEmbedding(config.local_rope_parameters, config.rotary_dim)
        # Each layer's rotary: Gemma 3's sliding layers have a base of their own.
        self.layer_rotaries = tuple(local if i in config.sliding_layers else self.rotary
                                    for i in range(config.num_layers))
        self.layer_windows = tuple(config.layer_window(i) for i in range(config.num_layers))  # 0: no window

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        hooks: LayerHooks = NO_HOOKS,
    ) -> torch.Tensor:
        """Run T flattened new tokens through the decoder, writing their K/V into
        ``kv_cache``; returns the final-norm hidden states [T, hidden]. ``hooks`` are
        called around every layer (KV loads and saves overlap the compute)."""
        softcap = self.config.attn_logit_softcapping or 0.0
        plans = AttentionPlan.build_windows(meta, input_ids.device, self.layer_windows, softcap)
        return self.forward_planned(input_ids, positions, kv_cache, plans, hooks)

    @torch.inference_mode()
    def forward_planned(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        plans: dict[int, AttentionPlan],
        hooks: LayerHooks = NO_HOOKS,
    ) -> torch.Tensor:
        """``forward`` over attention plans already built (a CUDA graph's static one), by
        the window of the layers that use them."""
        x = self.model.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * _rounded(self.config.hidden_size**0.5, x.dtype)
        tables = {rotary: rotary.cos_sin(positions, x.dtype) for rotary in dict.fromkeys(self.layer_rotaries)}
        for i, layer in enumerate(self.model.layers):
            hooks.before_layer(i)
            cos, sin = tables[self.layer_rotaries[i]]
            x = layer(x, cos, sin, kv_cache, plans[self.layer_windows[i]])
            hooks.after_layer(i)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the N hidden states that need a next token."""
        logits = self.lm_head(hidden)
        if self.config.final_logit_softcapping is not None:
            logits = tanh_softcap(logits, self.config.final_logit_softcapping)
        return logits.float()


def use_fused_pointwise(model: LlamaForCausalLM) -> int:
    """Let ``model``'s norms, rotary embeddings and SwiGLU MLPs take the fused CPU kernels
    (csrc/fused_pointwise.cpp); returns how many modules will. Only float32 and bf16 models
    on the CPU, only where the kernels build, and Gemma's GeGLU stays eager (the kernel is
    SwiGLU's)."""
    weight = model.model.norm.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.available():
        return 0
    fusable = [m for m in model.modules()
               if isinstance(m, (RMSNorm, Attention)) or (isinstance(m, MLP) and m.act is ACTIVATIONS["silu"])]
    for module in fusable:
        module.fused = True
    return len(fusable)


def rank_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """``config`` as one rank of ``tp`` holds it: its query heads, KV heads (replicated where
    fewer than the ranks) and MLP widths. A model whose heads or widths do not divide by the
    ranks is refused, naming both numbers."""
    if tp.size == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads=split_evenly(config.num_heads, tp.size, "the number of attention heads"),
        num_kv_heads=kv_heads_per_rank(config.num_kv_heads, tp.size)[0],
        intermediate_size=split_evenly(config.intermediate_size, tp.size, "the MLP's intermediate size"),
        moe_intermediate_size=split_evenly(config.moe_intermediate_size, tp.size, "the experts' intermediate size"),
    )


@cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as Gemma's embedding scale is (sqrt(3072) is 55.5 in bf16)."""
    return torch.tensor(value).to(dtype).item()
