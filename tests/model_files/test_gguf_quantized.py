"""GGUF files whose matrices are quantized (Q4_0, Q4_1, Q8_0, by the ``gguf`` package's own
quantizers, the embedding in Q8_0 as llama.cpp's mixes have it) served without widening
them: the linear layers keep the file's blocks (``workers/model/gguf_linear.py``), and
memserve's greedy tokens equal transformers' on the float32 folder converted from the same
file, i.e. on the dequantized weights. Also the kernels alone against the ``gguf``
package's dequantization, the real default file served quantized against
``--quantization none``, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers.engine_generate import generate
from helpers.hf_greedy import transformers_greedy
from helpers.llama_cpp_gguf import write_gguf
from helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse fixture)

from memserve.config import EngineConfig
from memserve.model_files.gguf_convert import QUANTIZED_FILE, convert_gguf, ensure_model_dir
from memserve.testing.random_models import TINY_SIZES, save_tiny_model
from memserve.workers.model import cpu_kernels
from memserve.workers.model.gguf_linear import GGUFLinear
from memserve.workers.model.loader import load_model
from memserve.workers.real_engine import build_engine

if not cpu_kernels.available():
    pytest.skip("the CPU kernels cannot be built here (no C++ compiler or ninja)", allow_module_level=True)

NEW_TOKENS = 8
TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_linear_equals_the_product_with_its_dequantized_weight(ggml_type, rows, dtype):
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((96, 256), dtype=np.float32)
    blocks = np.ascontiguousarray(quantize(weight, ggml_type))
    dequantized = torch.from_numpy(dequantize(blocks, ggml_type).astype(np.float32))
    layer = GGUFLinear(torch.from_numpy(blocks), int(ggml_type), 256, dtype)
    x = torch.from_numpy(rng.standard_normal((rows, 256), dtype=np.float32)).to(dtype)
    expected = x.float() @ dequantized.T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(layer(x).float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    widened = cpu_kernels.gguf_dequantize(torch.from_numpy(blocks), int(ggml_type), 256, torch.float32)
    torch.testing.assert_close(widened, dequantized, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module", params=[("llama", GGMLQuantizationType.Q4_0), ("llama", GGMLQuantizationType.Q4_1),
                                        ("llama", GGMLQuantizationType.Q8_0), ("phi3", GGMLQuantizationType.Q4_1),
                                        ("qwen2", GGMLQuantizationType.Q4_1)],
                ids=lambda p: f"{p[0]}-{p[1].name}")
def quantized_file(request, tmp_path_factory) -> tuple[Path, GGMLQuantizationType]:
    """The folder converted from a tiny model's quantized GGUF file, and the type."""
    name, ggml_type = request.param
    tmp = tmp_path_factory.mktemp(f"{name}-{ggml_type.name}")
    save_tiny_model(tmp / "hf", name)
    convert_gguf(write_gguf(tmp / "hf", tmp / f"{name}.gguf", quantized=ggml_type), tmp / "converted")
    return tmp / "converted", ggml_type


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40)]


def test_memserve_serves_the_blocks_with_the_dequantized_weights_greedy_tokens(quantized_file):
    folder, _ = quantized_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the widened weights
    reference = transformers_greedy(hf, prompts(), NEW_TOKENS)
    cfg = EngineConfig(model=str(folder), dtype="float32", num_blocks=32, max_num_seqs=4, quantization="gguf")
    engine = build_engine(cfg, folder)
    quantized = [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
    assert quantized and any(m.out_features == TINY_SIZES["vocab_size"] for m in quantized)  # the lm_head too
    assert [tokens for tokens, _ in generate(engine, prompts(), NEW_TOKENS)] == reference


def test_the_converted_blocks_name_each_weights_type(quantized_file):
    from safetensors import safe_open

    folder, ggml_type = quantized_file
    with safe_open(str(folder / QUANTIZED_FILE), framework="pt") as f:
        types = {name: int(t) for name, t in (f.metadata() or {}).items()}
        assert any(".mlp." in name for name in f.keys())
    assert set(types.values()) == {int(ggml_type)}  # the untied lm_head too; the embedding stays float


def test_the_default_file_served_quantized_gives_the_widened_models_tokens():
    """SmolLM2's own Q4_1 file (and its Q8_0 embedding as the tied lm_head), 16 greedy tokens
    of 24 ShareGPT-like prompts: quantized and ``--quantization none`` agree on at least 22."""
    folder = ensure_model_dir(None)
    gen = torch.Generator().manual_seed(1)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    chats = [torch.randint(100, vocab, (int(n),), generator=gen).tolist()
             for n in torch.randint(8, 120, (24,), generator=gen)]
    outputs = {}
    for quantization in ("none", "gguf"):
        engine = build_engine(EngineConfig(dtype="float32", num_blocks=256, max_num_seqs=24,
                                           quantization=quantization), folder)
        outputs[quantization] = [tokens for tokens, _ in generate(engine, chats, 16)]
    agree = sum(a == b for a, b in zip(outputs["none"], outputs["gguf"]))
    assert agree >= 22, agree


def test_quantized_execution_is_refused_by_name_where_it_cannot_run(tmp_path):
    save_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="--quantization gguf cannot serve .* no GGUF weights"):
        load_model(tmp_path, torch.float32, "cpu", quantization="gguf")
    with pytest.raises(ValueError, match="unknown quantization 'awq4'"):
        load_model(tmp_path, torch.float32, "cpu", quantization="awq4")
    assert not any(isinstance(m, GGUFLinear) for m in load_model(tmp_path, torch.float32, "cpu").modules())


def test_a_checkpoint_quantized_by_another_method_is_refused_by_name(tmp_path):
    save_tiny_model(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        load_model(tmp_path, torch.float32, "cpu", quantization="none")


def test_readers_of_the_folders_weights_do_not_take_the_blocks_for_weights(quantized_file):
    from memserve.predictor.embeddings import TokenEmbeddings
    from memserve.workers.model.loader import read_safetensors

    folder, _ = quantized_file
    assert all(t.is_floating_point() for t in read_safetensors(folder, torch.float32, "cpu").values())
    TokenEmbeddings.from_model_dir(folder)  # the gateway's length predictor reads the embedding table
