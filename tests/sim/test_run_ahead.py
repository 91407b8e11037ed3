"""Running plain decode steps ahead (``Simulation._run_ahead``) only saves work: with it off,
every step is an event of its own, and the records, the engines' counts and everything
the router reads when a request arrives (its workers' stats, mirrors, queued work,
pending prefixes and in-flight requests, the instances' step ends) come out the same, for
least-load routing through evictions, and for prompt-tree and cost routing, admission
control and a host tier on shared prefixes, saved down by the synchronous saver or by a
slow asynchronous one (``sim/saver.py``)."""

from __future__ import annotations

import argparse

import pytest

from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.admission import Admission
from memserve.gateway.routing.router import Router
from memserve.sim.cli import add_parser
from memserve.sim.simulator import Simulation
from memserve.sim.tokens import SyntheticTokenizer
from memserve.workload.options import build_sessions, replay_options

RUNS = {
    "least-load": ["--cost-model", "llama2-13b-h800", "--instances", "4", "--workload", "random", "--num-requests",
                   "240", "--request-rate", "6", "--num-blocks", "160", "--input-len", "uniform:32:400",
                   "--output-len", "exp:80"],
    "prompt-tree": ["--cost-model", "llama2-13b-h800", "--instances", "4", "--workload", "shared-prefix",
                    "--num-requests", "200", "--request-rate", "8", "--router", "prompt-tree", "--num-blocks", "120",
                    "--num-host-blocks", "80", "--num-prefixes", "6"],
    "async-saver": ["--cost-model", "llama2-13b-h800", "--instances", "4", "--workload", "shared-prefix",
                    "--num-requests", "200", "--request-rate", "8", "--router", "prompt-tree", "--num-blocks", "120",
                    "--num-host-blocks", "80", "--num-prefixes", "6", "--saver-gbps", "2"],
    "cost": ["--cost-model", "opt-13b-a100", "--instances", "3", "--workload", "shared-prefix", "--num-requests",
             "150", "--request-rate", "5", "--router", "cost", "--num-blocks", "200", "--slo-ttft-ms", "900"],
}


def simulate(flags: list[str], ahead: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *flags, "--no-progress"])
    cost = load_cost_model(args.cost_model)
    _, parts, _ = build_sessions(args, 1)
    router = Router.named(args.router, cost, step_tokens=args.max_num_batched_tokens)
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, num_host_blocks=args.num_host_blocks,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    sim = Simulation(cost, cfg, int(args.instances), router, SyntheticTokenizer(),
                     replay_options(args, args.request_rate), admission=Admission(args.admission),
                     async_saves=args.saver_gbps is not None,
                     save_bytes_s=args.saver_gbps * 1e9 if args.saver_gbps else None)
    if not ahead:
        monkeypatch.setattr(sim, "_run_ahead", lambda i: False)
    seen: list[tuple] = []  # what the router could read at each arrival
    arrive = sim._arrive

    def recorded(s: int, k: int, history: list) -> None:
        ledger, pending = router.ledger, router.pending
        seen.append((sim.now,
                     [(inst.stats.mempool.tiers.get("device"), inst.mirror.entries(), inst.step_end)
                      for inst in sim.instances],
                     sorted((rid, e.instance, e.generated, e.expected_tokens) for rid, e in ledger._entries.items()),
                     sorted((rid, p.instance, tuple(p.hashes)) for rid, p in pending._requests.items()),
                     sorted((rid, t.instance, list(t.output), list(t.record.chunk_times))
                            for rid, t in sim.in_flight.items())))
        arrive(s, k, history)

    monkeypatch.setattr(sim, "_arrive", recorded)
    duration = sim.run(parts[0])
    records = [vars(r) for r in sim.records]
    engines = [inst.engine.stats() for inst in sim.instances]
    return duration, sim.num_steps, records, engines, router.stats(), seen


@pytest.mark.parametrize("run", sorted(RUNS))
def test_running_ahead_changes_nothing(run, monkeypatch):
    ahead = simulate(RUNS[run], True, monkeypatch)
    stepped = simulate(RUNS[run], False, monkeypatch)
    assert ahead[0] == stepped[0] and ahead[1] == stepped[1]  # the same end, the same steps
    assert ahead[2] == stepped[2]  # the same records, every time and token
    assert ahead[3] == stepped[3] and ahead[4] == stepped[4]
    assert len(ahead[5]) == len(stepped[5])
    for k, (a, b) in enumerate(zip(ahead[5], stepped[5])):
        assert a == b, f"what the router reads differs at arrival {k}"
