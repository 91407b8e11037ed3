"""GGUF files of every architecture memserve serves, written as llama.cpp's converter writes
them (helpers/llama_cpp_gguf.py), converted back into Hugging Face folders: the weights
are the checkpoint's, transformers computes the same logits from the converted folder as
from the original, and memserve serves it with transformers' greedy tokens. What llama.cpp
does not keep (Mistral's sliding window, Gemma's attention scale and layer pattern) is read
as llama.cpp reads it; an architecture that cannot be read is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.engine_generate import generate
from helpers.hf_greedy import transformers_greedy
from helpers.llama_cpp_gguf import write_gguf
from helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse fixture)
from safetensors.numpy import load_file

from memserve.config import EngineConfig
from memserve.model_files.gguf_convert import (
    WEIGHTS_FILE,
    convert_gguf,
    ensure_model_dir,
)
from memserve.testing.random_models import (
    TINY_ARCHITECTURES,
    TINY_SIZES,
    save_tiny_model,
)
from memserve.workers.model.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from memserve.workers.real_engine import build_engine

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 40)  # the longer one past every sliding window below
LOGITS_PROMPT_LENGTH = 200  # far enough for the low rotary frequencies that rope scalings change
# The tiny models made into what a llama.cpp file can hold, and Llama 3.1's rope scaling
# (written as per-frequency divisors). llama.cpp's qwen3moe has no dense layers, it
# assumes Gemma's attention scale (1/sqrt(head_dim) but for the 27B models) and Gemma 3's
# five sliding layers to one global, and drops Gemma 2's lm_head (tying its output).
GGUF_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 131072,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3_moe": {"mlp_only_layers": []},
    "gemma2": {"query_pre_attn_scalar": 32, "tie_word_embeddings": True},
    "gemma3_text": {"query_pre_attn_scalar": 32, "num_hidden_layers": 6, "sliding_window_pattern": 6},
}


@pytest.fixture(scope="module", params=list(TINY_ARCHITECTURES))
def converted(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(model type, the tiny model's folder, the folder converted from its GGUF file)."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    save_tiny_model(tmp / "hf", name, **GGUF_OPTIONS.get(name, {}))
    gguf = write_gguf(tmp / "hf", tmp / f"{name}.gguf", window_key=name == "mistral")
    convert_gguf(gguf, tmp / "converted")
    return json.loads((tmp / "hf" / "config.json").read_text())["model_type"], tmp / "hf", tmp / "converted"


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_weights_are_the_checkpoints(converted):
    """Exact, but for Gemma's norms: (w + 1) - 1 in float32 rounds."""
    model_type, original, folder = converted
    ours, reference = load_file(folder / WEIGHTS_FILE), load_file(original / "model.safetensors")
    if model_type == "gemma2":
        reference.pop("lm_head.weight", None)  # tied, as llama.cpp serves Gemma 2
    assert set(ours) == set(reference)
    for name, values in ours.items():
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            np.testing.assert_allclose(values, reference[name], rtol=0, atol=1e-6, err_msg=name)
        else:
            assert np.array_equal(values, reference[name]), name


def test_transformers_computes_the_same_logits_from_the_converted_folder(converted):
    """The rebuilt config means the same model: every setting that changes the output
    (rotary and its scaling, windows, soft caps, attention scale, biases, experts) is checked
    by the logits of a prompt longer than the sliding windows."""
    from transformers import AutoModelForCausalLM

    _, original, folder = converted
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_SIZES["vocab_size"], (1, LOGITS_PROMPT_LENGTH), generator=gen)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_memserve_serves_the_converted_folder_like_transformers(converted):
    model_type, original, folder = converted
    if model_type not in SUPPORTED_MODEL_TYPES:
        pytest.skip(f"model_type {model_type!r} is not in memserve's SUPPORTED_MODEL_TYPES yet")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    reference = transformers_greedy(hf, prompts(), NEW_TOKENS)
    engine = build_engine(EngineConfig(model=str(folder), dtype="float32", num_blocks=32, max_num_seqs=4), folder)
    assert [tokens for tokens, _ in generate(engine, prompts(), NEW_TOKENS)] == reference


def test_a_mistral_file_as_llama_cpp_writes_it_has_no_window(tmp_path):
    """llama.cpp's converter writes Mistral as Llama and leaves the window out: the file
    is served as llama.cpp serves it, attending to the whole context."""
    save_tiny_model(tmp_path / "hf", "mistral")
    convert_gguf(write_gguf(tmp_path / "hf", tmp_path / "mistral.gguf"), tmp_path / "converted")
    config = ModelConfig.from_folder(tmp_path / "converted")
    assert (config.model_type, config.sliding_window) == ("llama", None)


def test_a_scaling_the_decoder_lacks_is_kept_so_loading_refuses_it(tmp_path):
    """Phi-3.5's longrope (its factors are tensors in the file) reaches the config."""
    rotary_half = int(0.75 * TINY_SIZES["hidden_size"] / TINY_SIZES["num_attention_heads"]) // 2
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * rotary_half,
                "long_factor": [2.0] * rotary_half, "partial_rotary_factor": 0.75}
    save_tiny_model(tmp_path / "hf", "phi3", rope_parameters=longrope, original_max_position_embeddings=256)
    convert_gguf(write_gguf(tmp_path / "hf", tmp_path / "phi3.gguf"), tmp_path / "converted")
    rope = json.loads((tmp_path / "converted" / "config.json").read_text())["rope_parameters"]
    assert (rope["rope_type"], rope["long_factor"], rope["original_max_position_embeddings"]) == (
        "longrope", [2.0] * rotary_half, 256)
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        ModelConfig.from_folder(tmp_path / "converted")


def test_rope_divisors_of_another_llama3_curve_are_refused(tmp_path):
    rope = {**GGUF_OPTIONS["llama"]["rope_parameters"], "low_freq_factor": 2.0}
    save_tiny_model(tmp_path / "hf", "llama", rope_parameters=rope)
    with pytest.raises(ValueError, match="rope_freqs"):
        convert_gguf(write_gguf(tmp_path / "hf", tmp_path / "llama.gguf"), tmp_path / "converted")


def test_an_architecture_that_cannot_be_read_is_refused_by_name(tmp_path, monkeypatch):
    """Before any conversion starts, naming the file's architecture and the readable ones."""
    import gguf

    monkeypatch.setenv("MEMSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refusal = ("GGUF architecture 'falcon' is not supported "
               "(supported: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe)")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        ensure_model_dir(path)
    assert not (tmp_path / "cache").exists()
