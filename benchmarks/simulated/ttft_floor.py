"""A floor under any routing policy's P99 TTFT on a recorded `memserve bench` run: how
low the tail could go if every request reused all the KV it could and ran alone.

Each request's floor is the cost model's prefill time for its prompt (``exec(x, y)``,
one request alone in a step) with everything cacheable counted cached:
- the session's previous turn (prompt and answer, whole blocks), or what the run's
  earliest copy of this turn really found cached, whichever is more;
- a copy of a turn (share ratio > 1: the same prompt replayed as another session) waits
  at most for the earliest copy's floor to end, or computes it itself, whichever ends sooner.
Nothing is charged for queueing, decode steps sharing the batch or the gateway, so no
policy can do better on these arrivals; the floor's P99 is computed as the bench computes
its own. ``--slowdown`` stretches the compute as ``kv_bound_routing_sim.py`` does: three
one-thread workers busy at once on two cores run 1.5x slower than the profile. Closed-loop
turns arrive when the previous answer ends, so each run is judged on its own arrivals.

The session floor is the same with reuse limited to each session's own previous turn: what
session routing reuses by design (a copy is another session, and finds its prompt cached
only if it lands by chance where an earlier copy ran). The ratio of the two floors on one
run's arrivals is about what routing by prefix could take off session routing's P99 if
no worker queued: the part of prompt-tree's gain that the workload alone gives.

    python benchmarks/simulated/ttft_floor.py --cost-model cpu-1t.json R/sharegpt-sr3-session.json R/sharegpt-sr3-prompt-tree.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from memserve.costmodel.model import CostModel
from memserve.costmodel.store import load_cost_model

BLOCK = 16  # tokens a cached block holds (the workers' --block-size)


def _answered_turns(records: list[dict]) -> dict[tuple[str, int], dict]:
    """The answered requests of one run by (session, turn), in the run's order."""
    return {(r["session_id"], r["turn"]): r for r in records if r["status"] == "ok" and r["chunk_times"]}


def _alone_s(r: dict, by_session: dict[tuple[str, int], dict], cost: CostModel, found: int = 0) -> float:
    """``r``'s prefill alone with its session's previous turn cached, or ``found`` tokens."""
    prev = by_session.get((r["session_id"], r["turn"] - 1))
    history = prev["prompt_tokens"] + prev["completion_tokens"] if prev else 0
    prompt = r["prompt_tokens"]
    cacheable = min(max(history // BLOCK * BLOCK, found), prompt - 1)
    return cost.prefill_s(prompt, cacheable / prompt)


def floors(records: list[dict], cost: CostModel) -> list[float]:
    """The TTFT floor of each answered request of one run (seconds), any routing."""
    by_session = _answered_turns(records)
    copies: dict[tuple[str, int], list[dict]] = defaultdict(list)  # (session before "~", turn) -> its copies
    for r in by_session.values():
        copies[(r["session_id"].split("~")[0], r["turn"])].append(r)
    out = []
    for group in copies.values():
        group.sort(key=lambda r: r["start"])
        first = group[0]
        alone = _alone_s(first, by_session, cost, first["cached_tokens"])
        out += [max(0.0, alone - (r["start"] - first["start"])) for r in group]
    return out


def session_floors(records: list[dict], cost: CostModel) -> list[float]:
    """The TTFT floor of each answered request (seconds) reusing only its own session's KV."""
    by_session = _answered_turns(records)
    return [_alone_s(r, by_session, cost) for r in by_session.values()]


def p99_ms(seconds: list[float]) -> float:
    return float(np.percentile(seconds, 99)) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", required=True, help="the workers' memserve profile (JSON) or a preset")
    p.add_argument("--slowdown", type=float, default=1.0, help="compute slowdown of each worker against the profile")
    p.add_argument("results", nargs="+", type=Path, help="memserve bench results files")
    args = p.parse_args()
    cost = load_cost_model(args.cost_model).slowed(args.slowdown)
    for path in args.results:
        r = json.loads(path.read_text())
        p99 = r["ttft_ms"]["p99"]
        floor_p99 = p99_ms(floors(r["requests"], cost))
        session_p99 = p99_ms(session_floors(r["requests"], cost))
        print(f"{path}: P99 TTFT {p99:7.0f} ms, floor {floor_p99:7.0f} ms ({floor_p99 / p99:.2f} of it); "
              f"60% below it is {0.4 * p99:7.0f} ms; session floor {session_p99:7.0f} ms, "
              f"floor / session floor {floor_p99 / session_p99:.2f}")


if __name__ == "__main__":
    main()
