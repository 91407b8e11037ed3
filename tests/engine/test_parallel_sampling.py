"""n > 1 in the real engine (no server): choice i of ``n, seed=S`` equals the request
``seed=S+i`` run alone, with prefix caching (shared prompt blocks) and without it (copied
blocks); the choices hold the prompt's full blocks once; aborting the request frees every
choice's blocks."""

from __future__ import annotations

import pytest

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine

BLOCK_SIZE = 16
PROMPT = list(range(100, 140))  # 2 full blocks and 8 tokens
# Seeded draws among the 20 likeliest tokens. A choice computes its first token over the
# cached prompt, a request alone over a fresh prefill: the logits agree to ~1e-6, not
# bit for bit, and a draw by inverse CDF over the whole 49k vocabulary (a cumulative sum
# over thousands of tokens) can cross a token boundary on that; over 20 it practically cannot.
SEEDED = dict(temperature=1.0, top_k=20)


def make_engine(model_dir, **kw) -> Engine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=256, **kw)
    return build_engine(cfg, model_dir)


def run(engine: Engine, requests: dict[str, SamplingParams]) -> dict[tuple[str, int], list[int]]:
    """(request id, choice index) -> tokens."""
    for rid, params in requests.items():
        assert engine.add_request(AddRequest(rid, PROMPT, params)) is None
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return tokens


def device_blocks(engine: Engine) -> dict:
    return engine.mempool.stats()["device"]


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    """One caching engine for the module: every test leaves it with no block in use."""
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    """Choice i's expected tokens: seed 7+i, run as ordinary requests."""
    out = run(engine, {f"s{i}": SamplingParams(max_tokens=6, seed=7 + i, **SEEDED)
                                       for i in range(4)})
    return [out[(f"s{i}", 0)] for i in range(4)]


@pytest.mark.parametrize("caching", [True, False], ids=["shared-blocks", "copied-blocks"])
def test_choice_i_equals_the_request_seeded_s_plus_i(model_dir, engine, alone, caching):
    engine = engine if caching else make_engine(model_dir, enable_prefix_caching=False)
    out = run(engine, {"r": SamplingParams(max_tokens=6, seed=7, n=4, **SEEDED)})
    assert [out[("r", i)] for i in range(4)] == alone
    assert device_blocks(engine)["used"] == 0


def test_choices_hold_the_prompt_blocks_once_and_abort_frees_them(engine):
    assert engine.add_request(AddRequest("r", PROMPT, SamplingParams(max_tokens=50, temperature=1.0, n=3))) is None
    assert [(o.request_id, o.index) for o in engine.step()] == [("r", 0)]  # the prefill, then the fork
    assert sorted(o.index for o in engine.step()) == [0, 1, 2]
    # 2 full prompt blocks shared, one partly filled block each: not 3 * 3.
    assert device_blocks(engine)["used"] == (len(PROMPT) - 1) // BLOCK_SIZE + 3
    assert engine.abort("r") is None  # every choice stops (the request itself has no sequence of its own)
    while engine.has_work:
        engine.step()
    assert device_blocks(engine)["used"] == 0 and not engine.scheduler.running


def test_one_choice_can_be_aborted_alone(engine):
    assert engine.add_request(AddRequest("r", PROMPT, SamplingParams(max_tokens=4, temperature=1.0, n=2))) is None
    engine.step()
    engine.step()
    aborted = engine.abort("r#1")
    assert (aborted.request_id, aborted.index, aborted.finish_reason) == ("r", 1, "abort")
    finished = {}
    while engine.has_work:
        finished.update({o.index: o.finish_reason for o in engine.step() if o.finished})
    assert finished == {0: "length"} and device_blocks(engine)["used"] == 0
