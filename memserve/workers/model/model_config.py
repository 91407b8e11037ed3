"""The few architecture numbers the Llama-family model needs, read from ``config.json``.

Accepts both the transformers<5 spelling (``rope_theta`` + ``rope_scaling``) and the
transformers-5 spelling (``rope_parameters``), and normalises them into one dict."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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
    # Always holds "rope_type" and "rope_theta", plus the type's own keys (factor, ...).
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported yet")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; Llama-family models use silu")
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Qwen2 always has q/k/v biases and no config key for them; Llama's attention_bias covers o_proj too.
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_parameters=normalize_rope_parameters(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def normalize_rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """One rope dict with ``rope_type`` and ``rope_theta`` from either config spelling."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type or "default")
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    return params
