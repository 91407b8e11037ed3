"""Tensor parallelism on the CPU (gloo, float32): tiny random models of every family,
served by an engine whose model is split over two rank processes, give transformers'
greedy tokens cold, from the prefix cache, with prefills in chunks beside other
requests' decodes, with n-gram drafts verified, and after a round trip of their cached
blocks through the host tier, and no block stays held. KV heads fewer than, equal to and more than the ranks; a model
whose heads do not divide by the ranks is refused naming both numbers; the embedded
SmolLM2 (9 heads over 3 KV heads) at three ranks gives the tokens of one.

Each engine runs in a process of its own (``helpers/tensor_parallel_run.py``): a process
joins one process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf_greedy import transformers_greedy
from helpers.paths import TESTS

from memserve.testing.random_models import TINY_ARCHITECTURES, TINY_SIZES, save_tiny_model

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 40, 17, 70)
BLOCK_SIZE = 16
CHUNKED = {"long_prefill_token_threshold": 16}


def prompts(vocab_size: int = TINY_SIZES["vocab_size"]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def run_engine(folder: Path, tp: int, prompt_ids: list[list[int]], options: dict | None = None,
               timeout: float = 240) -> dict:
    spec = {"folder": str(folder), "tp": tp, "prompts": prompt_ids, "new_tokens": NEW_TOKENS, "options": options or {}}
    result = subprocess.run([sys.executable, str(TESTS / "helpers" / "tensor_parallel_run.py"), json.dumps(spec)],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_served_like(result: dict, reference: list[list[int]], lengths: tuple[int, ...] = PROMPT_LENGTHS) -> None:
    full_blocks = [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths]
    assert [tokens for tokens, _ in result["cold"]] == reference
    assert [cached for _, cached in result["cold"]] == [0] * len(lengths)
    for again in ("hit", "host"):
        assert [tokens for tokens, _ in result[again]] == reference, again
        assert [cached for _, cached in result[again]] == full_blocks, again
    assert result["swapped_in"] > 0
    assert result["free"] == result["total"]  # nothing held once every request is done


@pytest.mark.parametrize("family", sorted(TINY_ARCHITECTURES))
def test_two_ranks_serve_transformers_tokens(family, tmp_path):
    hf = save_tiny_model(tmp_path, family)
    ids = prompts()
    assert_served_like(run_engine(tmp_path, 2, ids, CHUNKED), transformers_greedy(hf, ids, NEW_TOKENS))


def test_two_ranks_verify_ngram_drafts(tmp_path):
    """Prompts that end by repeating themselves and their answer, so the n-gram proposer
    finds drafts: verified over two ranks, they give transformers' tokens."""
    hf = save_tiny_model(tmp_path, "llama")
    ids = prompts()[:2]
    first = transformers_greedy(hf, ids, NEW_TOKENS)
    echo = [p + answer + p for p, answer in zip(ids, first)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    result = run_engine(tmp_path, 2, echo, {"speculative_config": spec})
    assert_served_like(result, transformers_greedy(hf, echo, NEW_TOKENS), tuple(len(p) for p in echo))
    assert result["drafted"] > 0 and result["accepted"] > 0


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_kv_heads_replicated_or_split(kv_heads, tmp_path):
    """One KV head is replicated on both ranks; four are split two and two (two, one each,
    is the families' case)."""
    hf = save_tiny_model(tmp_path, "qwen2", num_key_value_heads=kv_heads)
    ids = prompts()
    assert_served_like(run_engine(tmp_path, 2, ids), transformers_greedy(hf, ids, NEW_TOKENS))


def test_heads_that_do_not_divide_are_refused(tmp_path):
    save_tiny_model(tmp_path, "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    spec = {"folder": str(tmp_path), "tp": 4, "prompts": [[1, 2]], "new_tokens": 1}
    result = subprocess.run([sys.executable, str(TESTS / "helpers" / "tensor_parallel_run.py"), json.dumps(spec)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "the number of attention heads (6) is not divisible by --tensor-parallel-size (4)" in result.stderr


@pytest.mark.slow  # 30 s: four processes load the embedded model
def test_smollm2_at_three_ranks_gives_one_ranks_tokens(model_dir):
    """9 query heads and 3 KV heads: three ranks of 3 and 1."""
    ids = prompts(1000)
    one, three = run_engine(model_dir, 1, ids), run_engine(model_dir, 3, ids)
    assert [t for t, _ in three["cold"]] == [t for t, _ in one["cold"]]
    assert [t for t, _ in three["hit"]] == [t for t, _ in one["cold"]]
