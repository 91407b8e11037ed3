"""``memserve simulate``: the shipped engine, scheduler, MemPool and router at cluster
scale on a virtual clock, driven by a cost model (``memserve profile``'s JSON or a paper
preset) instead of a model. Workload, load and output flags are ``memserve bench``'s,
with the same meaning, and so is ``results.json``: ``memserve bench compare`` reads real
and simulated runs side by side."""

from __future__ import annotations

import argparse
import math
import time

from rich.console import Console

from memserve.config import EngineConfig, ServeConfig, WorkerConfig
from memserve.costmodel.model import BandwidthCost, CostModel
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.admission import DEFAULT_MAX_HELD, Admission
from memserve.gateway.routing.admission import MODES as ADMISSION_MODES
from memserve.gateway.routing.pd_topology import PD_MODES, parse_instances
from memserve.gateway.routing.router import ROUTING_POLICIES, Balance, Router
from memserve.kvcache.eviction import EVICTION_POLICIES
from memserve.sim.node_loss import NodeLoss
from memserve.sim.predictor import PADDINGS, NoisyOracle
from memserve.sim.report import simulation_stats
from memserve.sim.simulator import Simulation
from memserve.sim.tokens import HFTokenizer, SyntheticTokenizer
from memserve.sim.topology import CROSS_HOST_BYTES_S, CROSS_HOST_LATENCY_S, Topology
from memserve.workers.engine.policies import SCHEDULE_POLICIES
from memserve.workload.options import (
    add_load_arguments,
    add_output_arguments,
    add_workload_arguments,
    build_sessions,
    fail,
    point_result,
    positive_float,
    replay_options,
    run_config,
    write_outputs,
)
from memserve.workload.replay import ReplayResult
from memserve.workload.report import RunPoint, print_run

EXIT_OK, EXIT_USAGE = 0, 2
# A worker's heartbeat period and the gateway's timeout, as memserve up runs them.
HEARTBEAT_S: float = WorkerConfig.heartbeat_s
HEARTBEAT_TIMEOUT_S: float = ServeConfig.heartbeat_timeout_s


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="run the engine at cluster scale on a cost-model clock",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sim = p.add_argument_group("cluster")
    sim.add_argument("--cost-model", required=True, help="a cost-model JSON (memserve profile) or a preset name")
    sim.add_argument("--instances", default="1",
                     help="N colocated instances, or one role per instance as memserve up takes them: "
                          "'prefill,prefill,decode,decode' (disaggregated prefill/decode, sim/pd_flow.py)")
    sim.add_argument("--pd-mode", default="pd-caching-3", choices=PD_MODES,
                     help="disaggregated caching milestone (MemServe Table 4), as memserve up")
    sim.add_argument("--router", default="least-load", choices=sorted(ROUTING_POLICIES))
    sim.add_argument("--router-balance-abs", type=int, default=Balance.abs_threshold,
                     help="load-imbalance guard of prompt-tree/cost (as memserve up)")
    sim.add_argument("--router-balance-rel", type=float, default=Balance.rel_threshold)
    sim.add_argument("--router-cache-threshold", type=float, default=Balance.cache_threshold)
    sim.add_argument("--admission", default="reject", choices=ADMISSION_MODES,
                     help="the gateway's admission control on requests' TTFT SLOs, as memserve up: refused "
                          "requests are recorded with status 429")
    sim.add_argument("--admission-queue-size", type=int, default=DEFAULT_MAX_HELD,
                     help="--admission queue: requests held at most")
    sim.add_argument("--schedule-policy", default="fcfs", choices=sorted(SCHEDULE_POLICIES))
    sim.add_argument("--schedule-policy-options", default="",
                     help="e.g. cacheopt's ablations: 'disable=RSA' (RSA, PA, GR, PP, PSS; workers/engine/policies/cacheopt/options.py)")
    sim.add_argument("--predict-error", type=float, default=None,
                     help="play the gateway's output-length predictor: a noisy oracle whose log-error has this "
                          "standard deviation (sim/predictor.py); default: no predictions")
    sim.add_argument("--padding", default="hoeffding", choices=PADDINGS,
                     help="padding of those predictions: CacheOpt's confidence-based one, or a fixed 10%% (/CKA)")
    sim.add_argument("--eviction-policy", default="lru", choices=sorted(EVICTION_POLICIES))
    sim.add_argument("--num-blocks", type=int, default=2048, help="device KV blocks per instance")
    sim.add_argument("--num-host-blocks", type=int, default=0, help="host-tier KV blocks per instance")
    sim.add_argument("--num-disk-blocks", type=int, default=0,
                     help="disk-tier KV blocks per instance (bookkeeping only; loads pay a disk read)")
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--max-num-seqs", type=int, default=64)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--long-prefill-token-threshold", type=int, default=0,
                     help="a prefill computes at most this many tokens a step; 0: no cap")
    sim.add_argument("--no-shared-prefill-hold", action="store_true",
                     help="admit a request at once even when a running prefill is computing blocks of its prompt")
    sim.add_argument("--max-model-len", type=int, default=None)
    sim.add_argument("--no-prefix-cache", action="store_true")
    sim.add_argument("--async-saver", action="store_true",
                     help="save down the tiers in the background, each copy taking its bytes over the host "
                          "link or the disk (sim/saver.py), as a worker's save thread; default: synchronous "
                          "saves that take no time")
    sim.add_argument("--saver-gbps", type=positive_float, default=None,
                     help="the background saver's bandwidth in GB/s for every copy (a slow saver; implies "
                          "--async-saver)")
    sim.add_argument("--max-loras", type=int, default=1,
                     help="LoRA adapter slots per instance (with --lora-modules; sim/adapters.py)")
    sim.add_argument("--lora-load-ms", type=positive_float, default=40.0,
                     help="milliseconds an instance takes to read in an adapter its slots lack (a worker's "
                          "lora_load_s: 25-54 ms for a rank-16 SmolLM2 adapter on the CPU)")
    add_host_arguments(p)
    add_workload_arguments(p)
    add_load_arguments(p)
    add_output_arguments(p)
    p.set_defaults(func=run_simulate_command)
    return p


def add_host_arguments(p: argparse.ArgumentParser) -> None:
    """The hosts the instances run on, their links, and hosts lost during the run."""
    hosts = p.add_argument_group("hosts")
    hosts.add_argument("--instances-per-host", type=int, default=0,
                       help="instances a host runs (instance i on host i // N); pulls and handoffs between hosts "
                            "take the cross-host link, within one the cost model's transfer; default: one host")
    hosts.add_argument("--cross-host-gbps", type=positive_float, default=CROSS_HOST_BYTES_S / 1e9,
                       help="the cross-host link's bandwidth, GB/s")
    hosts.add_argument("--cross-host-latency-ms", type=float, default=CROSS_HOST_LATENCY_S * 1e3,
                       help="the cross-host link's latency per transfer, ms")
    hosts.add_argument("--node-loss-every", type=positive_float, default=None, metavar="S",
                       help="lose one host (all its instances) every S simulated seconds, the first at S/2; "
                            "its requests move as the gateway moves a dead worker's (sim/node_loss.py)")
    hosts.add_argument("--heartbeat-timeout", type=positive_float, default=HEARTBEAT_TIMEOUT_S,
                       help="seconds without heartbeats before the gateway declares a worker dead (as memserve up)")


def topology_and_loss(args: argparse.Namespace, num_instances: int,
                      cost: CostModel) -> tuple[Topology, NodeLoss | None]:
    """The hosts of ``--instances-per-host`` and the node loss of ``--node-loss-every``."""
    cross = BandwidthCost(args.cross_host_latency_ms / 1e3, args.cross_host_gbps * 1e9)
    topology = Topology(num_instances, args.instances_per_host or num_instances, cost.transfer, cross)
    loss = None
    if args.node_loss_every is not None:
        loss = NodeLoss(topology, args.node_loss_every, HEARTBEAT_S, args.heartbeat_timeout)
    return topology, loss


def run_simulate_command(args: argparse.Namespace) -> int:
    engine_cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                              num_host_blocks=args.num_host_blocks, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              long_prefill_token_threshold=args.long_prefill_token_threshold,
                              hold_shared_prefills=not args.no_shared_prefill_hold,
                              max_model_len=args.max_model_len,
                              enable_prefix_caching=not args.no_prefix_cache, schedule_policy=args.schedule_policy,
                              schedule_policy_options=args.schedule_policy_options, cost_model=args.cost_model,
                              eviction_policy=args.eviction_policy)
    try:
        roles = ["colocated"] * int(args.instances) if args.instances.isdigit() else parse_instances(args.instances)[0]
        cost = load_cost_model(args.cost_model)
        rate = args.rate or args.request_rate or math.inf
        spec, parts, dataset = build_sessions(args, 1)
        tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else SyntheticTokenizer()
        router = Router.named(args.router, cost, Balance(args.router_balance_abs, args.router_balance_rel,
                                                                    args.router_cache_threshold),
                              step_tokens=engine_cfg.prefill_chunk_tokens)
        topology, node_loss = topology_and_loss(args, len(roles), cost)
    except (ValueError, FileNotFoundError, OSError, KeyError) as e:
        return fail(str(e), EXIT_USAGE)
    predict = None
    if args.predict_error is not None:
        predict = NoisyOracle(args.predict_error, 0.0 if math.isinf(rate) else rate, args.padding, seed=args.seed)
    try:
        sim = Simulation(cost, engine_cfg, len(roles), router, tokenizer, replay_options(args, rate),
                         args.num_disk_blocks, predict, roles, args.pd_mode,
                         Admission(args.admission, args.admission_queue_size), topology, node_loss,
                         args.async_saver or args.saver_gbps is not None,
                         args.saver_gbps * 1e9 if args.saver_gbps else None,
                         (args.max_loras, args.lora_load_ms / 1e3) if args.lora_modules else None)
    except ValueError as e:
        return fail(str(e), EXIT_USAGE)
    started = time.perf_counter()
    duration = sim.run(parts[0])
    wall = time.perf_counter() - started
    console = Console(soft_wrap=True)
    label = args.label or f"sim:{cost.key.model}x{len(roles)}"
    result = point_result(ReplayResult(records=sim.records, duration_s=duration))
    result["simulation"] = simulation_stats(sim, wall, duration, roles)
    point = RunPoint(label, None, result)
    print_run(console, point)
    console.print(f"simulated {duration:.1f} s of traffic ({len(sim.records)} requests, {sim.num_steps} steps) "
                  f"in {wall:.2f} s of wall time")
    config = run_config(args, cost.key.model, spec, dataset)
    config["cost_model"] = args.cost_model
    write_outputs(args, config, label, [point], console)
    return EXIT_OK
