"""The few architecture numbers the Llama-family model needs, read from ``config.json``.

Accepts both the transformers<5 spelling (``rope_theta`` + ``rope_scaling``) and the
transformers-5 spelling (``rope_parameters``), and normalises them into one dict.

Every family is read into the same fields, options of the one decoder: Qwen3's q/k norms,
Qwen2's q/k/v biases, Phi-3's partial rotary, the sparse mixture-of-experts MLP of
Qwen3-MoE and Mixtral (``sparse_layers`` lists the layers that have one), and Gemma 2/3's
GeGLU, scaled embeddings, ``1 + w`` norms around both sublayers, soft-capped attention
and final logits, ``query_pre_attn_scalar`` attention scale, sliding and global layers
interleaved (``sliding_layers``) and, for Gemma 3, a rotary base of their own for the
sliding layers (``local_rope_parameters``). A multimodal Gemma 3 folder ("gemma3") is read
as its text model (``text_config``; the loader skips the vision weights). A setting that
would change the output and that the decoder does not implement (another rotary scaling,
Qwen's per-layer sliding windows, Gemma's bidirectional attention) is refused here with a
ValueError naming it, never served approximately. ``sliding_window`` is kept only where
it is shorter than the context (where it can drop keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2",
                         "gemma3_text", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA_TYPES = ("gemma2", "gemma3_text")
# transformers' defaults for the Gemma keys a config.json may leave out (a multimodal Gemma 3's
# text_config omits most of them): the values its Gemma2Config / Gemma3TextConfig assume.
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"vocab_size": 256000, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
               "eos_token_id": 1},
    "gemma3_text": {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "bos_token_id": 2, "eos_token_id": 1},
}
# Gemma 2 alternates sliding and global layers; Gemma 3 has five sliding layers per global one.
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}


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
    # The sliding-window layers (Mistral: every layer; Gemma: the local ones): a query of one
    # sees the keys of its last sliding_window positions; None where that never drops a key.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Always holds "rope_type" and "rope_theta", plus the type's own keys (factor, ...).
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    # Gemma 3: the rotary of the sliding layers (rope_local_base_freq); None: every layer uses rope_parameters.
    local_rope_parameters: dict[str, Any] | None = None
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    # Gemma: embeddings scaled by sqrt(hidden_size); RMSNorms scale by (1 + weight) in float32;
    # norms after the attention and around the MLP (post-attention, pre- and post-feedforward).
    scale_embeddings: bool = False
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None  # Gemma: attention scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap) before the softmax
    final_logit_softcapping: float | None = None  # Gemma 2/3: the same on the output logits
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that are rotated (even; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """What the attention scores are multiplied by: Gemma's query_pre_attn_scalar**-0.5, else head_dim**-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        """The sliding window of ``layer``'s attention; 0 where it sees the whole context."""
        return (self.sliding_window or 0) if layer in self.sliding_layers else 0

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if model_type == "gemma3":
            return cls.from_dict(_gemma3_text_config(d))
        gemma = model_type in GEMMA_TYPES
        if gemma:
            d = {**_GEMMA_DEFAULTS[model_type], **d}
            if d.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention: Gemma's bidirectional attention is not supported")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported for Qwen models")
        max_position_embeddings = d.get("max_position_embeddings", 4096)
        num_layers = d["num_hidden_layers"]
        # Mistral, Mixtral and Phi-3 apply sliding_window to every layer when it is set,
        # Gemma to its sliding layers; a window at least as long as the context never drops a key.
        window = d.get("sliding_window") if model_type in ("mistral", "mixtral", "phi3", *GEMMA_TYPES) else None
        if gemma:  # its layer kinds also choose Gemma 3's rotary, whatever the window
            sliding = _gemma_sliding_layers(model_type, d)
        else:
            sliding = tuple(range(num_layers)) if window is not None else ()
        if window is not None and (window >= max_position_embeddings or not sliding):
            window = None
        # Gemma's activation key is hidden_activation (its configs may also carry an unused hidden_act).
        hidden_act = d["hidden_activation"] if gemma else d.get("hidden_act", "silu")
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: {SUPPORTED_ACTIVATIONS})")
        rope_parameters, local_rope_parameters = _rope_fields(model_type, d)
        for rope in [p for p in (rope_parameters, local_rope_parameters) if p is not None]:
            if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope['rope_type']!r} is not supported "
                                 f"(supported: {SUPPORTED_ROPE_TYPES})")
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
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            partial_rotary_factor=d.get("partial_rotary_factor") or rope_parameters.get("partial_rotary_factor", 1.0),
            rope_parameters=rope_parameters,
            local_rope_parameters=local_rope_parameters,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            sliding_layers=sliding,
            hidden_act=hidden_act,
            scale_embeddings=gemma,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=d["query_pre_attn_scalar"] if gemma else None,
            # transformers' Gemma 3 attention ignores attn_logit_softcapping (its checkpoints set none).
            attn_logit_softcapping=d.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
            **_moe_fields(model_type, d, num_layers),
        )


def _gemma3_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config's text model, as a "gemma3_text" config; the token ids
    its top level names win over the text model's."""
    if not d.get("text_config"):
        raise ValueError("model_type 'gemma3' without a text_config is not supported")
    top = {k: d[k] for k in ("bos_token_id", "eos_token_id") if d.get(k) is not None}
    return {**d["text_config"], **top, "model_type": "gemma3_text"}


def _gemma_sliding_layers(model_type: str, d: dict[str, Any]) -> tuple[int, ...]:
    """The sliding-window layers of a Gemma model: its ``layer_types``, else every
    pattern-th layer global (Gemma 2: every other one; Gemma 3: ``sliding_window_pattern``)."""
    num_layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if layer_types is not None:
        unknown = set(layer_types) - {"sliding_attention", "full_attention"}
        if unknown or len(layer_types) != num_layers:
            raise ValueError(f"layer_types {layer_types!r}: expected {num_layers} of sliding_attention / full_attention")
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or _GEMMA_SLIDING_PATTERN[model_type]
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _rope_fields(model_type: str, d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(rope of the global layers, rope of Gemma 3's sliding layers or None). Gemma 3's
    transformers-5 configs hold one rope dict per layer type; older ones give the sliding
    layers ``rope_local_base_freq`` and no scaling (``rope_scaling`` is the global layers')."""
    if model_type != "gemma3_text":
        return normalize_rope_parameters(d), None
    by_type = d.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        defaults = _GEMMA_DEFAULTS[model_type]
        return (normalize_rope_parameters({"rope_parameters": by_type.get("full_attention"),
                                           "rope_theta": defaults["rope_theta"]}),
                normalize_rope_parameters({"rope_parameters": by_type.get("sliding_attention"),
                                           "rope_theta": defaults["rope_local_base_freq"]}))
    return normalize_rope_parameters(d), {"rope_type": "default", "rope_theta": d["rope_local_base_freq"]}


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
