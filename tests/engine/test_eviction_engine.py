"""Scheduler-aware eviction and prefetching in the real engine (SmolLM2, real files):
a multi-turn ShareGPT replay under capacity pressure (a device pool of one
conversation, a small host tier, a disk tier; one request running at a time so the
others queue) gives the same greedy tokens with ``scheduler-aware`` as with ``lru``:
the policy changes where blocks live, never what is computed."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engine_replay import replay
from helpers.tiered_engine import TURNS, short_conversations, tiered_config, tokens_of

from memserve.text.tokenizer import Tokenizer
from memserve.workers.real_engine import build_engine


def run(model_dir, tmp_path, policy: str, convs) -> tuple[list, dict]:
    cfg = dataclasses.replace(tiered_config(tmp_path / policy), eviction_policy=policy, max_num_seqs=1)
    engine = build_engine(cfg, model_dir)
    got = replay(engine, Tokenizer.from_folder(model_dir), convs, TURNS, policy)
    engine.mempool.flush_saves()
    io = engine.mempool.stats()["tier_io"]
    engine.close()
    return tokens_of(got), io


@pytest.mark.slow  # about 2.5 minutes on two loaded cores
def test_scheduler_aware_gives_the_same_tokens_as_lru_under_pressure(model_dir, tmp_path):
    convs = short_conversations(Tokenizer.from_folder(model_dir), 3)
    lru, lru_io = run(model_dir, tmp_path, "lru", convs)
    aware, aware_io = run(model_dir, tmp_path, "scheduler-aware", convs)
    assert aware == lru
    assert lru_io["disk"]["write_bytes"] > 0 and aware_io["disk"]["write_bytes"] > 0  # the pressure reached disk
    assert lru_io["host"]["prefetched"] == 0
