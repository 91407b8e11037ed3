"""The real engine under bad input and at start: a request that fails a step fails alone,
warm-up leaves no trace, and the served context never exceeds what the KV pool holds."""

from __future__ import annotations

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine
from memserve.workers.warmup import warm_up

PROMPT = [1, 504, 3458, 282, 4649, 314]  # a few in-vocabulary token ids


def make_engine(model_dir, num_blocks: int = 64, **kw) -> Engine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=num_blocks, max_num_batched_tokens=256, **kw)
    return build_engine(cfg, model_dir)


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int = 8) -> dict[str, tuple[list[int], str, str]]:
    """Request id -> (tokens, finish reason, error) of greedy requests run to the end."""
    results: dict[str, tuple[list[int], str, str]] = {}
    for rid, ids in prompts.items():
        out = engine.add_request(AddRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        assert out is None, out
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                results[out.request_id] = (tokens[out.request_id], out.finish_reason, out.error)
    return results


def assert_no_block_held(engine: Engine) -> None:
    device = engine.mempool.stats()["device"]
    assert device["free"] + device["evictable"] == device["total"], device


def test_a_request_that_fails_the_step_fails_alone(model_dir):
    engine = make_engine(model_dir)
    alone = run(make_engine(model_dir), {"good": PROMPT})
    vocab = engine.runner.model_config.vocab_size
    results = run(engine, {"good": PROMPT, "bad": PROMPT[:3] + [vocab + 5] + PROMPT[3:]})
    assert results["bad"][1] == "error" and "engine step failed" in results["bad"][2]
    assert results["good"] == alone["good"]
    assert_no_block_held(engine)
    assert run(engine, {"after": PROMPT})["after"][0] == alone["good"][0]  # the engine keeps serving


def test_warm_up_leaves_no_trace(model_dir):
    cold = make_engine(model_dir)
    want = run(cold, {"a": PROMPT, "b": PROMPT[:4]})
    engine = make_engine(model_dir)
    before = engine.stats()
    assert warm_up(engine) > 3
    assert engine.stats() == before
    assert engine.drain_kv_events() == []
    assert run(engine, {"a": PROMPT, "b": PROMPT[:4]}) == want


def test_served_context_is_capped_by_the_pool(model_dir):
    engine = make_engine(model_dir, num_blocks=8)
    assert engine.max_model_len == 8 * engine.cfg.block_size
    assert make_engine(model_dir, num_blocks=8, max_model_len=64).max_model_len == 64
