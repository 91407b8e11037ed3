"""The simulator at cluster scale, scaled down: instances on hosts whose links price the
prefix pulls between them (the router is given the same figures), a host lost mid-run
whose requests move to live instances as the gateway moves a dead worker's and finish
there with nothing left behind, and the asynchronous saver on the virtual clock: slow, it
makes evictions wait, and the MemPool drops no block unsaved."""

from __future__ import annotations

import argparse

from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.router import Router
from memserve.kvcache.address import Tier
from memserve.sim.cli import add_parser, topology_and_loss
from memserve.sim.report import simulation_stats
from memserve.sim.simulator import Simulation
from memserve.sim.tokens import SyntheticTokenizer
from memserve.workload.options import build_sessions, replay_options

# 8 instances on 2 hosts; 320 requests over 16 shared prompts at 16/s (20 s).
FLAGS = ["--cost-model", "llama2-13b-h800", "--instances", "8", "--instances-per-host", "4", "--router", "cost",
         "--workload", "shared-prefix", "--num-prefixes", "16", "--prefix-len", "1024", "--num-requests", "320",
         "--request-rate", "16", "--num-blocks", "400", "--cross-host-gbps", "5", "--cross-host-latency-ms", "1"]


def build(*extra: str) -> tuple[Simulation, list]:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *FLAGS, *extra, "--no-progress"])
    cost = load_cost_model(args.cost_model)
    _, parts, _ = build_sessions(args, 1)
    router = Router.named(args.router, cost, step_tokens=args.max_num_batched_tokens)
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, num_host_blocks=args.num_host_blocks,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    topology, loss = topology_and_loss(args, int(args.instances), cost)
    sim = Simulation(cost, cfg, int(args.instances), router, SyntheticTokenizer(),
                     replay_options(args, args.request_rate), topology=topology, node_loss=loss,
                     async_saves=args.saver_gbps is not None,
                     save_bytes_s=args.saver_gbps * 1e9 if args.saver_gbps else None)
    return sim, parts[0]


def cache_prefix(sim: Simulation, instance: int, tokens: list[int]) -> None:
    pool = sim.instances[instance].engine.mempool
    addrs = pool.alloc_mem(len(tokens) // pool.block_size)
    pool.insert(tokens, addrs)
    pool.free_mem(addrs)


def test_pulls_are_priced_by_the_link_between_the_hosts():
    sim, _ = build()
    topology, cost = sim.topology, sim.cost
    assert [topology.host(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    prompt = list(range(1000, 1000 + 64 * 16))
    cache_prefix(sim, 0, prompt)
    nbytes = 64 * 16 * cost.kv_bytes_per_token
    assert sim._pull(0, 1, prompt) == cost.transfer_s(nbytes)  # same host: the cost model's transfer
    cross = sim._pull(0, 5, prompt)
    assert cross == 1e-3 + nbytes / 5e9 > 10 * cost.transfer_s(nbytes)
    assert dict(sim.pulls) == {"same_host": 1, "same_host_blocks": 64, "cross_host": 1, "cross_host_blocks": 64}
    assert sim.instances[5].engine.mempool.match(prompt, take_ref=False)  # the prefix did move
    # The router prices eq. 2 by the same links, as the gateway's measured ones.
    assert sim.router.links[0, 5] is topology.cross_host and sim.router.links[5, 4] is topology.same_host


def test_a_lost_host_moves_its_requests_to_live_instances_and_leaves_nothing_behind():
    sim, sessions = build("--node-loss-every", "20")
    routed: list[tuple[float, int]] = []
    route = sim.router.route

    def recorded(request, views):
        decision = route(request, views)
        routed.append((sim.now, decision.instance))
        return decision

    sim.router.route = recorded  # type: ignore[method-assign]
    sim.run(sessions)
    loss = sim.node_loss
    assert loss is not None and len(loss.lost) == 1
    lost_at, host = loss.lost[0]
    dead = set(sim.topology.instances(host))
    assert lost_at == 10.0 and all(sim.instances[i].state == "dead" for i in dead)
    assert sum(loss.moves.values()) == len(loss.moved) > 0
    # Every request finished, the moved ones on live instances (none is routed to the dead
    # ones once the gateway declared them dead).
    assert len(sim.records) == 320 and all(r.ok for r in sim.records)
    assert not [i for at, i in routed if at >= lost_at + loss.timeout_s and i in dead]
    moved = [r for r in sim.records if f"{r.session_id}:{r.turn}" in loss.moved]
    assert len(moved) == len(loss.moved) and all(r.output_tokens == 128 for r in moved)
    # Nothing in flight, queued, held or pending anywhere the gateway or a live engine looks.
    assert not sim.in_flight and not sim.router.ledger._entries and not len(sim.router.pending)
    for i, inst in enumerate(sim.instances):
        if i not in dead:
            assert not inst.engine.has_work
            assert inst.engine.mempool.tier_stats(Tier.DEVICE)["used"] == 0
    stats = simulation_stats(sim, 1.0, sim.now, ["colocated"] * 8)["node_loss"]
    assert stats["moved"]["requests"] == len(moved) and stats["others"]["requests"] == 320 - len(moved)
    assert stats["moved"]["ttft_ms"]["p50"] > stats["others"]["ttft_ms"]["p50"]


def test_a_slow_saver_makes_evictions_wait_and_drops_nothing_unsaved():
    sim, sessions = build("--num-blocks", "200", "--num-host-blocks", "200", "--saver-gbps", "0.5")
    sim.run(sessions)
    assert all(r.ok for r in sim.records)
    tiers = simulation_stats(sim, 1.0, sim.now, ["colocated"] * 8)["tiers"]
    assert tiers["saver"]["jobs"] > 0 and tiers["saver"]["waits"] > 0 and tiers["saver"]["stall_s"] > 0
    assert tiers["dropped_unsaved"] == {"device": 0, "host": 0}
