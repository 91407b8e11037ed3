"""The TTFT floor of benchmarks/simulated/ttft_floor.py on hand-built bench records: a first turn
pays its whole prompt but what its earliest copy found cached, a later turn only what its
session's previous turn does not cover, and a copy only the earliest copy's floor left
when it arrives; the session floor counts only the session's own previous turn."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "simulated"))

from ttft_floor import floors, session_floors  # noqa: E402

from memserve.costmodel.store import load_cost_model


def record(session: str, turn: int, start: float, prompt: int, cached: int = 0, completion: int = 16) -> dict:
    return {"session_id": session, "turn": turn, "start": start, "chunk_times": [start + 1.0], "status": "ok",
            "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}


def test_floors_count_history_and_copies():
    cost = load_cost_model("opt-13b-a100")
    first_turn = cost.prefill_s(500, 32 / 500)
    assert first_turn > 0.01
    records = [
        record("a", 1, 0.0, 500, cached=32),
        record("a~1", 1, 0.01, 500, cached=480),  # a copy: waits for the first at most
        record("a~2", 1, 10.0, 500, cached=480),  # arrives after the first's floor has passed
        record("a", 2, 20.0, 600, cached=16),  # its history, 500 + 16 tokens, was cacheable
        {**record("b", 1, 0.0, 900), "status": "error"},  # not answered: no floor
    ]
    second_turn = cost.prefill_s(600, 512 / 600)
    assert floors(records, cost) == pytest.approx([first_turn, first_turn - 0.01, 0.0, second_turn])
    cold = cost.prefill_s(500, 0.0)
    assert cold > first_turn
    # Without reuse across sessions each copy computes the whole prompt; the history still counts.
    assert session_floors(records, cost) == pytest.approx([cold, cold, cold, second_turn])
