"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3/4; Qwen3-MoE and
Mixtral) in plain torch, over a paged KV cache.

The batch is flattened: T new tokens of several sequences back to back, each with its
position; ``AttentionMetadata`` says where each sequence starts and where its K/V lives.
Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); the
loader concatenates the Hugging Face weights accordingly (Phi-3's come fused). The
families differ only by ``ModelConfig`` options (biases, q/k norms, partial rotary, a
sliding window); a layer listed in ``sparse_layers`` has a sparse mixture-of-experts MLP
(``moe.py``) in place of the dense one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memserve.workers.engine.layer_hooks import NO_HOOKS, LayerHooks
from memserve.workers.model.attention import (
    AttentionMetadata,
    AttentionPlan,
    layer_kv,
    paged_attention,
)
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.moe import SparseMoE
from memserve.workers.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Computed in float32 like Hugging Face's LlamaRMSNorm, so low-precision runs match it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

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
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: each head normalised first
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        k_cache, v_cache = layer_kv(kv_cache, self.layer, plan.layout)
        out = paged_attention(q, k, v, k_cache, v_cache, plan, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoE = SparseMoE(config) if layer in config.sparse_layers else MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face (``model.layers.N...``, ``lm_head``) except for the
    fused ``qkv_proj`` and ``gate_up_proj``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope_parameters, config.rotary_dim)
        # Whether CUDA graphs may capture the decode step: not a sparse MLP, whose grouped
        # GEMM may read its per-expert offsets on the host (moe.py), nor a sliding window,
        # which the static decode plan a graph replays does not apply.
        self.capturable = not config.sparse_layers and config.sliding_window is None

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
        plan = AttentionPlan.build(meta, input_ids.device, self.config.sliding_window or 0)
        return self.forward_planned(input_ids, positions, kv_cache, plan, hooks)

    @torch.inference_mode()
    def forward_planned(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
        hooks: LayerHooks = NO_HOOKS,
    ) -> torch.Tensor:
        """``forward`` over an attention plan already built (a CUDA graph's static one)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            hooks.before_layer(i)
            x = layer(x, cos, sin, kv_cache, plan)
            hooks.after_layer(i)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the N hidden states that need a next token."""
        return self.lm_head(hidden).float()
