"""Command line: `memserve up | bench | profile | simulate`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from memserve.config import EngineConfig, ServeConfig
from memserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from memserve.gateway.routing.admission import MODES as ADMISSION_MODES
from memserve.gateway.routing.pd_topology import PD_MODES, parse_instances
from memserve.gateway.routing.router import ROUTING_POLICIES
from memserve.gateway.tool_parsers import AUTO as TOOL_PARSER_AUTO
from memserve.gateway.tool_parsers import PARSERS as TOOL_PARSERS
from memserve.options import add_options, from_namespace
from memserve.workers.engine.policies import SCHEDULE_POLICIES, make_schedule_policy


# Choices of config fields that live in the applications' registries (config.py may not
# import them: see its docstring).
_REGISTRIES = {
    "pd_mode": PD_MODES,
    "schedule_policy": sorted(SCHEDULE_POLICIES),
    "router": sorted(ROUTING_POLICIES),
    "admission": ADMISSION_MODES,
    "tool_call_parser": [TOOL_PARSER_AUTO, *TOOL_PARSERS],
    "reasoning_parser": sorted(REASONING_PARSERS),
}


def _add_up(sub: argparse._SubParsersAction) -> None:
    """``memserve up``: the flags of EngineConfig's and ServeConfig's fields, plus the
    two that set no single field."""
    p = sub.add_parser("up", help="serve a model over the OpenAI API")
    add_options(p, EngineConfig, ServeConfig, registries=_REGISTRIES)
    # --instances sets roles and may set gpus and cpu_workers (parse_instances);
    # --log-level configures logging, not serving.
    p.add_argument("--instances", default=None,
                   help="one role per worker, colocated|prefill|decode: 'prefill,decode' (CPU workers) or "
                        "'prefill:0,decode:1' (role:GPU); default: every worker colocated")
    p.add_argument("--log-level", default=os.environ.get("MEMSERVE_LOG_LEVEL", "INFO"))
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from memserve.gateway.engine_client import WorkerStartError
    from memserve.gateway.router_setup import RouterConfigError
    from memserve.gateway.server import serve

    try:
        cfg = _up_config(args)
        gateway_cpus = _gateway_cpus(cfg)
    except ValueError as exc:
        print(f"memserve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s gateway %(levelname)s %(message)s")
    os.environ["MEMSERVE_LOG_LEVEL"] = args.log_level
    if gateway_cpus:  # workers pin themselves; the gateway keeps off their CPUs where it can
        os.sched_setaffinity(0, gateway_cpus)
    run: Callable[..., Any]
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
        print(f"memserve: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _up_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of ``memserve up``'s flags, checked before anything starts; raises
    ValueError naming the flag at fault."""
    from memserve.gateway.auth import ENV_API_KEY, auth_config

    engine = from_namespace(EngineConfig, args, cost_model=args.cost_model)
    cfg = from_namespace(ServeConfig, args, engine=engine)
    if args.instances:
        _apply_instances(cfg, args.instances)
    # API keys (gateway/auth.py): the flag's keys plus MEMSERVE_API_KEY's.
    auth = auth_config(cfg.api_keys, os.environ.get(ENV_API_KEY), cfg.metrics_api_key, cfg.cache_salt_from_key)
    cfg.api_keys, cfg.metrics_api_key = list(auth.api_keys), auth.metrics_api_key
    cfg.validate()
    try:  # a bad option fails here, not in every worker at start-up
        make_schedule_policy(engine.schedule_policy, engine.schedule_policy_options)
    except ValueError as exc:
        raise ValueError(f"--schedule-policy-options: {exc}") from exc
    _check_json_options(cfg)
    return cfg


def _apply_instances(cfg: ServeConfig, spec: str) -> None:
    """``--instances``: the workers' roles, and their GPUs where it names them."""
    cfg.roles, gpus = parse_instances(spec)
    cfg.gpus = gpus or cfg.gpus
    if not gpus and cfg.cpu_workers not in (1, len(cfg.roles)):
        raise ValueError(f"--instances names {len(cfg.roles)} workers, --cpu-workers {cfg.cpu_workers}")
    cfg.cpu_workers = len(cfg.roles)


def _check_json_options(cfg: ServeConfig) -> None:
    """The keys of --speculative-config and --kv-events-config, checked here rather than
    in every worker."""
    from memserve.workers.engine.ngram_proposer import NgramConfig
    from memserve.workers.kv_event_publisher import KVEventsConfig, instance_endpoint

    def kv_events(d: dict) -> None:
        events = KVEventsConfig.from_dict(d)
        for i in range(len(cfg.gpus) if cfg.gpus else max(cfg.cpu_workers, 1)):
            instance_endpoint(events.endpoint, i)
            if events.replay_endpoint:
                instance_endpoint(events.replay_endpoint, i)

    for flag, value, check in (("--kv-events-config", cfg.kv_events_config, kv_events),
                               ("--speculative-config", cfg.engine.speculative_config, NgramConfig.from_dict)):
        try:
            if value is not None:
                check(value)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{flag}: {exc}") from exc


def _gateway_cpus(cfg: ServeConfig) -> set[int]:
    """The CPUs --cpu-threads-bind leaves to the gateway (none when it is not set or the
    workers are on GPUs)."""
    bind = cfg.engine.cpu_threads_bind
    if not bind or cfg.gpus:
        return set()
    from memserve.workers.cpu_threads import gateway_cpus, worker_cpu_lists

    return gateway_cpus(worker_cpu_lists(bind, cfg.cpu_workers * cfg.engine.tensor_parallel_size))


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this model on this hardware and fit its cost model (MemServe §5.3)")
    add_options(p, EngineConfig, only=("model", "dtype", "tensor_parallel_size"))
    p.add_argument("--device", default="auto", help="cpu, cuda:N, or auto (cuda:0 when there is a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (about 30 s on 2 cores): what `memserve up` runs in the background when "
                        "there is no profile")
    p.add_argument("--repeats", type=int, default=3, help="runs per grid point (the median is kept)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the engine, part of the hardware key (default: torch's, as a lone worker)")
    p.add_argument("--output", default=None,
                   help="JSON file (default: $MEMSERVE_CACHE/cost-models/<model>-<dtype>-<hardware>.json)")
    p.set_defaults(func=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from memserve.workers.profiler import (
        main as profile,  # imports torch: only for this command
    )

    return profile(args)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags; ``docs/configuration.md`` is generated from this."""
    parser = argparse.ArgumentParser(prog="memserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_profile(sub)
    from memserve.bench.cli import add_parser as add_bench
    from memserve.sim.cli import add_parser as add_simulate

    add_bench(sub)
    add_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
