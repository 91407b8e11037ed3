"""``--schedule-policy lpm`` (SGLang's longest prefix match) on the real Engine with a
scripted runner: a conversation that comes back with most of its prompt cached is
admitted before new prompts that arrived earlier; fcfs keeps arrival order; past
``LPM_MAX_QUEUE`` waiting requests lpm keeps arrival order too."""

from __future__ import annotations

import pytest
from helpers.scripted_engine import BS, EOS, Clock, ScriptedRunner, add, assert_no_block_held, run_to_end

from memserve.config import EngineConfig
from memserve.workers.engine.policies import lpm
from memserve.workers.engine.engine import Engine

DOC = list(range(1, 41))  # 10 blocks


def admission_order(policy: str) -> list[str]:
    cfg = EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=1,
                       schedule_policy=policy)
    runner = ScriptedRunner(64)
    engine = Engine(cfg, runner, {EOS}, clock=Clock())
    add(engine, "doc", DOC, max_tokens=1)
    run_to_end(engine)
    add(engine, "new-1", list(range(100, 140)), max_tokens=1)
    add(engine, "new-2", list(range(200, 240)), max_tokens=1)
    add(engine, "back", DOC + [300, 301, 302, 303], max_tokens=1)  # its 10 blocks are cached
    runner.plans.clear()
    run_to_end(engine)
    order: list[str] = []
    for plan in runner.plans:
        order += [c.request_id for c in plan.chunks if c.request_id not in order]
    assert_no_block_held(engine)
    return order


@pytest.mark.parametrize("policy, expected", [("fcfs", ["new-1", "new-2", "back"]),
                                              ("lpm", ["back", "new-1", "new-2"])])
def test_a_returning_conversation_is_admitted_before_new_prompts(policy, expected):
    assert admission_order(policy) == expected


def test_past_its_queue_bound_lpm_admits_in_arrival_order(monkeypatch):
    monkeypatch.setattr(lpm, "LPM_MAX_QUEUE", 1)
    assert admission_order("lpm") == ["new-1", "new-2", "back"]
