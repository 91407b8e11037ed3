"""The real Engine, Scheduler, KV cache manager and MemPool driven by a scripted runner
and a fake clock, with no model and no torch (in the style of vLLM's
tests/v1/core/test_scheduler.py): chunked-prefill budgets, preemption order, prefix
hits, a request waiting for in-flight KV while others run, abort in every state, and no
leaked block after each."""

from __future__ import annotations

import pytest
from helpers.scripted_engine import (
    BS,
    EOS,
    VOCAB,
    Clock,
    ScriptedRunner,
    add,
    assert_no_block_held,
    chunk_sizes,
    run_to_end,
)

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.sequence import SequenceStatus
from memserve.workers.engine.step_plan import StepPlan


def make_engine(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8, caching: bool = True,
                num_host_blocks: int = 0, long_prefill: int = 0, hold: bool = True) -> tuple[Engine, ScriptedRunner]:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=caching, num_host_blocks=num_host_blocks,
                       long_prefill_token_threshold=long_prefill, hold_shared_prefills=hold)
    runner = ScriptedRunner(num_blocks, num_host_blocks)
    return Engine(cfg, runner, {EOS}, clock=Clock()), runner


def test_chunked_prefill_respects_the_token_budget_and_decodes_first():
    engine, runner = make_engine(budget=32)
    add(engine, "long", list(range(1, 71)))  # 70 prompt tokens: chunks of 32, 32, 6
    engine.step()
    add(engine, "short", list(range(100, 110)))
    engine.step()
    engine.step()
    assert [chunk_sizes(p) for p in runner.plans[:3]] == [
        {"long": 32}, {"long": 32}, {"long": 6, "short": 10}]
    assert [c.sample for c in runner.plans[2].chunks] == [True, True]
    assert chunk_sizes(engine_step_plan(engine, runner)) == {"long": 1, "short": 1}  # both decode
    run_to_end(engine)
    assert_no_block_held(engine)


def test_a_long_prefill_leaves_room_for_a_short_prompt_beside_it():
    """With the cap, the short prompt that the long one holds back a step without it (the
    test above) is prefilled in the step after it arrives, beside the long one's next chunk."""
    engine, runner = make_engine(budget=32, long_prefill=12)
    add(engine, "long", list(range(1, 71)))  # 70 prompt tokens: chunks of 12
    engine.step()
    add(engine, "short", list(range(100, 140)))  # 40 tokens: capped too
    engine.step()
    engine.step()
    assert [chunk_sizes(p) for p in runner.plans[:3]] == [
        {"long": 12}, {"long": 12, "short": 12}, {"long": 12, "short": 12}]
    outputs = run_to_end(engine)
    assert {o.request_id: o.finish_reason for o in outputs if o.finished} == {"long": "length", "short": "length"}
    assert all(n <= 12 for p in runner.plans for n in chunk_sizes(p).values())
    assert_no_block_held(engine)


@pytest.mark.parametrize("hold", [True, False])
def test_a_copy_waits_for_the_prefill_computing_its_blocks(hold):
    """A copy of a prompt that arrives while the first is in chunked prefill is passed over
    until the first has computed the blocks they share, while a request behind it is
    admitted; then it computes only the block holding its last token. Without the hold
    it is admitted at once and recomputes all but the first chunk."""
    engine, runner = make_engine(budget=32, long_prefill=12, hold=hold)
    prompt = list(range(1, 41))  # 40 tokens, 10 blocks: chunks of 12, 12, 12, 4
    add(engine, "first", prompt)
    engine.step()
    add(engine, "copy", prompt)
    add(engine, "other", list(range(100, 108)))
    outputs = [o for _ in range(3) for o in engine.step()]
    if hold:
        assert [chunk_sizes(p) for p in runner.plans[1:4]] == [
            {"first": 12, "other": 8}, {"first": 12, "other": 1}, {"first": 4, "other": 1, "copy": 4}]
    else:
        assert chunk_sizes(runner.plans[1]) == {"first": 12, "copy": 12, "other": 8}
    outputs += run_to_end(engine)
    cached = {o.request_id: o.num_cached_tokens for o in outputs if o.finished}
    assert cached == {"first": 0, "copy": 36 if hold else 12, "other": 0}
    assert engine.stats()["num_held_admissions"] == (1 if hold else 0)
    assert_no_block_held(engine)


def engine_step_plan(engine: Engine, runner: ScriptedRunner) -> StepPlan:
    engine.step()
    return runner.plans[-1]


def test_preemption_takes_the_newest_request_and_recomputes_it():
    engine, runner = make_engine(num_blocks=6, budget=64)
    add(engine, "old", list(range(1, 12)), max_tokens=8)  # 11 tokens: 3 blocks, grows to 19 (5 blocks)
    add(engine, "new", list(range(20, 31)), max_tokens=8)
    engine.step()
    assert chunk_sizes(runner.plans[0]) == {"old": 11, "new": 11}
    outputs = run_to_end(engine)
    preempted = [p.preempted_ids for p in runner.plans if p.preempted_ids]
    assert preempted and all(ids == ["new"] for ids in preempted)
    assert engine.stats()["num_preemptions"] >= 1
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finished == {"old": "length", "new": "length"}
    # After preemption the newest request recomputes everything after its cached blocks.
    resumed = next(i for i, p in enumerate(runner.plans) if p.preempted_ids)
    later = next(p for p in runner.plans[resumed + 1:] if "new" in chunk_sizes(p))
    chunk = next(c for c in later.chunks if c.request_id == "new")
    assert chunk.start_pos % BS == 0 and len(chunk.token_ids) > 1 and chunk.sample
    assert_no_block_held(engine)


def test_prefix_hits_skip_cached_blocks_and_leave_one_token_to_compute():
    engine, runner = make_engine()
    prompt = list(range(1, 17))  # exactly 4 blocks
    add(engine, "first", prompt)
    run_to_end(engine)
    add(engine, "again", prompt)
    engine.step()
    chunk = runner.plans[-1].chunks[0]
    assert (chunk.start_pos, len(chunk.token_ids)) == (12, 4)  # 3 cached blocks; the 4th holds the last token
    out = run_to_end(engine)
    assert out[-1].num_cached_tokens == 12
    assert_no_block_held(engine)


def test_a_request_waits_for_its_kv_while_others_run():
    # 9 blocks: turn2's 7 and room for the other request to decode without a preemption
    engine, runner = make_engine(num_blocks=9, num_host_blocks=32, budget=64)
    history = list(range(1, 25))  # 6 blocks
    add(engine, "turn1", history, max_tokens=1)
    run_to_end(engine)
    add(engine, "filler", list(range(200, 224)), max_tokens=1)  # pushes turn1's blocks to the host tier
    run_to_end(engine)
    assert engine.mempool.stats()["host"]["cached"] > 0
    add(engine, "turn2", history + [50, 51, 52], max_tokens=2)
    add(engine, "other", [300, 301, 302], max_tokens=4)
    engine.step()
    assert runner.loads and runner.loads[0].request_id == "turn2"
    assert engine.scheduler.loading.keys() == {"turn2"}
    for _ in range(2):  # the load is still running: only the other request steps
        engine.step()
        assert "turn2" not in chunk_sizes(runner.plans[-1])
        assert "other" in chunk_sizes(runner.plans[-1])
    runner.complete_loads()
    engine.step()
    turn2 = next(c for c in runner.plans[-1].chunks if c.request_id == "turn2")
    assert turn2.start_pos > 0  # the loaded prefix is skipped
    out = run_to_end(engine)
    assert any(o.request_id == "turn2" and o.finished for o in out)
    assert engine.stats()["num_swapped_in"] > 0
    assert_no_block_held(engine)


@pytest.mark.parametrize("state", ["waiting", "loading", "running-prefill", "running-decode"])
def test_abort_in_every_state_frees_every_block(state):
    engine, runner = make_engine(num_blocks=8, num_host_blocks=32, budget=8)
    history = list(range(1, 25))
    if state.startswith("loading"):
        add(engine, "h", history, max_tokens=1)
        run_to_end(engine)
        add(engine, "f", list(range(200, 224)), max_tokens=1)
        run_to_end(engine)
    prompt = history + [50] if state.startswith("loading") else list(range(1, 20))
    add(engine, "victim", prompt, max_tokens=5)
    if state == "loading":
        engine.step()
        assert engine.scheduler.loading and runner.loads  # the runner is copying
    elif state == "running-prefill":
        engine.step()
        assert engine.scheduler.running and runner.plans[-1].chunks[0].sample is False
    elif state == "running-decode":
        while not any(c.sample for p in runner.plans for c in p.chunks):
            engine.step()
        engine.step()
    out = engine.abort("victim")
    assert out is not None and out.finish_reason == "abort"
    assert engine.abort("victim") is None  # unknown now: harmless
    runner.complete_loads()
    run_to_end(engine)
    assert not engine.has_work
    assert_no_block_held(engine)
    assert "victim" not in runner.known or not engine.scheduler.running


def test_requests_that_can_never_fit_are_refused_at_once():
    engine, _ = make_engine(num_blocks=4)
    out = engine.add_request(AddRequest("big", list(range(1, 30)), SamplingParams(max_tokens=1)))
    assert out is not None and out.finish_reason == "error" and "does not fit" in out.error
    assert not engine.has_work


def test_scheduler_state_is_consistent_after_a_random_workload():
    import random

    rng = random.Random(0)
    engine, runner = make_engine(num_blocks=24, num_host_blocks=48, budget=24, max_num_seqs=4)
    prefixes = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(1, 10))]
        add(engine, f"r{i}", prompt, max_tokens=rng.randrange(1, 6))
        for _ in range(rng.randrange(0, 4)):
            engine.step()
            if rng.random() < 0.5:
                runner.complete_loads()
            if rng.random() < 0.1:
                engine.abort(f"r{rng.randrange(0, i + 1)}")
        s = engine.scheduler
        states = [seq.status for seq in s.running] + [seq.status for seq in s.loading.values()]
        assert all(st in (SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_KV) for st in states)
    while engine.has_work:
        runner.complete_loads()
        engine.step()
    assert_no_block_held(engine)


def test_a_step_runs_at_most_max_loras_adapters():
    """vLLM's --max-loras: a request on a third adapter waits, while requests behind it on
    a running adapter or the base model are admitted, until one adapter's requests are
    done; no step ever runs more than two adapters."""
    cfg = EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                       enable_lora=True, max_loras=2)
    runner = ScriptedRunner(64, 0)
    engine = Engine(cfg, runner, {EOS}, clock=Clock())
    for i, (rid, adapter, max_tokens) in enumerate([("a", "sql", 2), ("b", "chat", 6), ("c", "legal", 3),
                                                    ("d", "sql", 3), ("base", None, 3)]):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=adapter)
        assert engine.add_request(AddRequest(rid, [10 * i + 1, 2, 3, 4, 5], params)) is None
    engine.step()
    assert set(chunk_sizes(runner.plans[0])) == {"a", "b", "d", "base"}  # "legal" waits
    outputs = run_to_end(engine)
    assert {o.request_id for o in outputs if o.finished} == {"a", "b", "c", "d", "base"}
    adapter_of = {"a": "sql", "b": "chat", "c": "legal", "d": "sql", "base": None}
    steps_with = [{adapter_of[r] for r in chunk_sizes(plan)} - {None} for plan in runner.plans]
    assert max(len(adapters) for adapters in steps_with) == 2
    first_legal = next(i for i, adapters in enumerate(steps_with) if "legal" in adapters)
    assert "sql" not in steps_with[first_legal]  # admitted once "sql"'s requests were done
    assert_no_block_held(engine)
