"""The few architecture numbers the Llama-family model needs, read from ``config.json``.

Accepts both the transformers<5 spelling (``rope_theta`` + ``rope_scaling``) and the
transformers-5 spelling (``rope_parameters``), and normalises them into one dict.

Every family is read into the same fields, options of the one decoder: Qwen3's q/k norms,
Qwen2's q/k/v biases, Phi-3's partial rotary, and the sparse mixture-of-experts MLP of
Qwen3-MoE and Mixtral (``sparse_layers`` lists the layers that have one). A setting that
would change the output and that the decoder does not implement (another rotary scaling,
Qwen's per-layer sliding windows) is refused here with a ValueError naming it, never
served approximately. ``sliding_window`` is kept only where it is shorter than the
context (where it can drop keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before the rotation
    partial_rotary_factor: float = 1.0  # Phi-3/4: the rotation covers this leading share of each head
    # Sparse MoE (Qwen3-MoE, Mixtral): these layers' MLP routes each token to
    # num_experts_per_tok of num_experts experts of width moe_intermediate_size.
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    sliding_window: int | None = None  # Mistral: a query sees the keys of its last this many positions
    # Always holds "rope_type" and "rope_theta", plus the type's own keys (factor, ...).
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that are rotated (even; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported for Qwen models")
        max_position_embeddings = d.get("max_position_embeddings", 4096)
        # Mistral, Mixtral and Phi-3 apply sliding_window to every layer when it is set; a
        # window at least as long as the context never drops a key.
        window = d.get("sliding_window") if model_type in ("mistral", "mixtral", "phi3") else None
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; Llama-family models use silu")
        rope_parameters = normalize_rope_parameters(d)
        if rope_parameters["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_parameters['rope_type']!r} is not supported "
                             f"(supported: {SUPPORTED_ROPE_TYPES})")
        num_heads = d["num_attention_heads"]
        num_layers = d["num_hidden_layers"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Qwen2 always has q/k/v biases and no config key for them; Llama's attention_bias covers o_proj too.
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            partial_rotary_factor=d.get("partial_rotary_factor") or rope_parameters.get("partial_rotary_factor", 1.0),
            rope_parameters=rope_parameters,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window if window is not None and window < max_position_embeddings else None,
            **_moe_fields(model_type, d, num_layers),
        )


def _moe_fields(model_type: str, d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The sparse-MLP fields of a MoE family, with transformers' defaults for missing keys."""
    if model_type == "mixtral":  # every layer sparse, top-k probabilities always renormalised
        return dict(sparse_layers=tuple(range(num_layers)), num_experts=d.get("num_local_experts", 8),
                    num_experts_per_tok=d.get("num_experts_per_tok", 2), moe_intermediate_size=d["intermediate_size"],
                    norm_topk_prob=True)
    if model_type == "qwen3_moe":
        # transformers 5 writes num_local_experts, Qwen's checkpoints num_experts.
        num_experts = d.get("num_experts") or d.get("num_local_experts", 128)
        step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        return dict(sparse_layers=sparse, num_experts=num_experts, num_experts_per_tok=d.get("num_experts_per_tok", 8),
                    moe_intermediate_size=d.get("moe_intermediate_size", 768),
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)))
    return {}


def normalize_rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """One rope dict with ``rope_type`` and ``rope_theta`` from either config spelling."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type or "default")
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    return params
