"""LoRA adapters made with ``peft`` over tiny random base models, and their greedy tokens:
the reference every adapter test holds memserve to."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from helpers.hf_greedy import transformers_greedy


def make_adapter(base, folder: Path, seed: int, **options) -> object:
    """A peft adapter of transformers model ``base`` with random (non-zero) A and B, saved
    to ``folder``; ``options``: ``LoraConfig``'s."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


def peft_greedy(new_base: Callable[[], object], folder: Path, prompts: list[list[int]],
                new_tokens: int) -> list[list[int]]:
    """peft's greedy tokens of the adapter saved in ``folder`` over a fresh ``new_base()``."""
    from peft import PeftModel

    return transformers_greedy(PeftModel.from_pretrained(new_base(), folder).eval(), prompts, new_tokens)
