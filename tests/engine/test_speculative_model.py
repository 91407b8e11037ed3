"""N-gram speculative decoding on the real model: greedy tokens equal plain decoding's
(itself equal to transformers', tests/model/test_model_equivalence.py) on prompts that
quote themselves, on multi-turn ShareGPT conversations and beside requests that cannot
draft (log-probabilities, top-p sampling), whose outputs are unchanged; the drafts are
accepted often enough to save steps; sampled requests draft too, and a seeded one gives
the tokens it gives without drafts, whatever its draft depth or batch; no block is left
behind. (That speculative sampling keeps each token's distribution is
tested on the sampler, tests/model/test_sampler.py.)"""

from __future__ import annotations

import pytest
from helpers.engine_replay import conversations, replay
from helpers.one_thread import one_intra_op_thread  # noqa: F401  (a module fixture)
from helpers.scripted_engine import assert_no_block_held

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
QUOTING = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Rename the variable total to sum in this code:\ndef add(values):\n    total = 0\n    for v in values:\n"
    "        total += v\n    return total\n",
    "List the numbers from 1 to 30, separated by commas.",
]


def make_engine(model_dir, spec: dict | None) -> Engine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=256, max_num_batched_tokens=512,
                       speculative_config=spec)
    return build_engine(cfg, model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_folder(model_dir)


@pytest.fixture(scope="module")
def engines(model_dir) -> dict[str, Engine]:
    return {"plain": make_engine(model_dir, None), "spec": make_engine(model_dir, SPEC)}


def generate(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Each request's tokens and, where asked, its logprobs, all submitted at once."""
    out: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        assert engine.add_request(AddRequest(rid, prompt, params)) is None
    while engine.has_work:
        for o in engine.step():
            if o.logprobs:  # (token, its logprob) pairs
                out[o.request_id] += [(t, lp[0]) for t, lp in zip(o.new_token_ids, o.logprobs)]
            else:
                out[o.request_id] += o.new_token_ids
    return out


def test_quoting_prompts_decode_the_same_tokens_in_fewer_steps(engines, tokenizer):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    requests = {f"q{i}": (tokenizer.encode_chat([{"role": "user", "content": text}]), params)
                for i, text in enumerate(QUOTING)}
    steps = {}
    results = {}
    for name, engine in engines.items():
        before = engine.num_steps
        results[name] = generate(engine, requests)
        steps[name] = engine.num_steps - before
    assert results["spec"] == results["plain"]
    stats = engines["spec"].scheduler.stats()
    assert stats["spec_accepted_tokens_total"] >= 10, stats
    assert steps["spec"] < steps["plain"], steps
    for engine in engines.values():
        assert_no_block_held(engine)


def test_multiturn_conversations_decode_the_same_tokens(engines, tokenizer):
    convs = conversations(2, seed=3)
    spec = replay(engines["spec"], tokenizer, convs, 3, "s")
    plain = replay(engines["plain"], tokenizer, convs, 3, "p")
    assert [{s: t for s, (t, _) in turn.items()} for turn in spec] == \
           [{s: t for s, (t, _) in turn.items()} for turn in plain]


def test_requests_that_cannot_draft_are_unchanged_beside_those_that_do(engines, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUOTING[2]}])
    requests = {
        "greedy": (prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        "logprobs": (prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)),
        "top-p": (prompt, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)),
    }
    spec, plain = generate(engines["spec"], requests), generate(engines["plain"], requests)
    assert spec["greedy"] == plain["greedy"]
    assert [t for t, _ in spec["logprobs"]] == [t for t, _ in plain["logprobs"]] == spec["greedy"]
    assert [lp for _, lp in spec["logprobs"]] == pytest.approx([lp for _, lp in plain["logprobs"]], abs=1e-4)
    assert spec["top-p"] == plain["top-p"]


def test_sampled_requests_draft_and_repeat_under_a_seed(engines, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUOTING[1]}])
    params = SamplingParams(max_tokens=40, temperature=0.3, seed=11, ignore_eos=True)
    engine = engines["spec"]
    before = engine.scheduler.stats()["spec_accepted_tokens_total"]
    first = generate(engine, {"a": (prompt, params)})["a"]
    assert engine.scheduler.stats()["spec_accepted_tokens_total"] > before
    assert generate(engine, {"b": (prompt, params)})["b"] == first
    assert len(first) == 40
    assert_no_block_held(engine)


def test_seeded_sampled_tokens_do_not_depend_on_drafts_or_batch(engines, tokenizer, model_dir):
    """Drafts up to 4 deep alone and 1 beside others (the per-batch-size setting): a
    seeded request's tokens are those it samples without drafts, alone or in a batch of
    drafting requests, as a re-run after a worker's death needs."""
    by_batch = make_engine(model_dir, {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 64, 1]]})
    prompt = tokenizer.encode("Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, "
                              "Friday. Monday,")
    params = SamplingParams(max_tokens=32, temperature=0.5, seed=23, ignore_eos=True)
    plain = generate(engines["plain"], {"a": (prompt, params)})["a"]
    accepted = by_batch.scheduler.stats()["spec_accepted_tokens_total"]
    assert generate(by_batch, {"a": (prompt, params)})["a"] == plain
    assert by_batch.scheduler.stats()["spec_accepted_tokens_total"] > accepted + 4
    neighbours = {f"n{i}": (tokenizer.encode_chat([{"role": "user", "content": QUOTING[i]}]),
                            SamplingParams(max_tokens=8 + i * 8, temperature=0.9, seed=i, ignore_eos=True))
                  for i in (0, 2)}
    accepted = by_batch.scheduler.stats()["spec_accepted_tokens_total"]
    assert generate(by_batch, {"a": (prompt, params), **neighbours})["a"] == plain
    assert by_batch.scheduler.stats()["spec_accepted_tokens_total"] > accepted
    assert_no_block_held(by_batch)
