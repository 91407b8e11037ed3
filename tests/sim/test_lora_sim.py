"""LoRA adapters in the simulator: conversations spread over four adapters, instances
with one adapter slot each, reading one in taking half a second. The cost router, which
charges that read where an instance does not hold the adapter, reads adapters in far
less often than the least-load router, which does not look at adapters; an instance
with a slot for every adapter reads each at most once; and the reads cost the requests
time (TTFT)."""

from __future__ import annotations

import argparse

from helpers.paths import SHARED_DATA

from memserve.bench.cli import build_sessions, replay_options
from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.router import Router
from memserve.sim.cli import add_parser
from memserve.sim.report import simulation_stats
from memserve.sim.simulator import Simulation
from memserve.sim.tokens import SyntheticTokenizer
from memserve.workload.metrics import compute_metrics

ADAPTERS = ["a", "b", "c", "d"]
ARGS = ["--cost-model", "opt-13b-a100", "--instances", "4", "--dataset", str(SHARED_DATA / "sharegpt-sample.jsonl"),
        "--num-sessions", "24", "--max-turns", "3", "--rate", "4", "--max-tokens", "32", "--no-progress",
        "--lora-modules", *ADAPTERS]


def simulate(router_name: str, slots: int, load_s: float) -> tuple[int, float]:
    """(adapter reads, mean TTFT in ms) of the run."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *ARGS, "--router", router_name])
    cost = load_cost_model(args.cost_model)
    _, parts, _ = build_sessions(args, 1)
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    router = Router.named(router_name, cost, step_tokens=args.max_num_batched_tokens)
    sim = Simulation(cost, cfg, 4, router, SyntheticTokenizer(), replay_options(args, args.rate),
                     lora_slots=(slots, load_s))
    duration = sim.run(parts[0])
    metrics = compute_metrics(sim.records, duration)
    assert metrics["num_requests"]["failed"] == 0
    return simulation_stats(sim, 1.0, duration, ["colocated"] * 4)["lora_loads"], metrics["ttft_ms"]["mean"]


def test_the_cost_router_gathers_an_adapters_requests_where_it_is_ready():
    cost_reads, _ = simulate("cost", 1, 0.5)
    spread_reads, _ = simulate("least-load", 1, 0.5)
    assert cost_reads <= 0.6 * spread_reads, (cost_reads, spread_reads)  # 21 against 41 when written


def test_slots_for_every_adapter_read_each_once_and_reads_cost_time():
    reads, slow_ttft = simulate("least-load", len(ADAPTERS), 0.5)
    assert reads <= 4 * len(ADAPTERS)  # each instance reads each adapter at most once
    _, free_ttft = simulate("least-load", len(ADAPTERS), 0.0)
    assert slow_ttft > free_ttft
