"""Turn a GGUF file into a cached Hugging Face folder, once.

Everything else (the gateway's tokenizer, the worker's loader) then reads one format: a
folder with ``config.json``, tokenizer files with the chat template, and
``model.safetensors``. Weights are dequantized with the ``gguf`` package and stored as
float32, which holds every dequantized value exactly, under the names and in the layout
of the Hugging Face checkpoint that llama.cpp's ``convert_hf_to_gguf.py`` converted: its
per-architecture tensor names are mapped back, stacked experts split per expert, the
Q/K row permutation of its llama architecture undone, and the ``+ 1`` it adds to Gemma's
norm weights taken off again. Linear weights of the types memserve runs quantized (Q4_0,
Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) are also kept as the file stores them, in
``gguf/blocks.safetensors`` (the tied lm_head as the embedding's blocks), so that a
worker need not widen them. The config is rebuilt from the metadata the same converter
writes, with llama.cpp's own defaults for what it leaves out (Gemma's attention scale and
sliding-layer pattern), so the folder means what llama.cpp would run.

This module must not import torch: the gateway calls ``ensure_model_dir`` and never loads
torch. transformers (needed for config and tokenizer) does import torch, so the conversion
itself runs in a child process: ``python -m memserve.model_files.gguf_convert GGUF OUT``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file

from memserve.model_files.default_model import default_gguf_path
from memserve.model_files.hub_cache import hub_snapshot, is_repo_id

log = logging.getLogger(__name__)

# Part of the cache key: bump it when the converted folder's content changes.
CONVERTER_VERSION = 6
WEIGHTS_FILE = "model.safetensors"
# The linear layers' weights as the file stores them, where their type runs quantized
# (workers/model/gguf_linear.py): uint8 rows of ggml blocks under the Hugging Face
# weight's name, each tensor's ggml type id in the file's metadata under the same name.
# In a folder of its own: loaders that read every *.safetensors of a model folder (the
# predictor's, other servers') must not take these for weights.
QUANTIZED_FILE = "gguf/blocks.safetensors"
QUANTIZED_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                   GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
# Linear layers, by the end of their Hugging Face weight's name.
_LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")
# llama.cpp's tensor names (gguf.constants.TENSOR_NAMES) -> Hugging Face's, within
# ``model.layers.N``. "{expert}": llama.cpp stacks the experts of a projection along the
# first axis of one tensor; the Hugging Face checkpoint has one tensor per expert.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MIXTRAL_EXPERTS = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
}
_QWEN_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
}
# Phi-3 keeps its fused projections; its ffn_up holds gate then up, as gate_up_proj does.
_PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma normalises around both sublayers; its ffn_norm is the pre-feedforward norm.
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Rotary scalings stored as tensors: read into the config, not weights.
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Llama 3.x's rope scaling parameters besides its factor (llama.cpp keeps only their effect).
_LLAMA3_ROPE: dict[str, float] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
_REQUIRED = object()


class GGUFMetadata:
    """A GGUF file's metadata and tensor shapes (in numpy order: rows first)."""

    def __init__(self, reader: GGUFReader):
        self.reader = reader
        self.arch = str(self.value("general.architecture"))
        self.tensors = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        """A metadata value as GGUF typed it (str, int, list, ...), floats at their float32
        value's shortest decimal (1e-05, not 9.999999747378752e-06)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ValueError(f"GGUF metadata lacks {key!r}")
            return default
        value = field.contents()
        return float(str(np.float32(value))) if isinstance(value, float) else value

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of ``{architecture}.{key}``."""
        return self.value(f"{self.arch}.{key}", default)

    def tensor_values(self, name: str) -> np.ndarray:
        return _float32(next(t for t in self.reader.tensors if t.name == name))


def _float32(tensor: ReaderTensor) -> np.ndarray:
    """A tensor's values, dequantized: float32 holds every dequantized value exactly."""
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


def ensure_model_dir(model: str | Path | None) -> Path:
    """A Hugging Face folder for ``model``: None -> the embedded default GGUF; a .gguf
    file -> its converted folder in the cache (converted on first use); a folder -> itself;
    a repo id (``org/name``) -> its snapshot in the Hugging Face cache (downloaded if need be)."""
    if model is None:
        gguf_path = default_gguf_path()
    else:
        path = hub_snapshot(str(model)) if is_repo_id(str(model)) else Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
            return path
        if path.suffix != ".gguf" or not path.is_file():
            raise FileNotFoundError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
        gguf_path = path
    target = cache_dir_for(gguf_path)
    if not target.is_dir():
        architecture(GGUFMetadata(GGUFReader(gguf_path)))  # refused here, not in a child's traceback
        _convert_in_child_process(gguf_path, target)
    return target


def cache_root() -> Path:
    """``$MEMSERVE_CACHE/models`` or ``~/.cache/memserve/models``."""
    return Path(os.environ.get("MEMSERVE_CACHE", "~/.cache/memserve")).expanduser() / "models"


def cache_dir_for(gguf_path: Path) -> Path:
    """Cache folder named by the file's stem and a hash of where it is, its size and mtime."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{CONVERTER_VERSION}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / f"{gguf_path.stem}-{digest}"


def _convert_in_child_process(gguf_path: Path, target: Path) -> None:
    """Convert into a private temp folder, then rename it into place atomically, so a
    concurrent start either sees no folder or a complete one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    log.info("converting %s to a Hugging Face folder in %s (once)", gguf_path, target)
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        result = subprocess.run(
            [sys.executable, "-m", __spec__.name, str(gguf_path), str(tmp)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"converting {gguf_path} failed:\n{result.stderr[-4000:]}")
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise  # not a lost race with another process: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- config
def _base_config(m: GGUFMetadata) -> dict[str, Any]:
    """The keys every architecture shares, from the metadata TextModel.set_gguf_parameters
    writes. The vocabulary is the embedding's rows; the output projection is written only
    when it is not the embedding."""
    hidden, heads = m("embedding_length"), m("attention.head_count")
    return {
        "vocab_size": m.tensors["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m("attention.head_count_kv", heads),
        "head_dim": m("attention.key_length", hidden // heads),
        "rms_norm_eps": m("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": m("context_length"),
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "rope_parameters": _rope_parameters(m),
        "bos_token_id": m.value("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": m.value("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": m.value("tokenizer.ggml.padding_token_id", None),
    }


def _rope_parameters(m: GGUFMetadata) -> dict[str, Any]:
    """The rotary of the (global) layers. A scaling the decoder does not implement (yarn,
    Phi-3's longrope) is carried into the config, where loading refuses it by name."""
    theta = m("rope.freq_base", 10000.0)
    if "rope_freqs.weight" in m.tensors:
        return _llama3_rope(m.tensor_values("rope_freqs.weight"), theta)
    if "rope_factors_long.weight" in m.tensors:
        return {"rope_type": "longrope", "rope_theta": theta,
                "long_factor": m.tensor_values("rope_factors_long.weight").tolist(),
                "short_factor": m.tensor_values("rope_factors_short.weight").tolist(),
                "original_max_position_embeddings": m("rope.scaling.original_context_length")}
    scaling = m("rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": scaling, "rope_theta": theta, "factor": m("rope.scaling.factor")}
    if scaling == "yarn":
        params["original_max_position_embeddings"] = m("rope.scaling.original_context_length")
    return params


def _llama3_rope(divisors: np.ndarray, theta: float) -> dict[str, Any]:
    """llama.cpp stores Llama 3.x's rope scaling as what it does, a divisor of each
    rotary frequency (rope_freqs), not as its parameters. They are those of Llama 3.1-3.3
    (low/high frequency factors 1 and 4 over 8192 positions) with the largest divisor as
    the factor; divisors that follow no such curve are refused, not served wrongly."""
    factor = float(divisors.max())
    low, high = _LLAMA3_ROPE["low_freq_factor"], _LLAMA3_ROPE["high_freq_factor"]
    old = _LLAMA3_ROPE["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (np.arange(0, 2 * len(divisors), 2) / (2 * len(divisors)))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(divisors, expected, rtol=1e-4):
        raise ValueError("rope_freqs: the rotary frequency divisors are not Llama 3.x's rope scaling; "
                         "only llama3 scaling with low/high frequency factors 1 and 4 over 8192 positions is read")
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **_LLAMA3_ROPE}


def _llama_config(m: GGUFMetadata) -> dict[str, Any]:
    """llama.cpp's llama architecture also holds Mistral and Mixtral (its converter writes
    them as Llama): experts make it Mixtral, a sliding window (which that converter does
    not write, so only a file that carries the key has one) Mistral."""
    config = _base_config(m)
    window = m("attention.sliding_window", 0) or None
    if m("expert_count", 0):
        return config | {"model_type": "mixtral", "num_local_experts": m("expert_count"),
                         "num_experts_per_tok": m("expert_used_count"), "sliding_window": window}
    if window:
        return config | {"model_type": "mistral", "sliding_window": window}
    return config | {"model_type": "llama", "attention_bias": "blk.0.attn_q.bias" in m.tensors,
                     "mlp_bias": "blk.0.ffn_up.bias" in m.tensors}


def _qwen2_config(m: GGUFMetadata) -> dict[str, Any]:
    return _base_config(m) | {"model_type": "qwen2"}


def _qwen3_config(m: GGUFMetadata) -> dict[str, Any]:
    return _base_config(m) | {"model_type": "qwen3", "attention_bias": "blk.0.attn_q.bias" in m.tensors}


def _qwen3_moe_config(m: GGUFMetadata) -> dict[str, Any]:
    """Every layer sparse (llama.cpp's qwen3moe has no dense MLP tensors), the chosen
    experts' weights always renormalised (as llama.cpp computes them)."""
    return _base_config(m) | {
        "model_type": "qwen3_moe", "intermediate_size": m("feed_forward_length", m("expert_feed_forward_length")),
        "num_experts": m("expert_count"), "num_experts_per_tok": m("expert_used_count"),
        "moe_intermediate_size": m("expert_feed_forward_length"), "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": []}


def _phi3_config(m: GGUFMetadata) -> dict[str, Any]:
    """The rotated share of each head is rope.dimension_count; a sliding window of 0
    means none (Phi-4)."""
    config = _base_config(m)
    return config | {"model_type": "phi3", "partial_rotary_factor": m("rope.dimension_count") / config["head_dim"],
                     "sliding_window": m("attention.sliding_window", 0) or None,
                     "original_max_position_embeddings": m("rope.scaling.original_context_length",
                                                           config["max_position_embeddings"])}


def _gemma_config(m: GGUFMetadata, model_type: str, swa_pattern: int, layers_27b: int) -> dict[str, Any]:
    """What llama.cpp assumes for Gemma and the file does not say: its attention scale
    (1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 27B model it knows by its layer count)
    and which layers slide (every ``swa_pattern``-th layer is global unless the file's
    sliding_window_pattern says otherwise; none without a sliding window)."""
    config = _base_config(m)
    layers, window = config["num_hidden_layers"], m("attention.sliding_window", 0)
    pattern = m("attention.sliding_window_pattern", swa_pattern)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(s) for s in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    scalar = (config["hidden_size"] // config["num_attention_heads"] if layers == layers_27b
              else config["head_dim"])
    return config | {
        "model_type": model_type, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _gemma2_config(m: GGUFMetadata) -> dict[str, Any]:
    """Both soft caps default to llama.cpp's (50 on the attention scores, 30 on the logits)."""
    return _gemma_config(m, "gemma2", swa_pattern=2, layers_27b=46) | {
        "attn_logit_softcapping": m("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": m("final_logit_softcapping", 30.0)}


def _gemma3_config(m: GGUFMetadata) -> dict[str, Any]:
    """The global layers' rotary is the file's rope; the sliding layers' has a base of its
    own (10000 unless the file says). No soft cap on the logits unless the file has one."""
    config = _gemma_config(m, "gemma3_text", swa_pattern=6, layers_27b=62)
    local = {"rope_type": "default", "rope_theta": m("rope.freq_base_swa", 10000.0)}
    return config | {"rope_parameters": {"full_attention": config["rope_parameters"], "sliding_attention": local},
                     "final_logit_softcapping": m("final_logit_softcapping", None)}


@dataclass(frozen=True)
class Architecture:
    """How to read one llama.cpp architecture back into a Hugging Face model."""

    config: Callable[[GGUFMetadata], dict[str, Any]]
    layer_tensors: dict[str, str]
    permuted_qk: bool = False  # llama.cpp interleaves Q/K rows for its rotary kernel
    norm_offset: float = 0.0  # llama.cpp stores w + offset where Hugging Face stores w (and computes offset + w)


# llama.cpp's architecture names (general.architecture) that can be read back.
ARCHITECTURES = {
    "llama": Architecture(_llama_config, _LAYER_TENSORS | _MIXTRAL_EXPERTS, permuted_qk=True),
    "qwen2": Architecture(_qwen2_config, _LAYER_TENSORS),
    "qwen3": Architecture(_qwen3_config, _LAYER_TENSORS),
    "qwen3moe": Architecture(_qwen3_moe_config, _LAYER_TENSORS | _QWEN_EXPERTS),
    "phi3": Architecture(_phi3_config, _LAYER_TENSORS | _PHI3_FUSED),
    "gemma2": Architecture(_gemma2_config, _LAYER_TENSORS | _GEMMA_NORMS, norm_offset=1.0),
    "gemma3": Architecture(_gemma3_config, _LAYER_TENSORS | _GEMMA_NORMS, norm_offset=1.0),
}


def architecture(m: GGUFMetadata) -> Architecture:
    """How to read the file; one of an architecture not listed is refused by name."""
    if m.arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"GGUF architecture {m.arch!r} is not supported (supported: {supported})")
    return ARCHITECTURES[m.arch]


# --------------------------------------------------------------------------- weights
def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """Hugging Face name of a GGUF tensor of architecture ``arch`` (``blk.3.attn_q.weight``
    -> ``model.layers.3.self_attn.q_proj.weight``), with "{expert}" where it stacks one
    tensor per expert; None for the tensors that are read into the config."""
    if gguf_name in _CONFIG_TENSORS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    layer_tensors = ARCHITECTURES[arch].layer_tensors
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r} for architecture {arch!r}")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K output rows (its rotary pairs adjacent
    dims; Hugging Face pairs dim i with dim i + head_dim/2)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_gguf_weights(m: GGUFMetadata) -> dict[str, np.ndarray]:
    """All weights of a GGUF file, dequantized to float32, in Hugging Face names and layout."""
    arch = architecture(m)
    num_heads = int(m("attention.head_count"))
    num_kv_heads = int(m("attention.head_count_kv", num_heads))
    weights: dict[str, np.ndarray] = {}
    for tensor in m.reader.tensors:
        name = hf_tensor_name(tensor.name, m.arch)
        if name is None:
            continue
        values = _float32(tensor)
        if arch.permuted_qk and ".q_proj." in name:
            values = unpermute_rotary_rows(values, num_heads)
        elif arch.permuted_qk and ".k_proj." in name:
            values = unpermute_rotary_rows(values, num_kv_heads)
        elif arch.norm_offset and name.endswith("norm.weight"):
            values = values - np.float32(arch.norm_offset)
        if "{expert}" in name:
            weights.update((name.format(expert=i), np.ascontiguousarray(v)) for i, v in enumerate(values))
        else:
            weights[name] = np.ascontiguousarray(values)
    return weights


def read_quantized_linears(m: GGUFMetadata) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The linear layers' weights in the types that run quantized, as uint8 rows of ggml
    blocks under their Hugging Face names (Q/K rows unpermuted like the float ones), and
    each one's ggml type id; the embedding's blocks serve as the lm_head when it is tied."""
    arch = architecture(m)
    num_heads = int(m("attention.head_count"))
    num_kv_heads = int(m("attention.head_count_kv", num_heads))
    blocks: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    names = {t.name for t in m.reader.tensors}
    for tensor in m.reader.tensors:
        name = hf_tensor_name(tensor.name, m.arch)
        if tensor.name == "token_embd.weight" and "output.weight" not in names:
            name = "lm_head.weight"
        if name is None or "{expert}" in name or not name.endswith(_LINEAR_SUFFIXES):
            continue
        if tensor.tensor_type not in QUANTIZED_TYPES:
            continue
        rows = tensor.data
        if arch.permuted_qk and ".q_proj." in name:
            rows = unpermute_rotary_rows(rows, num_heads)
        elif arch.permuted_qk and ".k_proj." in name:
            rows = unpermute_rotary_rows(rows, num_kv_heads)
        blocks[name] = np.ascontiguousarray(rows)
        types[name] = str(int(tensor.tensor_type))
    return blocks, types


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, generation config, tokenizer (with chat template) and float32 weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = GGUFMetadata(GGUFReader(gguf_path))
    fields = architecture(metadata).config(metadata)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    # Other servers (transformers serve, vLLM) pick the model class from this key.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)
    save_file(read_gguf_weights(metadata), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    blocks, types = read_quantized_linears(metadata)
    if blocks:
        (out_dir / QUANTIZED_FILE).parent.mkdir(exist_ok=True)
        save_file(blocks, str(out_dir / QUANTIZED_FILE), metadata=types)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a GGUF file into a Hugging Face model folder.")
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    convert_gguf(args.gguf, args.out_dir)


if __name__ == "__main__":
    main()
