"""The routing policies in the simulator (the real engines, MemPools and router on a
cost-model clock): with shared sessions (share ratio 2) the prompt tree finds the
copies' prefixes that session routing cannot, and the cost router's pulls really move
the prefix into the destination's MemPool, whose prefill then starts from it; the
router hears of a step's tokens when the step ends, never while it still runs; copies
arriving together follow their original to its instance before any KV event; a copy of a
conversation is answered as its original was, so its later turns share the cache too."""

from __future__ import annotations

import argparse

from helpers.paths import SHARED_DATA

from memserve.bench.cli import build_sessions, replay_options
from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.route_types import PULL, RouteDecision
from memserve.gateway.routing.router import Router
from memserve.sim.cli import add_parser
from memserve.sim.simulator import Simulation
from memserve.sim.tokens import SyntheticTokenizer
from memserve.workload.metrics import compute_metrics

# 24 sessions at 16 starts/s: loaded enough that the cost router pulls, spread enough that
# most copies arrive after the first one's document is cached (a copy arriving while it is
# still being prefilled finds it only among the router's pending prefixes, which cannot be pulled).
ARGS = ["--cost-model", "opt-13b-a100", "--instances", "4", "--workload", "long-doc-qa", "--doc-len", "1800",
        "--questions-per-doc", "3", "--dataset", str(SHARED_DATA / "sharegpt-sample.jsonl"), "--num-sessions", "12",
        "--share-ratio", "2", "--rate", "16", "--no-progress"]


def simulate(router_name: str, *extra: str) -> tuple[Simulation, list[tuple[str, RouteDecision]], list[float]]:
    """The run (``extra`` flags override ``ARGS``), its routing decisions, and for every
    token report the router got, how long before the tokens' own time it got it."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *ARGS, *extra, "--router", router_name])
    cost = load_cost_model(args.cost_model)
    _, parts, _ = build_sessions(args, 1)
    router = Router.named(router_name, cost, step_tokens=args.max_num_batched_tokens)
    decisions: list[tuple[str, RouteDecision]] = []
    route = router.route

    def recorded(request, views):
        decisions.append((request.request_id, route(request, views)))
        return decisions[-1][1]

    router.route = recorded  # type: ignore[method-assign]
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    sim = Simulation(cost, cfg, int(args.instances), router, SyntheticTokenizer(), replay_options(args, args.rate))
    early: list[float] = []
    observe = router.observe

    def timed(request_id: str, new_tokens: int, at: float | None = None) -> None:
        early.append((at if at is not None else sim.now) - sim.now)
        observe(request_id, new_tokens, at)

    router.observe = timed  # type: ignore[method-assign]
    sim.run(parts[0])
    return sim, decisions, early


def cached_ratio(sim: Simulation) -> float:
    assert all(r.ok for r in sim.records)
    return compute_metrics(sim.records, 1.0)["cached_token_ratio"]


def test_prompt_tree_reuses_shared_sessions_that_session_routing_cannot():
    tree, session = cached_ratio(simulate("prompt-tree")[0]), cached_ratio(simulate("session")[0])
    assert tree > session + 0.02


def test_cost_router_pulls_land_in_the_destination_mempool():
    sim, decisions, _ = simulate("cost")
    pulls = {rid: d for rid, d in decisions if d.reason == PULL}
    assert pulls and sim.router.pulls["ok"] == len(pulls)
    cached = {f"{r.session_id}:{r.turn}": r.cached_tokens for r in sim.records}
    assert all(cached[rid] >= d.pull_blocks * 16 for rid, d in pulls.items())
    assert sim.router.stats()["in_flight"] == 0  # every request left the ledger
    assert sim.router.ttft.count == len(sim.records)


def test_the_router_hears_of_a_step_when_it_ends():
    """The engine runs a step at its start; its tokens (and KV events) leave the worker
    at its end. A router told at the start would see a prefill finished, and its
    instance idle, for the whole length of the step."""
    _, _, early = simulate("cost")
    assert early and max(early) == 0.0


def test_copies_arriving_together_follow_their_original_before_any_kv_event():
    """All 24 sessions start within about 10 ms, long before any first prefill ends: no
    mirror holds anything yet, so only the pending prefixes can send each copy's first
    turn to its original's instance. Every claim is gone at the end."""
    for policy in ("prompt-tree", "cost"):
        sim, decisions, _ = simulate(policy, "--rate", "2000")
        first = {rid.split(":")[0]: d.instance for rid, d in decisions if rid.endswith(":1")}
        copies = [sid for sid in first if "~" in sid]
        assert len(copies) == 12
        assert all(first[sid] == first[sid.split("~")[0]] for sid in copies), policy
        assert sim.router.stats()["pending_hits"] >= 12 and len(sim.router.pending) == 0


def test_copies_of_a_conversation_get_the_same_answers_and_share_every_turn():
    """A greedy model answers identical prompts identically, so on one instance a
    ShareGPT copy's every turn is cached: sharing adds almost no computed tokens."""

    def computed(share_ratio: str) -> int:
        sim = simulate("prompt-tree", "--workload", "sharegpt", "--max-turns", "3", "--instances", "1",
                       "--rate", "0.2", "--share-ratio", share_ratio)[0]
        assert all(r.ok for r in sim.records) and any(r.turn > 1 for r in sim.records)
        return sum(r.prompt_tokens - r.cached_tokens for r in sim.records)

    once, twice = computed("1"), computed("2")
    assert twice < 1.1 * once
