"""Tiny random-weight models saved by transformers, for tests that need no real weights
(the CPU graph-path tests, and tests/cuda on a GPU machine without the embedded model)."""

from __future__ import annotations

from pathlib import Path

import torch

# (transformers config class, options): the Llama family's variants memserve serves.
TINY_ARCHITECTURES = {
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
}
TINY_SIZES = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=None,  # never stop early: every request decodes max_tokens
)


def save_tiny_model(folder: Path, name: str, seed: int = 0, std: float = 0.2):
    """A random ``name`` model (a key of TINY_ARCHITECTURES) saved in float32 to
    ``folder``; returns the transformers model (float32, CPU, eval)."""
    import transformers

    architecture, options = TINY_ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, architecture)(**TINY_SIZES, **options)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)  # far from the near-uniform init: decisive greedy choices
    model.save_pretrained(folder)
    return model
