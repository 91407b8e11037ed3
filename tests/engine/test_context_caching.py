"""Context caching in the real engine (real model, real MemPool): cached and uncached
paths give identical greedy tokens on multi-turn ShareGPT conversations, under eviction
pressure and with concurrent sessions sharing a system prompt; the gateway's mirror
built from the engine's KV events equals the engine's index."""

from __future__ import annotations

import random
import time

import pytest
from helpers.engine_replay import conversations, replay, run

from memserve.config import EngineConfig
from memserve.ipc.messages import decode, encode
from memserve.kvcache.events import REMOVED, KVEvents
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_folder(model_dir)


def make_engine(model_dir, caching: bool, num_blocks: int, num_host_blocks: int = 0, long_prefill: int = 0) -> Engine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=num_blocks, enable_prefix_caching=caching,
                       max_num_batched_tokens=512, num_host_blocks=num_host_blocks,
                       long_prefill_token_threshold=long_prefill)
    return build_engine(cfg, model_dir)


@pytest.fixture(scope="module")
def engines(model_dir):
    """A roomy caching engine, a tiny one (eviction pressure) and the uncached baseline.
    Each is emptied of running work between tests; cached KV legitimately carries over."""
    return {
        "cached": make_engine(model_dir, True, 400),
        "tiny": make_engine(model_dir, True, 12),
        "baseline": make_engine(model_dir, False, 400),
    }


def answers(replayed: list[dict]) -> list[dict]:
    """A replay's answer tokens per turn and session, without their cached counts."""
    return [{s: tokens for s, (tokens, _) in turn.items()} for turn in replayed]


def test_multiturn_sessions_identical_with_and_without_cache(engines, tokenizer):
    convs = conversations(3)
    cached = replay(engines["cached"], tokenizer, convs, 3, "a")
    base = replay(engines["baseline"], tokenizer, convs, 3, "b")
    for turn, (c, b) in enumerate(zip(cached, base)):
        for s in c:
            assert c[s][0] == b[s][0], f"session {s} turn {turn}"
            assert b[s][1] == 0
            if turn > 0:  # the whole previous turn (prompt and answer) is historical KV
                assert c[s][1] > 0


@pytest.fixture(scope="module")
def capped(model_dir):
    """A caching engine whose prefills compute at most 48 tokens a step."""
    return make_engine(model_dir, True, 400, long_prefill=48)


def test_capped_long_prefills_give_the_same_tokens(capped, engines, tokenizer):
    """``long_prefill_token_threshold`` cuts every prompt into chunks of 48 tokens that
    share their steps with the other sessions' chunks and decodes: the same tokens as
    prefills in one step each."""
    convs = conversations(3, seed=3)
    got = replay(capped, tokenizer, convs, 2, "cap")
    base = replay(engines["baseline"], tokenizer, convs, 2, "cap-b")
    assert answers(got) == answers(base)
    assert max(len(tokenizer.encode_chat(conv[:1])) for conv in convs) > 2 * 48  # prompts of several chunks
    assert any(cached for _, cached in got[1].values())  # the second turns reused the first ones' KV


def test_copies_of_a_prompt_in_prefill_wait_for_its_blocks(capped, engines, tokenizer):
    """Three copies of a long prompt submitted at once: the first prefills in chunks, the
    other two wait until it has computed their blocks and then compute only the block with
    their last token, giving the same tokens as the uncached engine."""
    conv = max(conversations(20, seed=5), key=lambda c: len(c[0]["content"]))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Copies: " + conv[0]["content"]}])
    assert len(prompt) > 2 * 48
    got = run(capped, {f"copy-{i}": prompt for i in range(3)})
    base = run(engines["baseline"], {"base": prompt})
    assert all(tokens == base["base"][0] for tokens, _ in got.values())
    whole = (len(prompt) - 1) // 16 * 16  # every full block but the one with the last token
    first, *copies = [cached for _, cached in got.values()]
    assert first < whole and copies == [whole, whole]


def test_identical_under_eviction_pressure(engines, tokenizer):
    tiny = engines["tiny"]
    convs = conversations(4, seed=1)
    pressured = replay(tiny, tokenizer, convs, 3, "c")
    base = replay(engines["baseline"], tokenizer, convs, 3, "d")
    assert answers(pressured) == answers(base)
    assert any(e.type == REMOVED for e in tiny.drain_kv_events())  # cached KV was evicted
    assert any(cached for turn in pressured[1:] for _, cached in turn.values())  # and some was reused
    stats = tiny.mempool.stats()["device"]
    assert stats["free"] + stats["evictable"] == stats["total"]  # nothing leaked


def test_host_tier_keeps_evicted_kv_and_swaps_it_back(model_dir, engines, tokenizer):
    """A device pool too small for the sessions demotes cached blocks to the host pool
    (real tensor copies) and swaps them back in for the next turn: same tokens, more
    reuse than dropping them."""
    tiered = make_engine(model_dir, True, 12, num_host_blocks=200)
    convs = conversations(4, seed=1)
    got = replay(tiered, tokenizer, convs, 3, "h")
    base = replay(engines["baseline"], tokenizer, convs, 3, "i")
    assert answers(got) == answers(base)
    assert tiered.stats()["num_swapped_in"] > 0
    host = tiered.mempool.stats()["host"]
    assert host["cached"] > 0


def test_a_load_that_completes_late_gives_the_same_tokens(model_dir, engines, tokenizer):
    """Slower-tier loads run off the engine's thread: one that takes long lets the other
    sessions step meanwhile, and the late request still answers exactly as without cache."""
    tiered = make_engine(model_dir, True, 12, num_host_blocks=200)
    preloader = tiered.runner.preloader
    preloader.layerwise = False  # whole loads (streamed ones: tests/engine/test_layerwise_preload.py)
    copy, steps_during_loads = preloader._copy_whole, []

    def slow_copy(tier, src, dst):
        before = tiered.num_steps
        time.sleep(0.5)
        copy(tier, src, dst)
        steps_during_loads.append(tiered.num_steps - before)

    preloader._copy_whole = slow_copy
    convs = conversations(4, seed=1)
    got = replay(tiered, tokenizer, convs, 3, "late")
    base = replay(engines["baseline"], tokenizer, convs, 3, "late-b")
    assert answers(got) == answers(base)
    assert steps_during_loads and max(steps_during_loads) > 0  # others stepped while a load ran


def test_concurrent_sessions_share_a_system_prompt(engines, tokenizer):
    system = {"role": "system", "content": "You are a meticulous assistant. " * 12}
    questions = ["What is a prime number?", "Name a large ocean.", "What is 2+2?", "Define entropy briefly."]
    prompts = {f"q{i}": tokenizer.encode_chat([system, {"role": "user", "content": q}])
               for i, q in enumerate(questions)}
    cached_engine = engines["cached"]
    first = run(cached_engine, {"e-q0": prompts["q0"]})  # warms the shared system prompt
    rest = run(cached_engine, {f"e-{k}": v for k, v in prompts.items() if k != "q0"})
    base = run(engines["baseline"], {f"f-{k}": v for k, v in prompts.items()})
    assert first["e-q0"][0] == base["f-q0"][0]
    for k in prompts:
        if k != "q0":
            assert rest[f"e-{k}"][0] == base[f"f-{k}"][0]
            assert rest[f"e-{k}"][1] >= 16 * (len(tokenizer.encode_chat([system])) // 16 - 1)


def test_gateway_mirror_equals_engine_index(model_dir, tokenizer):
    engine = make_engine(model_dir, True, 48)
    mirror = PromptTreeMirror(0, engine.cfg.block_size)
    rng = random.Random(7)
    convs = conversations(6, seed=2)
    for step in range(6):
        picks = rng.sample(range(len(convs)), 3)
        prompts = {f"m{step}-{i}": tokenizer.encode_chat(convs[i][: 1 + 2 * rng.randrange(2)]) for i in picks}
        run(engine, prompts, max_tokens=rng.randint(1, 20))
        batch = decode(encode(KVEvents(0, engine.drain_kv_events())))
        mirror.apply(batch)
        assert mirror.entries() == engine.mempool.index.entries()
    assert engine.mempool.stats()["device"]["evictable"] > 0
