"""Build a random-weight model folder of a named shape, for comparing servers on more than
one model's shapes without downloading weights.

The weights come from ``transformers``' own initialisation (seeded), the tokenizer and
chat template from the default SmolLM2 folder, so any server that loads a Hugging Face
folder serves it and ``memserve bench`` can replay its workloads against it. The text
is meaningless; the speed of each layer is what is being compared.

    python benchmarks/peers/random_model.py qwen2.5-0.5b OUT_DIR   # 0.40B parameters, GQA 14:2
    python benchmarks/peers/random_model.py qwen2.5-1.5b OUT_DIR   # 1.39B parameters, GQA 12:2

Prints the folder and its parameter count. An existing folder with a config is reused.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.testing.random_models import HALF_B_SIZES

# Shapes of public models, vocabulary excepted (the SmolLM2 tokenizer's, 49,152 tokens).
SHAPES = {
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 query heads over 2 KV heads, q/k/v bias.
    "qwen2.5-0.5b": dict(model_type="qwen2", **HALF_B_SIZES, tie_word_embeddings=True),
    # Qwen2.5-1.5B: 28 layers, hidden 1,536, 12 query heads over 2 KV heads, q/k/v bias.
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def build(shape: str, out: Path, seed: int = 0) -> int:
    """Write the folder (float32 safetensors); returns its parameter count."""
    source = Path(ensure_model_dir(None))
    base = AutoConfig.from_pretrained(source)
    spec = {**SHAPES[shape], "vocab_size": base.vocab_size}
    config = AutoConfig.for_model(spec.pop("model_type"), bos_token_id=base.bos_token_id,
                                  eos_token_id=base.eos_token_id, dtype="float32", **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.out / "config.json").exists():
        print(f"{args.out} (exists)")
        return 0
    n = build(args.shape, args.out, args.seed)
    print(f"{args.out} ({n / 1e9:.2f}B parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
