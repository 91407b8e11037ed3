"""Command line: `memserve up | bench | profile | simulate`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from memserve.config import EngineConfig, ServeConfig
from memserve.gateway.router import ROUTING_POLICIES
from memserve.kvcache.eviction import EVICTION_POLICIES
from memserve.workers.policies import SCHEDULE_POLICIES


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="serve a model over the OpenAI API")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--cpu-workers", type=int, default=1, help="worker processes on a machine without a GPU")
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids, one worker each (e.g. 0,1)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    kv.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size per worker")
    p.add_argument("--num-host-blocks", type=int, default=0, help="host-DRAM KV tier blocks per worker")
    p.add_argument("--disk-cache-dir", default=None,
                   help="disk KV tier: cached blocks saved here as files (kept across restarts); off by default")
    p.add_argument("--disk-cache-gb", type=float, default=10.0, help="size of the disk KV tier per worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true", help="disable context caching (the baseline)")
    p.add_argument("--kv-layout", default="aggregated", choices=["aggregated", "layer-major"])
    p.add_argument("--schedule-policy", default="fcfs", choices=sorted(SCHEDULE_POLICIES),
                   help="order of admission and choice of preemption victims in each worker")
    p.add_argument("--eviction-policy", default="lru", choices=sorted(EVICTION_POLICIES),
                   help="which cached KV blocks a tier gives up first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router", default="least-load", choices=sorted(ROUTING_POLICIES),
                   help="how the gateway picks a worker for each request")
    p.add_argument("--cost-model", default=None,
                   help="cost model for routing and TTFT predictions: a `memserve profile` JSON or a preset "
                        "(default: this model's profile, if one was made)")
    p.add_argument("--router-balance-abs", type=int, default=16,
                   help="prompt-tree/cost: requests in flight beyond the least loaded worker after which the "
                        "least loaded one is chosen instead (with --router-balance-rel)")
    p.add_argument("--router-balance-rel", type=float, default=1.5,
                   help="... and the ratio to the least loaded worker's requests it must also exceed")
    p.add_argument("--router-cache-threshold", type=float, default=0.5,
                   help="prompt-tree: follow a cached prefix only when it covers this share of the prompt")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds of silence after which a worker is declared dead, failed and restarted")
    p.add_argument("--spare-workers", type=int, default=0,
                   help="CPU workers kept loaded and warmed up to replace one that dies within a second "
                        "(each holds the model and a KV pool in memory)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a complete request head (from connect or the last response)")
    p.add_argument("--body-timeout", type=float, default=10.0, help="seconds a request body has to arrive (408)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections; a new one past this is answered 503")
    p.add_argument("--log-level", default=os.environ.get("MEMSERVE_LOG_LEVEL", "INFO"))
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from memserve.gateway.engine_client import WorkerStartError
    from memserve.gateway.router_setup import RouterConfigError
    from memserve.gateway.server import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s gateway %(levelname)s %(message)s")
    os.environ["MEMSERVE_LOG_LEVEL"] = args.log_level
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_gb=args.kv_cache_gb,
        num_host_blocks=args.num_host_blocks,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gb=args.disk_cache_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        kv_layout=args.kv_layout,
        schedule_policy=args.schedule_policy,
        eviction_policy=args.eviction_policy,
        seed=args.seed,
    )
    cfg = ServeConfig(
        host=args.host,
        port=args.port,
        engine=engine,
        cpu_workers=args.cpu_workers,
        gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None,
        served_model_name=args.served_model_name,
        heartbeat_timeout_s=args.heartbeat_timeout,
        spare_workers=args.spare_workers,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        router=args.router,
        cost_model=args.cost_model,
        router_balance_abs=args.router_balance_abs,
        router_balance_rel=args.router_balance_rel,
        router_cache_threshold=args.router_cache_threshold,
    )
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(cfg))
    except (WorkerStartError, RouterConfigError) as exc:
        print(f"memserve: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"memserve: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this model on this hardware and fit its cost model (MemServe §5.3)")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda:N, or auto (cuda:0 when there is a GPU)")
    p.add_argument("--quick", action="store_true", help="a small grid (about a minute on 2 cores), for tests")
    p.add_argument("--repeats", type=int, default=3, help="runs per grid point (the median is kept)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the engine, part of the hardware key (default: torch's, as a lone worker)")
    p.add_argument("--output", default=None,
                   help="JSON file (default: $MEMSERVE_CACHE/cost-models/<model>-<dtype>-<hardware>.json)")
    p.set_defaults(func=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from memserve.workers.profiler import main as profile  # imports torch: only for this command

    return profile(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_profile(sub)
    from memserve.bench.cli import add_parser as add_bench
    from memserve.sim.cli import add_parser as add_simulate

    add_bench(sub)
    add_simulate(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
