"""Random-weight LoRA adapters of a model folder, made with ``peft`` and saved as it saves
them: what the LoRA benchmarks serve (peft is a test and benchmark dependency)."""

from __future__ import annotations

from pathlib import Path

EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int, std: float = 0.02) -> dict[str, str]:
    """``count`` rank-``rank`` adapters of the model in ``model_dir`` on every projection (as
    a full fine-tune's adapter is), weights drawn with ``std``, in ``out``: name -> folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = {}
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=EVERY_PROJECTION))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, std)
        folders[f"adapter{i}"] = str(out / f"adapter{i}")
        model.save_pretrained(folders[f"adapter{i}"])
    return folders
