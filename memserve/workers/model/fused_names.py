"""Which checkpoint weights our fused projections are made of.

The model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (fewer, larger
products); a checkpoint stores them apart. The loader concatenates the float weights by
rows under the fused name, and ``gguf_linear`` does the same with quantized blocks: both
ask ``fused_parts`` which names go together."""

from __future__ import annotations

# Our fused parameter -> the Hugging Face parameters concatenated (along the output dim) into it.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fused_parts(name: str) -> tuple[str, list[str]] | None:
    """For the checkpoint name of a fused projection's first part (``...q_proj.weight``):
    the fused parameter's name and all its parts' names, in order; None for any other name."""
    for fused, parts in FUSED.items():
        marker = f".{parts[0]}."
        if marker in name:
            prefix, suffix = name.split(marker)
            return f"{prefix}.{fused}.{suffix}", [f"{prefix}.{part}.{suffix}" for part in parts]
    return None
