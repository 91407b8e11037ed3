"""GGUF files whose matrices are quantized (Q4_0, Q4_1, Q8_0 by the ``gguf`` package's own
quantizers, the K-quants Q4_K, Q5_K, Q6_K, which it cannot write, by ``k_quantize`` here;
the embedding in Q8_0 as llama.cpp's mixes have it) served without widening them: the
linear layers keep the file's blocks (``workers/model/gguf_linear.py``), and memserve's
greedy tokens equal transformers' on the float32 folder converted from the same file, i.e.
on the dequantized weights. Also the kernels alone against the ``gguf`` package's
dequantization (of random K-quant bytes too), the real default file (and its Q4_K_M
requantization by llama.cpp, where built) served quantized against ``--quantization
none``, and the refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers.engine_generate import generate
from helpers.engine_replay import conversations
from helpers.hf_greedy import transformers_greedy
from helpers.llama_cpp_gguf import write_gguf
from helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse fixture)
from helpers.paths import SHARED_DATA

from memserve.config import EngineConfig
from memserve.model_files.default_model import default_gguf_path
from memserve.model_files.gguf_convert import QUANTIZED_FILE, convert_gguf, ensure_model_dir
from memserve.testing.random_models import TINY_SIZES, save_tiny_model
from memserve.text.tokenizer import Tokenizer
from memserve.workers.model import cpu_kernels
from memserve.workers.model.gguf_linear import GGUFLinear
from memserve.workers.model.linear import RowParallelLinear
from memserve.workers.model.loader import load_model
from memserve.workers.model.tensor_parallel import TensorParallel
from memserve.workers.real_engine import build_engine

if not cpu_kernels.available():
    pytest.skip("the CPU kernels cannot be built here (no C++ compiler or ninja)", allow_module_level=True)

NEW_TOKENS = 8
TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
K_TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]
# llama.cpp's quantizer, where memserve's llama.cpp build (benchmarks/peers) made one.
LLAMA_QUANTIZE = (Path.home() / ".cache/memserve/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
                  / "build/bin/llama-quantize")


def random_k_blocks(rng: np.random.Generator, ggml_type: GGMLQuantizationType, rows: int, width: int) -> np.ndarray:
    """Rows of K-quant super-blocks of random bytes (every quant, high bit and packed
    sub-block scale) under finite fp16 super-block scales (d, and Q4_K/Q5_K's dmin)."""
    size, nbytes = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows, width // size, nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, width // size, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if ggml_type == GGMLQuantizationType.Q6_K:
        blocks[..., 208:] = scales[..., :2]  # d comes last
    else:
        blocks[..., :4] = scales  # d, dmin first
    return blocks.reshape(rows, -1)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def _nonzero(values: np.ndarray) -> np.ndarray:
    return np.where(values > 0, values, 1)


def _q45_k(x: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (top 15) or Q5_K (31) super-blocks of x [n, 256]: per 32-weight sub-block a
    scale and a min, w = d sc q - dmin m."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    step = (sub.max(-1) - low) / top
    d, dmin = _f16(step.max(-1) / 63), _f16(-low.min(-1) / 63)
    sc = np.clip(np.round(step / _nonzero(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / _nonzero(dmin)[:, None]), 0, 63).astype(np.uint8)
    scale, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round((sub + offset[..., None]) / _nonzero(scale)[..., None]), 0, top).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    nibbles = ((q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4).reshape(-1, 128)
    high = [np.sum((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1, dtype=np.uint8)] if top == 31 else []
    halves = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)
    return np.concatenate([halves, packed, *high, nibbles], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks of x [n, 256]: per 16-weight sub-block an int8 scale, w = d sc (q - 32)."""
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = _f16(step.max(-1) / 127)
    sc = np.clip(np.round(step / _nonzero(d)[:, None]), 0, 127)
    scale = d[:, None] * sc
    q = (np.clip(np.round(sub / _nonzero(scale)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low = np.concatenate([(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4, (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4],
                         axis=2)
    high = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)


def k_quantize(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``values`` [rows, width] (width a multiple of 256) as K-quant blocks [rows, bytes],
    by plain rounding per sub-block (llama.cpp searches for better scales; the tests compare
    with the dequantized weights, whatever they are, so this only needs ggml's layouts)."""
    x = values.reshape(-1, 256).astype(np.float32)
    blocks = _q6_k(x) if ggml_type == GGMLQuantizationType.Q6_K else \
        _q45_k(x, 31 if ggml_type == GGMLQuantizationType.Q5_K else 15)
    return blocks.reshape(values.shape[0], -1)


def quantize_k_too(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``gguf.quants.quantize``, with the K-quants it lacks."""
    return k_quantize(values, ggml_type) if ggml_type in K_TYPES else quantize(values, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_linear_equals_the_product_with_its_dequantized_weight(ggml_type, rows, dtype):
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((96, 256), dtype=np.float32)
    blocks = np.ascontiguousarray(quantize(weight, ggml_type))
    dequantized = torch.from_numpy(dequantize(blocks, ggml_type).astype(np.float32))
    layer = GGUFLinear(torch.from_numpy(blocks), int(ggml_type), 256, dtype, activation_bits=32)
    x = torch.from_numpy(rng.standard_normal((rows, 256), dtype=np.float32)).to(dtype)
    expected = x.float() @ dequantized.T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(layer(x).float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    widened = cpu_kernels.gguf_dequantize(torch.from_numpy(blocks), int(ggml_type), 256, torch.float32)
    torch.testing.assert_close(widened, dequantized, atol=1e-6, rtol=1e-6)


def quantized_activations(x: np.ndarray, digits: int) -> np.ndarray:
    """x [rows, k] as the kernel holds it, widened back: per 32-block llama.cpp's Q8_0 / Q8_1
    (quantize_row_q8_0 / q8_1: d = max|x| / 127, q = round(x * (1 / d)); the scale kept in
    float32 here, the division by 127 a product with its float32 inverse as the kernel's
    -ffast-math build has it), and with two ``digits`` the rounding error x - d q again, in
    1/256ths of d."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) * (np.float32(1) / np.float32(127))
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.round(blocks * inverse)
    value = q.astype(np.float64) * d
    if digits == 2:
        residual = (blocks.astype(np.float64) - value).astype(np.float32)  # one rounding, as an FMA's
        q2 = np.minimum(np.round(residual * (inverse * np.float32(256))), 127)
        value += q2.astype(np.float64) * d / 256
    return value.reshape(x.shape)


INT8_TYPES = [*TYPES, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K]


@pytest.mark.skipif(not cpu_kernels.gguf_int8_types(), reason="no int8 path on this CPU (it needs AVX-512 VNNI)")
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 16])
@pytest.mark.parametrize("out_features", [96, 98])  # 98: a last group of two weight rows
@pytest.mark.parametrize("bits", [8, 16])
def test_integer_products_equal_the_product_of_the_quantized_activations(ggml_type, rows, out_features, bits):
    """Integer products equal the dequantized weight's with the activations as the kernel
    quantizes them, to float32 rounding; they differ from the float32 activations' product
    by up to about 1% of the largest in int8 (llama.cpp's), 1/256 of that in two digits."""
    assert set(INT8_TYPES) == set(cpu_kernels.gguf_int8_types())
    rng = np.random.default_rng(rows + out_features)
    weight = rng.standard_normal((out_features, 512), dtype=np.float32)
    blocks = np.ascontiguousarray(quantize_k_too(weight, ggml_type))
    dequantized = dequantize(blocks, ggml_type).astype(np.float64)
    scales = rng.uniform(0.01, 10, (rows, 16, 1)).astype(np.float32)  # blocks of unlike sizes
    x = (rng.standard_normal((rows, 16, 32), dtype=np.float32) * scales).reshape(rows, 512)
    x[:, :32] = 0  # an all-zero block (d = 0)
    got = cpu_kernels.gguf_matmul(torch.from_numpy(x), torch.from_numpy(blocks), int(ggml_type), bits).double().numpy()
    expected = quantized_activations(x, bits // 8) @ dequantized.T
    np.testing.assert_allclose(got, expected, atol=2e-6 * np.abs(expected).max(), rtol=0)
    exact = x.astype(np.float64) @ dequantized.T
    assert np.abs(got - exact).max() < (3e-2 if bits == 8 else 2e-4) * np.abs(exact).max()


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("bits", [8, 16, 32])
def test_bf16_activations_give_the_float32_product_rounded_to_bf16(ggml_type, bits):
    """A bf16 model's decode rows go in and come out in bf16: exactly the float32 product of
    the widened rows, rounded once, as the conversions around a float32 call would give."""
    rng = np.random.default_rng(bits)
    blocks = torch.from_numpy(np.ascontiguousarray(quantize_k_too(rng.standard_normal((64, 512), dtype=np.float32),
                                                                  ggml_type)))
    x = torch.from_numpy(rng.standard_normal((5, 512), dtype=np.float32)).to(torch.bfloat16)
    got = cpu_kernels.gguf_matmul(x, blocks, int(ggml_type), bits)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_kernels.gguf_matmul(x.float(), blocks, int(ggml_type), bits).to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_k_quant_linear_of_random_blocks_equals_the_product_with_its_dequantized_weight(ggml_type, rows, dtype):
    """Random bytes reach every scale bit and quant value; 40 rows take the widening path."""
    rng = np.random.default_rng(rows)
    blocks = random_k_blocks(rng, ggml_type, 48, 512)
    dequantized = torch.from_numpy(dequantize(blocks, ggml_type).astype(np.float32))
    layer = GGUFLinear(torch.from_numpy(blocks), int(ggml_type), 512, dtype)
    x = torch.from_numpy(rng.standard_normal((rows, 512), dtype=np.float32)).to(dtype)
    expected = x.float() @ dequantized.T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(layer(x).float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    widened = cpu_kernels.gguf_dequantize(torch.from_numpy(blocks), int(ggml_type), 512, torch.float32)
    torch.testing.assert_close(widened, dequantized, atol=1e-6 * dequantized.abs().max().item(), rtol=1e-6)


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_the_tests_k_quantizer_writes_ggmls_layouts(ggml_type):
    """Read back by the ``gguf`` package, ``k_quantize``'s blocks are the weights to within
    their rounding: the tiny K-quant models below are the random models, not noise."""
    weight = np.random.default_rng(0).standard_normal((8, 512), dtype=np.float32)
    error = np.abs(dequantize(k_quantize(weight, ggml_type), ggml_type) - weight)
    assert error.mean() < {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025}[ggml_type.name], error.mean()


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_a_row_parallel_layer_cuts_k_quant_blocks_at_whole_super_blocks(ggml_type):
    """768 inputs: three ranks take 256 each, and their products sum to the whole one; two
    ranks would cut a super-block in half, so the layer keeps its float weight."""
    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(random_k_blocks(rng, ggml_type, 8, 768))
    weight = torch.from_numpy(dequantize(blocks.numpy(), ggml_type).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((2, 768), dtype=np.float32))
    total = torch.zeros(2, 8)
    for rank in range(3):
        layer = RowParallelLinear(768, 8, False, TensorParallel(rank=rank, size=3))
        shard = layer.shard_blocks(blocks, int(ggml_type))
        assert shard is not None
        total += cpu_kernels.gguf_matmul(x[:, layer.start:layer.start + 256].contiguous(), shard, int(ggml_type))
    expected = x @ weight.T
    torch.testing.assert_close(total, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    assert RowParallelLinear(768, 8, False, TensorParallel(rank=0, size=2)).shard_blocks(blocks, int(ggml_type)) is None


@pytest.fixture(scope="module", params=[("llama", GGMLQuantizationType.Q4_0), ("llama", GGMLQuantizationType.Q4_1),
                                        ("llama", GGMLQuantizationType.Q8_0), ("phi3", GGMLQuantizationType.Q4_1),
                                        ("qwen2", GGMLQuantizationType.Q4_1), ("llama", GGMLQuantizationType.Q4_K),
                                        ("llama", GGMLQuantizationType.Q5_K), ("llama", GGMLQuantizationType.Q6_K),
                                        ("phi3", GGMLQuantizationType.Q4_K)],
                ids=lambda p: f"{p[0]}-{p[1].name}")
def quantized_file(request, tmp_path_factory) -> tuple[Path, GGMLQuantizationType]:
    """The folder converted from a tiny model's quantized GGUF file, and the type. For the
    K-quants, whose rows are whole 256-weight super-blocks, a model twice as wide."""
    name, ggml_type = request.param
    tmp = tmp_path_factory.mktemp(f"{name}-{ggml_type.name}")
    wider = {"hidden_size": 256, "intermediate_size": 512} if ggml_type in K_TYPES else {}
    save_tiny_model(tmp / "hf", name, **wider)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", quantize_k_too)  # what write_gguf calls
        convert_gguf(write_gguf(tmp / "hf", tmp / f"{name}.gguf", quantized=ggml_type), tmp / "converted")
    return tmp / "converted", ggml_type


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40)]


@pytest.mark.parametrize("quantization", ["gguf", "auto"])
def test_memserve_serves_the_blocks_with_the_dequantized_weights_greedy_tokens(quantized_file, quantization):
    """``gguf``: the blocks alone (the 40-token prefill widens each weight for its product);
    ``auto``: the blocks for decode rows, the weight also kept widened and packed for the
    prefill's rows. Both give transformers' tokens on the widened weights."""
    folder, _ = quantized_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the widened weights
    reference = transformers_greedy(hf, prompts(), NEW_TOKENS)
    cfg = EngineConfig(model=str(folder), dtype="float32", num_blocks=32, max_num_seqs=4, quantization=quantization)
    engine = build_engine(cfg, folder)
    quantized = [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
    assert quantized and any(m.out_features == TINY_SIZES["vocab_size"] for m in quantized)  # the lm_head too
    assert all((m.wide is not None) == (quantization == "auto") for m in quantized)
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
    agree = quantized_agreement(folder, chats, num_blocks=256, max_num_seqs=24)
    assert agree >= 22, agree


def quantized_agreement(folder: Path, prompts: list[list[int]], num_blocks: int, max_num_seqs: int) -> int:
    """Of ``prompts``, how many give the same 16 greedy tokens quantized and under
    ``--quantization none``."""
    outputs = {}
    for quantization in ("none", "gguf"):
        engine = build_engine(EngineConfig(dtype="float32", num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                           quantization=quantization), folder)
        outputs[quantization] = [tokens for tokens, _ in generate(engine, prompts, 16)]
    return sum(a == b for a, b in zip(outputs["none"], outputs["gguf"]))


@pytest.mark.slow  # two SmolLM2 engines, 32 prompts
@pytest.mark.skipif(not (SHARED_DATA / "sharegpt-sample.jsonl").is_file(), reason="no ShareGPT sample here")
def test_the_default_file_served_quantized_gives_the_widened_models_tokens_on_sharegpt():
    """The first turns of 32 ShareGPT conversations, 16 greedy tokens each, at most 8
    sequences a step (decode rows through the blocks' integer products): quantized and
    ``--quantization none`` agree on at least 30 (int8 activations alone kept 22; their
    two digits, the default, 32)."""
    folder = ensure_model_dir(None)
    tokenizer = Tokenizer.from_folder(folder)
    prompts = [tokenizer.encode_chat([conversation[0]]) for conversation in conversations(32)]
    agree = quantized_agreement(folder, prompts, num_blocks=512, max_num_seqs=8)
    assert agree >= 30, agree


@pytest.mark.slow  # llama.cpp's requantization and two SmolLM2 engines
@pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason="no llama.cpp build with llama-quantize here")
def test_the_default_file_requantized_to_q4_k_m_served_quantized_gives_the_widened_models_tokens(tmp_path):
    """SmolLM2 requantized by llama.cpp into its Q4_K_M mix: down projections in Q4_K and
    Q6_K (the others, 576 wide, fall back to Q5_0 and Q8_0). 16 greedy tokens of 12 prompts:
    quantized and ``--quantization none`` agree on at least 11."""
    path = tmp_path / "smollm2-q4_k_m.gguf"
    subprocess.run([str(LLAMA_QUANTIZE), "--allow-requantize", str(default_gguf_path()), str(path), "Q4_K_M"],
                   check=True, capture_output=True)
    convert_gguf(path, tmp_path / "converted")
    folder = tmp_path / "converted"
    gen = torch.Generator().manual_seed(2)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    chats = [torch.randint(100, vocab, (int(n),), generator=gen).tolist()
             for n in torch.randint(8, 120, (12,), generator=gen)]
    outputs = {}
    for quantization in ("none", "gguf"):
        engine = build_engine(EngineConfig(dtype="float32", num_blocks=128, max_num_seqs=12,
                                           quantization=quantization), folder)
        if quantization == "gguf":
            kinds = {m.ggml_type for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)}
            assert {int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q6_K)} <= kinds
        outputs[quantization] = [tokens for tokens, _ in generate(engine, chats, 16)]
    agree = sum(a == b for a, b in zip(outputs["none"], outputs["gguf"]))
    assert agree >= 11, agree


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
