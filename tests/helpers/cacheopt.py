"""An engine under --schedule-policy cacheopt on the scripted runner of helpers.scripted_engine."""

from __future__ import annotations

from helpers.scripted_engine import (
    BS,
    EOS,
    Clock,
    ScriptedRunner,
)
from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.policies.cacheopt.policy import CacheOpt


def make(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8, options: str = "", num_host_blocks: int = 0,
         policy: str = "cacheopt") -> tuple[Engine, ScriptedRunner, Clock]:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                       num_host_blocks=num_host_blocks, schedule_policy=policy, schedule_policy_options=options)
    runner, clock = ScriptedRunner(num_blocks, num_host_blocks), Clock()
    return Engine(cfg, runner, {EOS}, clock=clock), runner, clock


def add(engine: Engine, rid: str, prompt: list[int], max_tokens: int = 3, predicted: int | None = None,
        ttft_ms: float | None = None, tbt_ms: float | None = None, priority: int = 0) -> None:
    req = AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), priority=priority,
                     slo_ttft_ms=ttft_ms, slo_tbt_ms=tbt_ms, predicted_output_tokens=predicted)
    assert engine.add_request(req) is None


def policy(engine: Engine) -> CacheOpt:
    assert isinstance(engine.scheduler.policy, CacheOpt)
    return engine.scheduler.policy
