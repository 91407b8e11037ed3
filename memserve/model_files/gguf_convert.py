"""Turn a GGUF file into a cached Hugging Face folder, once.

Everything else (the gateway's tokenizer, the worker's loader) then reads one format: a
folder with ``config.json``, tokenizer files with the chat template, and
``model.safetensors``. Weights are dequantized with the ``gguf`` package and stored as
float32, which holds every dequantized value exactly; llama.cpp's Q/K row permutation
for rotary is undone so the tensors are in Hugging Face layout.

This module must not import torch: the gateway calls ``ensure_model_dir`` and never loads
torch. transformers (needed for config and tokenizer) does import torch, so the conversion
itself runs in a child process: ``python -m memserve.model_files.gguf_convert GGUF OUT``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from memserve.model_files.default_model import default_gguf_path
from memserve.model_files.hub_cache import cached_snapshot, is_repo_id

log = logging.getLogger(__name__)

# Part of the cache key: bump it when the converted folder's content changes.
CONVERTER_VERSION = 2
WEIGHTS_FILE = "model.safetensors"
# llama.cpp stores Q/K rows of these architectures permuted for its rotary kernel.
_PERMUTED_QK_ARCHS = {"llama"}
_SUPPORTED_ARCHS = {"llama", "qwen2"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Derived from the config by our rotary code; not a weight.
_SKIPPED_TENSORS = {"rope_freqs.weight"}


def ensure_model_dir(model: str | Path | None) -> Path:
    """A Hugging Face folder for ``model``: None -> the embedded default GGUF; a .gguf
    file -> its converted folder in the cache (converted on first use); a folder -> itself;
    a repo id (``org/name``) -> its snapshot in the local Hugging Face cache."""
    if model is None:
        gguf_path = default_gguf_path()
    else:
        path = cached_snapshot(str(model)) if is_repo_id(str(model)) else Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
            return path
        if path.suffix != ".gguf" or not path.is_file():
            raise FileNotFoundError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
        gguf_path = path
    target = cache_dir_for(gguf_path)
    if not target.is_dir():
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


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for tensors we do not keep."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K output rows (its rotary pairs adjacent
    dims; Hugging Face pairs dim i with dim i + head_dim/2)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_gguf_weights(gguf_path: Path) -> dict[str, np.ndarray]:
    """All weights of a GGUF file, dequantized to float32, in Hugging Face names and layout."""
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_SUPPORTED_ARCHS)})")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if arch in _PERMUTED_QK_ARCHS and ".q_proj." in name:
            values = unpermute_rotary_rows(values, num_heads)
        elif arch in _PERMUTED_QK_ARCHS and ".k_proj." in name:
            values = unpermute_rotary_rows(values, num_kv_heads)
        weights[name] = np.ascontiguousarray(values)
    return weights


def _field(reader: GGUFReader, key: str, default: object = None) -> Any:
    """A metadata value (as GGUF typed it: str, int, float, list, ...)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, generation config, tokenizer (with chat template) and float32 weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # Other servers (transformers serve, vLLM) pick the model class from this key.
    config.architectures = [{"qwen2": "Qwen2ForCausalLM"}.get(config.model_type, "LlamaForCausalLM")]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)
    save_file(read_gguf_weights(gguf_path), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a GGUF file into a Hugging Face model folder.")
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    convert_gguf(args.gguf, args.out_dir)


if __name__ == "__main__":
    main()
