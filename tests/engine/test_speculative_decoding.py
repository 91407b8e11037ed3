"""N-gram speculative decoding in the scheduler: what the proposer drafts, how accepted
drafts advance a request within its limits, and that no block is left behind. The real
Engine and Scheduler run over a scripted runner whose "model" continues a cycle of tokens
and verifies drafts with ``accept_drafts``, as the model runner does."""

from __future__ import annotations

import random

import pytest
from helpers.scripted_engine import BS, EOS, Clock, ScriptedRunner, assert_no_block_held, run_to_end

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.ngram_proposer import (
    NgramConfig,
    NgramIndex,
    NgramProposer,
    accept_drafts,
    can_draft,
)
from memserve.workers.engine.step_plan import StepPlan, StepResult

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
CYCLE = [100, 101, 102, 103, 104]


def next_in_cycle(token: int) -> int:
    """The scripted model's greedy choice after ``token``: the cycle goes on (and anything
    outside it leads into it)."""
    return CYCLE[(CYCLE.index(token) + 1) % len(CYCLE)] if token in CYCLE else CYCLE[0]


class CycleRunner(ScriptedRunner):
    """Chooses ``next_in_cycle`` of each sampled row's token and verifies drafts as the model
    runner does."""

    def execute(self, plan: StepPlan) -> StepResult:
        super().execute(plan)
        tokens: list[int] = []
        result = StepResult()
        for c in plan.chunks:
            if c.sample:
                tokens += [next_in_cycle(t) for t in c.token_ids[len(c.token_ids) - 1 - c.num_drafts:]]
                result.sampled[c.request_id] = tokens[-1]
        accept_drafts(plan.chunks, tokens, result)
        return result


def make_engine(spec: dict | None = SPEC, budget: int = 32, num_blocks: int = 64) -> tuple[Engine, CycleRunner]:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget, speculative_config=spec)
    runner = CycleRunner(num_blocks)
    return Engine(cfg, runner, {EOS}, clock=Clock()), runner


def generate(engine: Engine, prompt: list[int], **params) -> list[int]:
    p = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **params})
    assert engine.add_request(AddRequest("r", prompt, p)) is None
    return [t for out in run_to_end(engine) for t in out.new_token_ids]


def brute_force(tokens: list[int], cfg: NgramConfig, limit: int) -> list[int]:
    """The longest suffix n-gram's latest earlier occurrence, searched from scratch."""
    for n in range(min(cfg.prompt_lookup_max, len(tokens) - 1), cfg.prompt_lookup_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + min(limit, cfg.num_speculative_tokens)]
    return []


def confident() -> NgramIndex:
    """The index of a request whose drafts have all been kept so far (it drafts deep)."""
    return NgramIndex(kept=50.0, tried=50.0)


def test_the_longest_match_wins_and_its_latest_occurrence():
    proposer = NgramProposer(NgramConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    # "2 3" last followed by 9 (latest), "1 2 3" by 4: the 3-gram wins.
    tokens = [1, 2, 3, 4, 5, 2, 3, 9, 8, 1, 2, 3]
    assert proposer.propose(confident(), tokens, 10) == [4, 5, 2]
    assert proposer.propose(confident(), [5, 2, 3, 9, 8, 7, 2, 3], 10) == [9, 8, 7]
    assert proposer.propose(confident(), [5, 2, 3, 9, 8, 7, 2, 3], 1) == [9]
    assert proposer.propose(confident(), [1, 2, 3, 4], 10) == []  # nothing repeats


def test_a_request_drafts_as_deep_as_its_drafts_are_kept():
    """A new request drafts one token; kept drafts deepen its drafts, lost ones stop them,
    and a request that stopped tries one draft again once its record has faded."""
    proposer = NgramProposer(NgramConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=2))
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    index = NgramIndex()
    assert proposer.propose(index, tokens, 10) == [3]
    depths = []
    for _ in range(6):
        index.record(len(depths) and depths[-1] or 1, len(depths) and depths[-1] or 1)
        depths.append(len(proposer.propose(index, tokens, 10)))
    assert depths == sorted(depths) and depths[-1] == 4
    for _ in range(8):
        index.record(4, 0)
    assert proposer.propose(index, tokens, 10) == []
    tries = 1
    while not proposer.propose(index, tokens, 10):  # each passed-over match fades the record
        tries += 1
    assert 2 <= tries <= 10
    assert proposer.propose(index, tokens, 10) == [3]


def test_the_incremental_index_proposes_what_a_search_from_scratch_finds():
    rng = random.Random(0)
    cfg = NgramConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    proposer = NgramProposer(cfg)
    for _ in range(20):
        tokens = [rng.randrange(6) for _ in range(8)]
        index = confident()
        while len(tokens) < 120:
            limit = rng.randrange(0, 6)
            assert proposer.propose(index, tokens, limit) == brute_force(tokens, cfg, limit)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_config_follows_vllm_and_refuses_what_it_does_not_know():
    cfg = NgramConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 4, 2)
    for bad in ({"method": "eagle", "num_speculative_tokens": 2}, {"method": "ngram"},
                {"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"},
                {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}):
        with pytest.raises(ValueError):
            NgramConfig.from_dict(bad)


def test_drafts_per_batch_size_follow_vllms_schedule():
    cfg = NgramConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                 "num_speculative_tokens_per_batch_size": [[5, 8, 1], [1, 2, 6], [16, 64, 0]]})
    assert [cfg.max_drafts(b) for b in (1, 2, 3, 5, 8, 9, 15, 16, 100)] == [4, 4, 4, 1, 1, 1, 1, 0, 0]
    assert NgramConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}).max_drafts(500) == 3
    for bad in ([[2, 4, 1]], [[1, 4, 1], [4, 8, 0]], [[1, 4, -1]], [[1, 4]]):
        with pytest.raises(ValueError):
            NgramConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                   "num_speculative_tokens_per_batch_size": bad})


def test_a_batch_past_the_schedule_decodes_without_drafts():
    spec = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]]}
    prompt = [7, 100, 101, 102, 103, 104, 100, 101]
    engine, runner = make_engine(spec=spec)
    for rid, first in (("a", 7), ("b", 8)):  # no block in common: admitted together
        params = SamplingParams(max_tokens=8, temperature=0.0)
        assert engine.add_request(AddRequest(rid, [first, *prompt[1:]], params)) is None
    run_to_end(engine)
    assert not any(c.num_drafts for p in runner.plans for c in p.chunks)
    engine, runner = make_engine(spec=spec)  # alone: it drafts
    assert generate(engine, prompt) == generate(make_engine(spec=None)[0], prompt)
    assert any(c.num_drafts for p in runner.plans for c in p.chunks)


def test_only_greedy_and_plain_temperature_requests_draft():
    assert can_draft(SamplingParams(temperature=0.0))
    assert can_draft(SamplingParams(temperature=0.7, seed=3))
    for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7, top_k=40),
                   SamplingParams(temperature=0.0, logprobs=2),
                   SamplingParams(temperature=0.0, repetition_penalty=1.2), SamplingParams(temperature=0.0, n=2),
                   SamplingParams(temperature=0.0, grammar="start: /a+/"),
                   SamplingParams(temperature=0.0, logit_bias={5: 1.0}), SamplingParams(temperature=0.0, min_tokens=3)):
        assert not can_draft(params)


def test_accepted_drafts_give_the_same_tokens_in_fewer_steps():
    prompt = [7, 100, 101, 102, 103, 104, 100, 101]
    plain, plain_runner = make_engine(spec=None)
    fast, fast_runner = make_engine()
    expected = generate(plain, prompt)
    assert generate(fast, prompt) == expected == [next_in_cycle(t) for t in ([prompt[-1]] + expected)[:-1]]
    plain_steps = sum(1 for p in plain_runner.plans if p.chunks)
    fast_steps = sum(1 for p in fast_runner.plans if p.chunks)
    assert fast_steps <= plain_steps // 2
    stats = fast.scheduler.stats()
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] > 0
    assert_no_block_held(fast)


def test_drafts_stop_at_max_tokens_eos_and_the_token_budget():
    prompt = [7, 100, 101, 102, 103, 104, 100, 101]
    engine, _ = make_engine()
    assert len(generate(engine, prompt, max_tokens=5)) == 5
    assert_no_block_held(engine)
    # A stop token among accepted drafts ends the request there.
    engine, _ = make_engine()
    out = generate(engine, prompt, stop_token_ids=[104])
    assert out == [102, 103, 104]
    assert engine.scheduler.stats()["spec_accepted_tokens_total"] >= 1
    assert_no_block_held(engine)
    # Two decoding requests share a budget of 4 tokens: drafts fit in what is left.
    engine, runner = make_engine(budget=4)
    for rid in ("a", "b"):
        params = SamplingParams(max_tokens=10, temperature=0.0)
        assert engine.add_request(AddRequest(rid, prompt[-4:], params)) is None
    run_to_end(engine)
    assert all(sum(len(c.token_ids) for c in p.chunks) <= 4 for p in runner.plans)
    assert_no_block_held(engine)


def test_rejected_drafts_leave_the_request_where_plain_decoding_would():
    """Drafts the model disagrees with (a prompt whose repeats mislead the lookup) cost
    nothing but the step: the tokens and the cached blocks equal plain decoding's."""
    prompt = [100, 101, 7, 8, 100]  # after the first token, 101: "7 8 100" is drafted; the cycle says 102
    plain, _ = make_engine(spec=None)
    fast, _ = make_engine()
    assert generate(fast, prompt, max_tokens=9) == generate(plain, prompt, max_tokens=9)
    assert fast.scheduler.stats()["spec_draft_tokens_total"] > fast.scheduler.stats()["spec_accepted_tokens_total"]
    assert fast.mempool.stats()["device"] == plain.mempool.stats()["device"]
    assert_no_block_held(fast)



@pytest.mark.parametrize("spec", [None, SPEC])
def test_drafts_never_take_the_block_another_request_needs(spec):
    """Five blocks of 4 tokens: after both prefills one is free. Request a's draft would
    need it now (its 1 + 1 tokens cross into a third block) while b needs it for its next
    token; a decodes without its draft, b is not preempted, and a gets its block once b
    has finished."""
    engine, runner = make_engine(spec=spec, num_blocks=5)
    a, b = [101, 102, 103, 104, 100, 101, 102], [7, 8, 9, 10, 11, 12, 13, 14]  # a's first token, 103, repeats
    assert engine.add_request(AddRequest("a", a, SamplingParams(max_tokens=5, temperature=0.0))) is None
    assert engine.add_request(AddRequest("b", b, SamplingParams(max_tokens=2, temperature=0.0))) is None
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for out in run_to_end(engine):
        tokens[out.request_id] += out.new_token_ids
    assert tokens == {"a": [103, 104, 100, 101, 102], "b": [100, 101]}
    assert engine.scheduler.num_preemptions == 0
    assert_no_block_held(engine)
    if spec:  # a drafted once b had left
        assert any(c.num_drafts for p in runner.plans for c in p.chunks if c.request_id == "a")
