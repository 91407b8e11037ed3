"""Build a ``LlamaForCausalLM`` from a Hugging Face folder (``config.json`` + ``*.safetensors``).

The model is created on the meta device and the loaded tensors are assigned in place, so
no time is spent on random initialisation and no second copy of the weights is made."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from safetensors import safe_open

from memserve.workers.model.llama import LlamaForCausalLM
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.packed_linear import (
    CPU_GEMMS,
    pack_linears,
    packing_supported,
)

# Our fused parameter -> the Hugging Face parameters concatenated (along the output dim) into it.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Checkpoint entries that are derived buffers, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Models held by this process, by (folder, dtype, device, CPU GEMM): see ``load_model``.
_loaded: weakref.WeakValueDictionary[tuple[str, torch.dtype, str, str], LlamaForCausalLM] = (
    weakref.WeakValueDictionary())


def read_safetensors(folder: Path, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the folder's *.safetensors shards, floating ones cast to ``dtype``."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                tensor = f.get_tensor(name)
                tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return tensors


def fuse_hf_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Hugging Face weights to our parameters, concatenating q/k/v and gate/up."""
    out = dict(hf)
    for name in list(hf):
        for fused, parts in _FUSED.items():
            first = parts[0]
            marker = f".{first}."
            if marker not in name:
                continue
            prefix, suffix = name.split(marker)
            pieces = [out.pop(f"{prefix}.{part}.{suffix}") for part in parts]
            out[f"{prefix}.{fused}.{suffix}"] = torch.cat(pieces, dim=0)
    return out


def load_model(
    folder: str | Path, dtype: torch.dtype, device: str | torch.device, cpu_gemm: str = "onednn"
) -> LlamaForCausalLM:
    """Load the model in ``folder`` onto ``device`` in ``dtype``, ready for inference. On CPU
    its linear layers run through oneDNN-packed weights (``packed_linear.py``) unless
    ``cpu_gemm`` is "torch" or oneDNN cannot pack ``dtype`` here.

    A model this process already holds with the same settings is shared, not loaded again:
    inference only reads the weights (every runner keeps its own KV pools), so the engines
    a process builds over one model (the profiler's, a test's) hold one copy of them. It is
    freed with the last runner that uses it."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"unknown CPU GEMM {cpu_gemm!r}; expected one of {CPU_GEMMS}")
    key = (str(Path(folder).resolve()), dtype, str(torch.device(device)), cpu_gemm)
    model = _loaded.get(key)
    if model is None:
        model = _loaded[key] = _load(Path(folder), dtype, device, cpu_gemm)
    return model


def _load(folder: Path, dtype: torch.dtype, device: str | torch.device, cpu_gemm: str) -> LlamaForCausalLM:
    config = ModelConfig.from_folder(folder)
    weights = fuse_hf_weights(read_safetensors(folder, dtype, device))
    tie = config.tie_word_embeddings or "lm_head.weight" not in weights
    if tie:
        weights.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if tie else set())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"weights in {folder} do not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(weights, strict=False, assign=True)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cpu_gemm == "onednn" and packing_supported(dtype, torch.device(device)):
        pack_linears(model)
    return model.eval()
