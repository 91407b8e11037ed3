"""transformers' greedy tokens, the reference every equivalence test holds memserve to."""

from __future__ import annotations

import torch


def transformers_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``new_tokens`` greedy tokens of each prompt from transformers model ``hf``, one
    prompt at a time, never stopping early."""
    reference = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids], device=hf.device)
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
            reference.append(out[0, len(ids):].tolist())
    return reference
