"""Random-weight models of each architecture memserve serves, built by transformers' own
config and model classes: tiny ones for tests that need no real weights (the CPU
graph-path tests, the GGUF conversion tests, and tests/cuda on a GPU machine without the
embedded model), and ones of Qwen2.5-0.5B's sizes for the per-architecture benchmark.
Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import transformers

# (transformers config class, options): the Llama family's variants memserve serves.
TINY_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse, probabilities renormalised.
    "qwen3_moe": ("Qwen3MoeConfig", {"tie_word_embeddings": False, "head_dim": 32, "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Phi-4-mini's partial rotary: the first 24 of each head's 32 dimensions rotated.
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.75, "pad_token_id": 0}),
    # Mistral-7B-v0.1's sliding-window attention, with a window shorter than most prompts.
    "mistral": ("MistralConfig", {"sliding_window": 24}),
    # Gemma 2: sliding (0, 2) and global (1, 3) layers, soft-capped attention scores and
    # logits, an attention scale that is not head_dim's. Untied: with tied random
    # embeddings Gemma's scaled embedding dominates and the model repeats its last token.
    "gemma2": ("Gemma2Config", {"tie_word_embeddings": False, "num_hidden_layers": 4, "head_dim": 32,
                                "sliding_window": 24, "attn_logit_softcapping": 20.0,
                                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24}),
    # Gemma 3: q/k norms, sliding layers (0, 2) rotating with a base of their own, global
    # layers (1, 3) with linear rope scaling, soft-capped logits.
    "gemma3_text": ("Gemma3TextConfig", {"tie_word_embeddings": False, "num_hidden_layers": 4, "head_dim": 32,
                                         "sliding_window": 24, "sliding_window_pattern": 2,
                                         "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24,
                                         "rope_parameters": {
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 10000.0}}}),
}
TINY_SIZES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "eos_token_id": None,  # never stop early: every request decodes max_tokens
}


# Qwen2.5-0.5B's sizes: 24 layers, hidden 896, 14 query heads over 2 KV heads, its
# 151,936-token vocabulary and tied embeddings (0.49B parameters as Qwen2).
HALF_B_SIZES: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
# What each family changes from its tiny options at those sizes: tied embeddings, heads of
# 64 dimensions, 8 experts (2 chosen) of width 608 holding as many weights as the dense
# 4864-wide MLP, 24 Gemma layers, windows shorter than a 512-token prompt.
_HALF_B_CHANGES: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False},
    "qwen2": {},
    "qwen3": {"head_dim": 64},
    "qwen3_moe": {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 608,
                  "mlp_only_layers": []},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 608},
    "phi3": {},
    "mistral": {"sliding_window": 256},
    "gemma2": {"num_hidden_layers": 24, "head_dim": 64, "sliding_window": 256, "query_pre_attn_scalar": 64},
    "gemma3_text": {"num_hidden_layers": 24, "head_dim": 64, "sliding_window": 256, "sliding_window_pattern": 6,
                    "query_pre_attn_scalar": 64},
}
HALF_B_OPTIONS = {name: {"tie_word_embeddings": True, **changes} for name, changes in _HALF_B_CHANGES.items()}


def random_model(name: str, sizes: dict[str, Any], seed: int = 0, std: float = 0.2,
                 **overrides: Any) -> transformers.PreTrainedModel:
    """A ``name`` model (a key of TINY_ARCHITECTURES, its options updated by ``overrides``)
    of ``sizes``, every weight drawn from N(0, std): transformers' model, float32, CPU, eval."""
    import transformers  # here: tests import the tables without paying for transformers

    architecture, options = TINY_ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, architecture)(**{**sizes, **options, **overrides})
    # Eager attention wherever scores are soft-capped: SDPA cannot cap them, and some
    # transformers releases (5.17) still pick SDPA for Gemma 2, dropping the cap.
    eager = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    model = transformers.AutoModelForCausalLM.from_config(config, **eager).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)  # far from the near-uniform init: decisive greedy choices
    return model


def save_tiny_model(folder: Path, name: str, seed: int = 0, std: float = 0.2,
                    **overrides: Any) -> transformers.PreTrainedModel:
    """A tiny random ``name`` model (see ``random_model``) saved in float32 to ``folder``;
    returns the transformers model."""
    model = random_model(name, TINY_SIZES, seed, std, **overrides)
    model.save_pretrained(folder)
    return model
