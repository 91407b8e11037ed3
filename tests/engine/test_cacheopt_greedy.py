"""Greedy outputs are the same under fcfs and cacheopt on the real engine (SmolLM2 on
CPU), with a pool small enough that cacheopt preempts, swapping through the host tier:
scheduling changes when tokens are computed, never which."""

from __future__ import annotations

import pytest

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine

PROMPTS = ["Write a haiku about the sea.", "What is the capital of France? Answer in one sentence.",
           "List three prime numbers.", "Explain what a KV cache is, briefly.", "Say hello in Spanish.",
           "Why is the sky blue?"]
MAX_TOKENS = 24


def run(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        # Predictions far too short: requests outgrow their allocations and collide.
        req = AddRequest(f"r{i}", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                         slo_ttft_ms=50.0 * (i + 1), slo_tbt_ms=100.0 * (i % 3 + 1), predicted_output_tokens=2)
        assert engine.add_request(req) is None
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.slow  # about a minute of CPU: the real model, twice
def test_greedy_tokens_are_identical_across_policies():
    model_dir = ensure_model_dir(None)
    tokenizer = Tokenizer.from_folder(model_dir)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    results, stats = {}, {}
    for policy in ("fcfs", "cacheopt"):
        cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=14, num_host_blocks=64,
                           max_num_batched_tokens=256, schedule_policy=policy,
                           schedule_policy_options="reserve=0;disable=PA" if policy == "cacheopt" else "")
        engine = build_engine(cfg, model_dir)
        if policy == "cacheopt":
            engine.scheduler.policy.sweet_spot = 16  # swap any victim with a full block (no profile here)
        results[policy] = run(engine, prompts)
        stats[policy] = engine.stats()
        engine.close()
    assert results["cacheopt"] == results["fcfs"]
    assert all(len(tokens) == MAX_TOKENS for tokens in results["fcfs"].values())
    assert stats["cacheopt"]["preemptions"]["swap"] > 0  # the pool was tight enough to matter
