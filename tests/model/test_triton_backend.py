"""``--attention-backend triton`` on the CPU, the kernel run by Triton's interpreter: tiny
random models served by the engine decode transformers' greedy tokens token for token,
cold and from the prefix cache, with prompts prefilled in chunks of 16 beside other
requests' decodes: Llama (GQA) with n-gram drafts, so that decodes with verify rows share
steps with the chunks, and Gemma 2 (a sliding and a global layer, soft-capped scores),
both also with their decode steps replayed from CUDA-graph plans (Llama's with the
verify rows of their drafts, padded to the most drafts).
The plans alone: the kernel's output equals the SDPA path's for a batch of decode rows,
verify rows, a chunk after a cached prefix and a prompt (both KV layouts, a window, a
soft-cap), and for a CUDA-graph decode plan run eagerly.

Everything the kernel runs in one process of its own started with TRITON_INTERPRET=1
(``helpers/triton_backend_run.py``): triton chooses its interpreter as it is imported,
and this process imports it already through transformers. Here: which backend a worker
resolves ``--attention-backend`` to, and that triton on the CPU without the interpreter
is refused at start, naming the flag."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf_greedy import transformers_greedy
from helpers.paths import TESTS

from memserve.cli import build_parser
from memserve.config import EngineConfig
from memserve.testing.random_models import save_tiny_model
from memserve.workers.model import attention_backend
from memserve.workers.model.attention_backend import choose_attention_backend
from memserve.workers.real_engine import build_engine

# Looked for, not imported: triton imported here would be compiling, not interpreting, for
# test_triton_attention.py collected after this file in the same process.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the test extra)", allow_module_level=True)

NEW_TOKENS = 6
PROMPT_LENGTHS = (5, 37, 20)  # 37 and 20: past the window (24) and a block (16)
BLOCK_SIZE = 16
CHUNKED = {"long_prefill_token_threshold": 16}
DRAFTS = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                 "prompt_lookup_min": 1}}
# Two layers each; Llama over a 64-token vocabulary, so that most tokens it decodes occur
# in its prompt and n-gram drafts are proposed.
MODELS = {"llama": {"num_hidden_layers": 2, "vocab_size": 64}, "gemma2": {"num_hidden_layers": 2}}
OPTIONS = {"llama": {**CHUNKED, **DRAFTS}, "gemma2": CHUNKED}
# Engines whose pure decode steps replay CUDA-graph plans (captured by re-running them).
GRAPHED = {"gemma2-graphs": "gemma2", "llama-graphs": "llama"}
CPU = torch.device("cpu")
F32 = torch.float32


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """One interpreted process for every check that runs the kernel: {"engines": {family:
    (results, transformers' tokens)}, "plans": ..., "static": ...}."""
    engines, references = {}, {}
    for family, sizes in MODELS.items():
        folder = tmp_path_factory.mktemp(family)
        hf = save_tiny_model(folder, family, **sizes)
        ids = prompts(sizes.get("vocab_size", 512))
        references[family] = transformers_greedy(hf, ids, NEW_TOKENS)
        engines[family] = {"folder": str(folder), "prompts": ids, "new_tokens": NEW_TOKENS, "options": OPTIONS[family]}
    for name, family in GRAPHED.items():
        engines[name] = {**engines[family], "graphs": True}
        references[name] = references[family]
    spec = {"engines": engines, "plans": [[0, 0.0, "aggregated"], [7, 0.0, "layer-major"], [0, 5.0, "aggregated"]],
            "static": ["aggregated", "layer-major"]}
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(TESTS / "helpers" / "triton_backend_run.py"), json.dumps(spec)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["engines"] = {family: (got, references[family]) for family, got in out["engines"].items()}
    return out


@pytest.mark.parametrize("name", sorted(MODELS) + sorted(GRAPHED))
def test_served_tokens_match_transformers(served, name):
    got, reference = served["engines"][name]
    assert [tokens for tokens, _ in got["cold"]] == reference
    assert [cached for _, cached in got["cold"]] == [0] * len(PROMPT_LENGTHS)
    assert [tokens for tokens, _ in got["hit"]] == reference
    assert [cached for _, cached in got["hit"]] == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS]
    if "speculative_config" in OPTIONS[GRAPHED.get(name, name)]:
        assert got["drafts"] > 0  # decodes with verify rows ran
    # A graphed engine's decode steps were replayed: Gemma's with a window and soft-capped
    # scores, Llama's with their drafts' verify rows too.
    assert (got["replays"] > 0) == (name in GRAPHED)
    assert (got["wide_replays"] > 0) == (name == "llama-graphs")


def test_plans_attend_like_sdpa(served):
    """Mixed batches (plain, a window of 7 in the layer-major layout, a soft-cap of 5) and
    the eager CUDA-graph decode plan, float32."""
    for name, difference in {**served["plans"], **served["static"]}.items():
        assert difference < 1e-5, name
    assert len(served["plans"]) == 3 and len(served["static"]) == 2


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch, tmp_path, caplog):
    """Refused as the worker starts, naming the flag, without importing triton's kernel;
    the CPU's default is the SDPA family, and the worker says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    save_tiny_model(tmp_path, "llama", num_hidden_layers=1)
    options = {"model": str(tmp_path), "dtype": "float32", "num_blocks": 8, "cpu_prefill_attention": "sdpa"}
    with pytest.raises(ValueError, match="--attention-backend triton cannot run here: .*TRITON_INTERPRET=1"):
        build_engine(EngineConfig(attention_backend="triton", **options), tmp_path)
    assert "memserve.workers.model.triton_attention" not in sys.modules
    with caplog.at_level(logging.INFO, logger="memserve.workers.model.attention_backend"):
        engine = build_engine(EngineConfig(**options), tmp_path)
    assert engine.runner.attention_backend == "sdpa"
    assert "attention backend: sdpa (--attention-backend auto)" in caplog.text


def test_cpu_backends(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_attention_backend("auto", CPU, 64, F32) == "sdpa"
    assert choose_attention_backend("sdpa", CPU, 64, F32) == "sdpa"
    with pytest.raises(ValueError, match="--attention-backend xformers needs a CUDA GPU"):
        choose_attention_backend("xformers", CPU, 64, F32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="no bfloat16 arithmetic"):
        choose_attention_backend("triton", CPU, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 8 is under 16"):
        choose_attention_backend("triton", CPU, 8, F32)


@pytest.mark.parametrize(("capability", "head_dim", "fp8_cache", "expected"), [
    ((9, 0), 128, True, "triton"),
    ((8, 0), 64, False, "triton"),
    ((8, 6), 64, True, "fallback"),  # an FP8 cache: triton has no e4m3 before Hopper
    ((7, 5), 64, False, "fallback"),
    ((9, 0), 8, False, "fallback"),
])
@pytest.mark.parametrize("xformers", [True, False])
def test_auto_on_cuda_takes_the_first_that_loads(monkeypatch, capability, head_dim, fp8_cache, expected, xformers):
    """No GPU needed: the device's compute capability and xformers' import are stood in."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention_backend, "xformers_loads", lambda: xformers)
    cuda = torch.device("cuda", 0)
    fallback = "xformers" if xformers else "sdpa"
    assert choose_attention_backend("auto", cuda, head_dim, F32, fp8_cache) == (
        fallback if expected == "fallback" else expected)
    if expected == "fallback":
        with pytest.raises(ValueError, match="--attention-backend triton cannot run here"):
            choose_attention_backend("triton", cuda, head_dim, F32, fp8_cache)
    assert choose_attention_backend("sdpa", cuda, head_dim, F32, fp8_cache) == "sdpa"


def test_flag_reads_vllm_spellings():
    def parsed(value: str) -> str:
        return build_parser().parse_args(["up", "--attention-backend", value]).attention_backend

    assert [parsed(v) for v in ("TRITON_ATTN", "XFORMERS", "TORCH_SDPA", "triton", "auto")] == [
        "triton", "xformers", "sdpa", "triton", "auto"]
    assert choose_attention_backend("TORCH_SDPA", CPU, 64, F32) == "sdpa"
    with pytest.raises(SystemExit):
        parsed("FLASH_ATTN")
