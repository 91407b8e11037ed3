"""Build a ``LlamaForCausalLM`` from a Hugging Face folder (``config.json`` + ``*.safetensors``).

The model is created on the meta device and the loaded tensors are assigned in place, so
no time is spent on random initialisation and no second copy of the weights is made.
Checkpoint tensors are renamed and concatenated into the model's fused parameters (q/k/v,
gate/up) and, for mixture-of-experts models, each layer's per-expert tensors are stacked
into one tensor per projection (``moe.py``). Of a multimodal Gemma 3 checkpoint only the
text model is read, renamed to a text-only model's names. One rank of a tensor-parallel
group reads only the part of each split layer's tensors its layers ask for
(``checkpoint_cuts.py``), and cuts what it reads whole (``linear.py``: ``shard``). A quantized checkpoint's quantized layers are
taken out first and become their layers' kernels (``quantization_config.py``)."""

from __future__ import annotations

import logging
import re
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from safetensors import safe_open

from memserve.workers.model.checkpoint_cuts import Cut, FileSlice, checkpoint_cuts
from memserve.workers.model.fused_names import fused_parts
from memserve.workers.model.gguf_linear import describe, fused_blocks, quantize_linears, read_blocks, use_quantized
from memserve.workers.model.llama import LlamaForCausalLM, use_fused_pointwise
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.packed_linear import (
    CPU_GEMMS,
    pack_linears,
    packing_supported,
)
from memserve.workers.model.quantization_config import Scheme, read_scheme, set_kernels, take_quantized
from memserve.workers.model.tensor_parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

# Mixtral's names for the sparse MLP and its experts' projections -> Qwen3-MoE's (ours).
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
_EXPERT_WEIGHT = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
# Checkpoint entries that are derived buffers, not weights, or not the text model's
# (a multimodal Gemma 3's vision tower and projector, under either transformers' names).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# A multimodal Gemma 3's text model under its checkpoint's (or transformers 5's) names -> a text model's.
_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."))
# Models held by this process, by (folder, dtype, device, CPU GEMM, quantization, rank, ranks): see ``load_model``.
_loaded: weakref.WeakValueDictionary[tuple[str, torch.dtype, str, str, str, int, int], LlamaForCausalLM] = (
    weakref.WeakValueDictionary())


def read_safetensors(folder: Path, dtype: torch.dtype, device: str | torch.device,
                     keep: Callable[[str, torch.Tensor], bool] | None = None,
                     cuts: dict[str, Cut] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the folder's *.safetensors shards, floating ones cast to ``dtype``
    except those ``keep`` keeps as stored (a quantized checkpoint's FP8 values, scales);
    of a tensor named in ``cuts``, only the part its cut reads (``checkpoint_cuts.py``)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or name.startswith(_IGNORED_PREFIXES):
                    continue
                cut = cuts.get(name) if cuts else None
                tensor = cut(FileSlice(f.get_slice(name))) if cut is not None else f.get_tensor(name)
                cast = tensor.is_floating_point() and not (keep is not None and keep(name, tensor))
                tensors[_text_model_name(name)] = tensor.to(dtype) if cast else tensor
    return tensors


def _text_model_name(name: str) -> str:
    """A multimodal Gemma 3's text-model weight under a text-only model's name; others unchanged."""
    for old, new in _TEXT_MODEL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def fuse_hf_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Hugging Face weights to our parameters, concatenating q/k/v and gate/up."""
    out = dict(hf)
    for name in list(hf):
        fused = fused_parts(name)
        if fused is not None:
            ours, parts = fused
            out[ours] = torch.cat([out.pop(part) for part in parts], dim=0)
    return out


def stack_expert_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Mixtral's sparse-MLP weights to Qwen3-MoE's, then stack every layer's
    ``experts.{i}.{gate,up,down}_proj.weight`` into ``experts.gate_up_proj`` [E, 2I, H]
    and ``experts.down_proj`` [E, H, I]. Consumes ``hf``: each expert's tensors are freed
    once copied, so the experts (most of a MoE model) are never held twice."""
    out: dict[str, torch.Tensor] = {}
    by_layer: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
    while hf:
        name, tensor = hf.popitem()
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES:
                name = name.replace(old, new)
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            by_layer[match["experts"]][(match["proj"], int(match["index"]))] = tensor
    while by_layer:
        experts, parts = by_layer.popitem()
        count = 1 + max(index for _, index in parts)
        try:
            gate, down = parts[("gate_proj", 0)], parts[("down_proj", 0)]
            width = gate.shape[0]
            gate_up = gate.new_empty(count, 2 * width, gate.shape[1])
            down_proj = down.new_empty(count, *down.shape)
            for i in range(count):
                gate_up[i, :width] = parts.pop(("gate_proj", i))
                gate_up[i, width:] = parts.pop(("up_proj", i))
                down_proj[i] = parts.pop(("down_proj", i))
        except KeyError as missing:
            raise ValueError(f"{experts}: expert weight {missing} is missing") from None
        out[f"{experts}.gate_up_proj"], out[f"{experts}.down_proj"] = gate_up, down_proj
    return out


def load_model(
    folder: str | Path, dtype: torch.dtype, device: str | torch.device, cpu_gemm: str = "onednn",
    quantization: str = "auto", tp: TensorParallel = SINGLE, shared: bool = True, load_format: str = "auto",
) -> LlamaForCausalLM:
    """Load the model in ``folder`` onto ``device`` in ``dtype``, ready for inference. On CPU
    its linear layers run through oneDNN-packed weights (``packed_linear.py``) unless
    ``cpu_gemm`` is "torch" or oneDNN cannot pack ``dtype`` here, and its norms and SwiGLU
    through the fused pointwise kernels where they build. A folder converted from a GGUF
    file runs its quantized linear weights as the file stores them (``gguf_linear.py``)
    unless ``quantization`` is "none"; a Hugging Face checkpoint with a
    ``quantization_config`` (FP8, AWQ, GPTQ) runs quantized, and ``quantization`` "fp8"
    quantizes a float checkpoint at load (``quantization_config.py``). With ``tp`` of
    several ranks, this rank's shard.

    A model this process already holds with the same settings is shared, not loaded again:
    inference only reads the weights (every runner keeps its own KV pools), so the engines
    a process builds over one model (the profiler's, a test's) hold one copy of them. It is
    freed with the last runner that uses it. ``shared=False`` loads a copy of its own, for a
    runner that changes its layers (LoRA adapters set on them).

    ``load_format`` "dummy" (vLLM's) reads only ``config.json`` and gives every weight small
    random values on the device, unquantized: a model's shape, timed without its files."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"unknown CPU GEMM {cpu_gemm!r}; expected one of {CPU_GEMMS}")
    if load_format == "dummy":
        return _dummy(Path(folder), dtype, device, cpu_gemm, tp)
    if load_format != "auto":
        raise ValueError(f"unknown --load-format {load_format!r}; expected auto or dummy")
    scheme = read_scheme(Path(folder), quantization)  # refuses what is not built, by name
    # "auto" or "gguf" where a converted GGUF file's blocks run quantized, else None.
    gguf = quantization if scheme is None and use_quantized(quantization, Path(folder), torch.device(device)) else None
    key = (str(Path(folder).resolve()), dtype, str(torch.device(device)), cpu_gemm, f"{gguf}:{scheme}",
           tp.rank, tp.size)
    model = _loaded.get(key) if shared else None
    if model is None and not shared:
        return _load(Path(folder), dtype, device, cpu_gemm, gguf, tp, scheme)
    if model is None:
        model = _loaded[key] = _load(Path(folder), dtype, device, cpu_gemm, gguf, tp, scheme)
    return model


def shard_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], read_cut: Collection[str] = ()) -> None:
    """Cut each of ``weights`` to the part ``model``'s layer asks for (its ``shard``), in
    place, but those ``read_cut`` (read as their part already); the full tensors are
    dropped as they are cut."""
    for prefix, module in model.named_modules():
        shard = getattr(module, "shard", None)
        if shard is None:
            continue
        for name, _ in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if key in weights and key not in read_cut:
                weights[key] = shard(name, weights.pop(key))


def _dummy(folder: Path, dtype: torch.dtype, device: str | torch.device, cpu_gemm: str,
           tp: TensorParallel) -> LlamaForCausalLM:
    """The model of ``folder``'s config.json with weights drawn uniformly from +-1e-3, as
    vLLM's dummy format does (small, so activations stay finite through every layer)."""
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    gen = torch.Generator(device=torch.device(device)).manual_seed(0)
    weights = {name: torch.empty(t.shape, dtype=dtype, device=device).uniform_(-1e-3, 1e-3, generator=gen)
               for name, t in model.state_dict().items() if not (config.tie_word_embeddings and name == "lm_head.weight")}
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cpu_gemm == "onednn" and packing_supported(dtype, torch.device(device)):
        pack_linears(model)
    use_fused_pointwise(model)
    return model.eval()


def _load(folder: Path, dtype: torch.dtype, device: str | torch.device, cpu_gemm: str,
          gguf: str | None = None, tp: TensorParallel = SINGLE, scheme: Scheme | None = None) -> LlamaForCausalLM:
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)  # refuses heads or widths the ranks do not divide
    # A rank reads its part of each split layer's tensors, not the whole model (float checkpoints).
    cuts, read_cut = checkpoint_cuts(model) if scheme is None else ({}, set())
    checkpoint = read_safetensors(folder, dtype, device, None if scheme is None else scheme.keeps, cuts)
    quantized_weights = take_quantized(checkpoint, scheme) if scheme is not None and not scheme.at_load else {}
    weights = fuse_hf_weights(stack_expert_weights(checkpoint))
    tie = config.tie_word_embeddings or "lm_head.weight" not in weights.keys() | quantized_weights.keys()
    if tie:
        weights.pop("lm_head.weight", None)
    shard_weights(model, weights, read_cut)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if tie else set()) - set(quantized_weights)
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"weights in {folder} do not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(weights, strict=False, assign=True)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    if scheme is not None:
        log.info("%s: %s", folder.name, set_kernels(model, quantized_weights, scheme, dtype))
    pack = cpu_gemm == "onednn" and packing_supported(dtype, torch.device(device))
    if gguf is not None:
        blocks, types = fused_blocks(*read_blocks(folder))
        keep_wide = gguf == "auto" and pack
        log.info("%s: %d linear layers run GGUF-quantized %s%s", folder.name,
                 quantize_linears(model, blocks, types, dtype, keep_wide), describe(types),
                 ", their weights also widened for chunks of many rows" if keep_wide else "")
    if pack:
        pack_linears(model)
    use_fused_pointwise(model)
    return model.eval()
