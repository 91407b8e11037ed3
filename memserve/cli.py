"""Command line: `memserve up | bench | profile | simulate`."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
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
from memserve.ipc.same_host import KV_SAME_HOST_TRANSPORTS
from memserve.kvcache.eviction import EVICTION_POLICIES
from memserve.text.truncation import DEFAULT_TRUNCATION, TRUNCATION_MODES
from memserve.workers.engine.policies import SCHEDULE_POLICIES, make_schedule_policy


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _buffer_layers(text: str) -> int:
    """``--preload-buffer-layers``: a layer count, or ``auto`` (-1: §3.2's formula)."""
    return -1 if text == "auto" else _non_negative_int(text)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("must be in [0, 1]")
    return value


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="serve a model over the OpenAI API")
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file, or a repo id (org/name): from the local Hugging Face cache, "
                        "else downloaded (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--cpu-workers", type=int, default=1, help="worker processes on a machine without a GPU")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="compute threads per CPU worker (default: one per CPU of --cpu-threads-bind, else all)")
    p.add_argument("--cpu-threads-bind", default=os.environ.get("MEMSERVE_CPU_THREADS_BIND"),
                   help="pin each CPU worker's compute threads, one per CPU: CPU lists per worker separated "
                        "by '|', e.g. '1' or '0-1|2-3'; the gateway moves to the CPUs left over "
                        "(env MEMSERVE_CPU_THREADS_BIND)")
    p.add_argument("--cpu-gemm", default="onednn", choices=["onednn", "torch"],
                   help="CPU matrix products: oneDNN over weights prepacked at load (default; "
                        "benchmarks/micro/packed_linear_micro.py measures both) "
                        "or torch's F.linear")
    p.add_argument("--cpu-attention", default="kernel", choices=["kernel", "torch"],
                   help="CPU decode attention: a compiled kernel reading the KV blocks in place (default; built "
                        "on first use with g++, falls back to torch where it cannot be) or torch's SDPA over "
                        "gathered blocks")
    p.add_argument("--cpu-prefill-attention", default="auto", choices=["auto", "blocked", "sdpa"],
                   help="CPU prefill attention: oneDNN products over query blocks in float32, torch's SDPA, or "
                        "auto (default): whichever a short probe at start-up measures faster on this CPU")
    p.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "gguf"],
                   help="weights as the checkpoint ships them: auto (default) runs a GGUF file's Q4_0, Q4_1 and "
                        "Q8_0 linear weights quantized on the CPU (docs/quantization.md); none widens every "
                        "weight to --dtype; gguf insists on quantized execution")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step eagerly: no CUDA graphs, which otherwise replay decode steps "
                        "(captured at start-up per batch size and context width)")
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids, one worker each (e.g. 0,1)")
    p.add_argument("--instances", default=None,
                   help="one role per worker, colocated|prefill|decode: 'prefill,decode' (CPU workers) or "
                        "'prefill:0,decode:1' (role:GPU); default: every worker colocated")
    p.add_argument("--transfer-mode", default="by-request-agg", choices=["by-request-agg", "by-request", "by-layer"],
                   help="prefill-to-decode KV transfers (MemServe §4.3, §5.2): after the prefill, one frame per "
                        "run of aggregated blocks, or one per layer's K or V of each block; by-layer: one "
                        "message per layer during the prefill, overlapping its compute")
    p.add_argument("--kv-same-host-transport", default="shm", choices=KV_SAME_HOST_TRANSPORTS,
                   help="KV transfers between workers on one machine: shm (the receiver copies the blocks "
                        "straight out of the sender's KV pool, mapped once per connection: shared memory on "
                        "CPU, CUDA IPC on a GPU both see; ZeroMQ carries only the control messages) or zmq (the "
                        "blocks as ZeroMQ frames, as between machines). shm falls back to frames for a peer "
                        "that cannot map the pool")
    p.add_argument("--pd-mode", default="pd-caching-3", choices=PD_MODES,
                   help="disaggregated prefill/decode caching (MemServe Table 4): pd-basic (transfer only), "
                        "pd-caching-1 (cache at prefill), pd-caching-2 (decode caches too: incremental "
                        "transfers), pd-caching-3 (decode-phase KV returns to prefill)")
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
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="a prefill computes at most this many tokens a step, so that short prompts admitted "
                        "beside a long one are not held behind it (vLLM's option); 0: no cap")
    p.add_argument("--no-shared-prefill-hold", action="store_true",
                   help="admit a request at once even when a running prefill is computing blocks of its "
                        "prompt (by default it waits for them and finds them cached)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding by prompt lookup, vLLM's option and keys: e.g. '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                        "\"prompt_lookup_min\": 2}'; greedy requests without logprobs, penalties or "
                        "grammars take drafts (docs/speculative_decoding.md); off by default")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true", help="disable context caching (the baseline)")
    p.add_argument("--kv-layout", default="aggregated", choices=["aggregated", "layer-major"])
    p.add_argument("--schedule-policy", default="fcfs", choices=sorted(SCHEDULE_POLICIES),
                   help="order of admission and choice of preemption victims in each worker; lpm: the "
                        "longest cached prefix first (SGLang's), so returning conversations skip the queue; "
                        "cacheopt: SLO-aware batching, KV allocation and preemption (CacheOpt §3)")
    p.add_argument("--schedule-policy-options", default="",
                   help="options of the schedule policy, e.g. cacheopt's 'disable=PA,GR;reserve=8;m=2;b=8'")
    p.add_argument("--eviction-policy", default="lru", choices=sorted(EVICTION_POLICIES),
                   help="which cached KV blocks a tier gives up first (scheduler-aware: those the waiting "
                        "queue needs go last, and its disk blocks are prefetched to the host tier)")
    p.add_argument("--layerwise-preload", default="on", choices=["on", "off"],
                   help="on: a prefill whose cached prefix sits in a slower tier runs while that prefix is "
                        "copied in layer by layer, each layer waited for just before it computes "
                        "(AttentionStore §3.2); off: the request waits for the whole copy first")
    p.add_argument("--preload-buffer-layers", type=_buffer_layers, default=-1, metavar="N|auto",
                   help="layers a preload may copy ahead of the compute (its read buffer): 0 starts the copy "
                        "with the request's step, one layer ahead; N copies N layers before it and stays N "
                        "ahead; auto (default) sizes it per load by §3.2's formula from measured copy and "
                        "compute rates")
    p.add_argument("--cache-ttl", type=float, default=None, metavar="SECONDS",
                   help="drop cached conversations unused for this long from every tier (default: kept until "
                        "capacity evicts them); a request may ask for longer with the body field cache_ttl_s")
    p.add_argument("--max-pinned-fraction", type=_fraction, default=0.25, metavar="F",
                   help="at most this fraction of each KV tier may be pinned by requests' cache_control "
                        "(a message's {\"type\": \"ephemeral\", \"ttl\": \"5m\"|\"1h\"}); a request whose pin "
                        "would pass it is served unpinned (header x-memserve-cache-pin); 0 turns pinning off")
    p.add_argument("--max-pinned-fraction-per-key", type=_fraction, default=None, metavar="F",
                   help="at most this fraction of each KV tier may be pinned by one API key's requests, so one "
                        "tenant's pins cannot crowd out the others' (default: --max-pinned-fraction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router", default="least-load", choices=sorted(ROUTING_POLICIES),
                   help="how the gateway picks a worker for each request")
    p.add_argument("--cost-model", default=None,
                   help="cost model for routing and TTFT predictions: a `memserve profile` JSON or a preset "
                        "(default: this model's profile; without one, one is made in the background)")
    p.add_argument("--no-auto-profile", action="store_true",
                   help="without a cost model, do not profile one in the background (`memserve profile --quick`, "
                        "about 30 s of CPU, written where `memserve profile` writes); cost routing then stays on "
                        "its prompt-tree fallback and SLO admission stays off")
    p.add_argument("--router-balance-abs", type=int, default=16,
                   help="prompt-tree/cost: requests in flight beyond the least loaded worker after which the "
                        "least loaded one is chosen instead (with --router-balance-rel)")
    p.add_argument("--router-balance-rel", type=float, default=1.5,
                   help="... and the ratio to the least loaded worker's requests it must also exceed")
    p.add_argument("--router-cache-threshold", type=float, default=0.5,
                   help="prompt-tree: follow a cached prefix only when it covers this share of the prompt")
    p.add_argument("--slo-ttft-ms", type=_positive_float, default=None,
                   help="TTFT SLO of requests that set none (body slo_ttft_ms or header x-slo-ttft-ms)")
    p.add_argument("--slo-tbt-ms", type=_positive_float, default=None,
                   help="TBT SLO of requests that set none (body slo_tbt_ms or header x-slo-tbt-ms)")
    p.add_argument("--admission", default="reject", choices=ADMISSION_MODES,
                   help="requests the cost model predicts to miss their TTFT SLO on every worker: reject "
                        "(429 with Retry-After), queue (hold them until they fit), off (admit all); "
                        "judges once there is a cost model (--cost-model, `memserve profile`, or the background "
                        "profile of a first start)")
    p.add_argument("--admission-queue-size", type=_non_negative_int, default=256,
                   help="--admission queue: requests held at most; one more is answered 429")
    p.add_argument("--predictor", default="on", choices=["on", "off"],
                   help="predict each request's output length in the gateway (learned online from finished "
                        "requests, padded by the Hoeffding bound) for the cacheopt schedule policy")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds of silence after which a worker is declared dead, failed and restarted")
    p.add_argument("--spare-workers", type=int, default=0,
                   help="CPU workers kept loaded and warmed up to replace one that dies within a second "
                        "(each holds the model and a KV pool in memory)")
    p.add_argument("--internal-transport", default=None, choices=["ipc", "tcp"],
                   help="gateway-worker and KV transfer sockets: ipc files in a private directory (one "
                        "machine), or TCP on --internal-host encrypted and authenticated with CurveZMQ "
                        "(default: ipc; tcp with --ray, which needs it)")
    p.add_argument("--internal-host", default=None,
                   help="address of the gateway's internal TCP sockets (default: 127.0.0.1; with --ray, the IP "
                        "Ray knows the gateway's node by; workers under Ray listen on their own node's IP)")
    ray = p.add_argument_group("Ray")  # workers on the nodes of a Ray cluster (docs/multi-node.md)
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="place and supervise the workers with Ray, one actor per worker on the nodes of a Ray "
                          "cluster: --ray alone joins $RAY_ADDRESS or the cluster last started on this machine, "
                          "else starts a local one; 'auto' joins this machine's cluster; HOST:PORT or "
                          "ray://HOST:PORT joins that one (needs pip install 'memserve[ray]')")
    ray.add_argument("--ray-placement", default="spread", choices=["spread", "pack"],
                     help="with --ray, one placement group holds a bundle per worker ({GPU: 1}, or {CPU: "
                          "--cpu-threads, default 1}): spread puts them on as many nodes as it can, pack on as "
                          "few")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a complete request head (from connect or the last response)")
    p.add_argument("--body-timeout", type=float, default=10.0, help="seconds a request body has to arrive (408)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections; a new one past this is answered 503")
    p.add_argument("--truncation", default=DEFAULT_TRUNCATION, choices=TRUNCATION_MODES,
                   help="a chat over the context window: drop whole blocks of its oldest turns (keeping the "
                        "system prompt) and reuse their successors' cached KV shifted (kv-shift) or recompute "
                        "it (recompute); or refuse it with 400 (error)")
    p.add_argument("--tool-call-parser", default=TOOL_PARSER_AUTO, choices=[TOOL_PARSER_AUTO, *TOOL_PARSERS],
                   help="how the model writes tool calls for tool_choice auto: hermes (<tool_call> tags), "
                        "llama3_json (Llama 3.1's JSON), mistral ([TOOL_CALLS]); auto: the one the chat template "
                        "writes, else hermes")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="put the model's <think>...</think> text in the message's reasoning_content instead of "
                        "its content: qwen3 (the model opens <think>), deepseek_r1 (the template opens it)")
    p.add_argument("--responses-store-size", type=int, default=1000, metavar="N",
                   help="stored /v1/responses responses (store: true) kept for GET and previous_response_id, per "
                        "server; past it the oldest goes first; 0: none is kept")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="seconds a stored /v1/responses response is kept")
    p.add_argument("--no-web-ui", action="store_true",
                   help="do not serve the chat page (/) and the cache dashboard (/dashboard); the stats API "
                        "(/v1/stats, /v1/stats/stream) stays")
    keys = p.add_argument_group("API keys")
    keys.add_argument("--api-key", action="append", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (401 "
                           "otherwise); repeat for several keys. Also read from MEMSERVE_API_KEY (comma-separated "
                           "keys). /health stays open")
    keys.add_argument("--metrics-api-key", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /metrics (open without it)")
    keys.add_argument("--cache-salt-from-key", action="store_true",
                      help="salt every request's KV cache with its API key (combined with a body's cache_salt, "
                           "never replaced by it), so clients with different keys never share cached KV blocks "
                           "(needs --api-key)")
    p.add_argument("--log-level", default=os.environ.get("MEMSERVE_LOG_LEVEL", "INFO"))
    kv_events = p.add_argument_group("KV events")  # vLLM-format KV events (workers/kv_event_publisher.py)
    kv_events.add_argument("--kv-events-config", default=None, metavar="JSON",
                           help="publish each worker's KV cache events in vLLM's format (ZeroMQ PUB + replay "
                                "ROUTER), e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                                "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5600\", "
                                "\"topic\": \"kv-events\"}'; worker i binds each TCP port + i, or replaces "
                                "{instance} (docs/observability.md)")
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from memserve.gateway.engine_client import WorkerStartError
    from memserve.gateway.router_setup import RouterConfigError
    from memserve.gateway.server import serve

    if args.cache_ttl is not None and args.cache_ttl <= 0:
        print(f"memserve: --cache-ttl must be positive, got {args.cache_ttl}", file=sys.stderr)
        return 2
    if args.responses_store_size < 0 or args.responses_store_ttl <= 0:
        print("memserve: --responses-store-size must be at least 0 and --responses-store-ttl positive", file=sys.stderr)
        return 2
    try:  # a bad option fails here, not in every worker at start-up
        make_schedule_policy(args.schedule_policy, args.schedule_policy_options)
    except ValueError as exc:
        print(f"memserve: --schedule-policy-options: {exc}", file=sys.stderr)
        return 2
    kv_events_config = _kv_events_config(args)
    if isinstance(kv_events_config, bool):  # False: refused, the reason printed
        return 2
    speculative_config = _speculative_config(args)
    if isinstance(speculative_config, bool):
        return 2
    ray_error = _ray_error(args)
    if ray_error:
        print(f"memserve: {ray_error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s gateway %(levelname)s %(message)s")
    os.environ["MEMSERVE_LOG_LEVEL"] = args.log_level
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        cpu_threads=args.cpu_threads,
        cpu_threads_bind=args.cpu_threads_bind,
        cpu_gemm=args.cpu_gemm,
        cpu_attention=args.cpu_attention,
        cpu_prefill_attention=args.cpu_prefill_attention,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_gb=args.kv_cache_gb,
        num_host_blocks=args.num_host_blocks,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gb=args.disk_cache_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        hold_shared_prefills=not args.no_shared_prefill_hold,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        kv_layout=args.kv_layout,
        transfer_mode=args.transfer_mode,
        kv_same_host_transport=args.kv_same_host_transport,
        schedule_policy=args.schedule_policy,
        schedule_policy_options=args.schedule_policy_options,
        cost_model=args.cost_model,
        eviction_policy=args.eviction_policy,
        layerwise_preload=args.layerwise_preload == "on",
        preload_buffer_layers=args.preload_buffer_layers,
        cache_ttl_s=args.cache_ttl,
        max_pinned_fraction=args.max_pinned_fraction,
        max_pinned_fraction_per_key=args.max_pinned_fraction_per_key,
        speculative_config=speculative_config,
        seed=args.seed,
    )
    cfg = ServeConfig(
        host=args.host,
        port=args.port,
        engine=engine,
        cpu_workers=args.cpu_workers,
        gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None,
        pd_mode=args.pd_mode,
        served_model_name=args.served_model_name,
        heartbeat_timeout_s=args.heartbeat_timeout,
        spare_workers=args.spare_workers,
        internal_transport=args.internal_transport or ("ipc" if args.ray is None else "tcp"),
        internal_host=args.internal_host,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        truncation=args.truncation,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        responses_store_size=args.responses_store_size,
        responses_store_ttl_s=args.responses_store_ttl,
        web_ui=not args.no_web_ui,
        router=args.router,
        cost_model=args.cost_model,
        auto_profile=not args.no_auto_profile,
        router_balance_abs=args.router_balance_abs,
        router_balance_rel=args.router_balance_rel,
        router_cache_threshold=args.router_cache_threshold,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tbt_ms=args.slo_tbt_ms,
        admission=args.admission,
        admission_queue_size=args.admission_queue_size,
        predictor=args.predictor,
        kv_events_config=kv_events_config or None,
        ray=args.ray,
        ray_placement=args.ray_placement,
    )
    # API keys (gateway/auth.py): the flag's keys plus MEMSERVE_API_KEY's.
    from memserve.gateway.auth import ENV_API_KEY, auth_config

    auth = auth_config(args.api_key, os.environ.get(ENV_API_KEY), args.metrics_api_key, args.cache_salt_from_key)
    cfg.api_keys, cfg.metrics_api_key, cfg.cache_salt_from_key = list(auth.api_keys), auth.metrics_api_key, \
        auth.cache_salt_from_key
    if cfg.cache_salt_from_key and not cfg.api_keys:
        print("memserve: --cache-salt-from-key needs --api-key or MEMSERVE_API_KEY", file=sys.stderr)
        return 2
    if args.instances:
        try:
            cfg.roles, gpus = parse_instances(args.instances)
        except ValueError as exc:
            print(f"memserve: {exc}", file=sys.stderr)
            return 2
        cfg.gpus = gpus or cfg.gpus
        if not gpus and args.cpu_workers not in (1, len(cfg.roles)):
            print(f"memserve: --instances names {len(cfg.roles)} workers, --cpu-workers {args.cpu_workers}",
                  file=sys.stderr)
            return 2
        cfg.cpu_workers = len(cfg.roles)
    if args.cpu_threads_bind and not cfg.gpus:
        from memserve.workers.cpu_threads import gateway_cpus, worker_cpu_lists

        try:
            left = gateway_cpus(worker_cpu_lists(args.cpu_threads_bind, cfg.cpu_workers))
        except ValueError as exc:
            print(f"memserve: {exc}", file=sys.stderr)
            return 2
        if left:  # workers pin themselves; the gateway keeps off their CPUs where it can
            os.sched_setaffinity(0, left)
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
        print(f"memserve: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _ray_error(args: argparse.Namespace) -> str | None:
    """Why ``--ray`` cannot serve with these flags, or None."""
    if args.ray is None:
        return None
    if importlib.util.find_spec("ray") is None:  # found, not imported: the gateway imports it later
        return "--ray needs Ray, which is not installed: pip install 'memserve[ray]'"
    if args.internal_transport == "ipc":
        return "--ray needs --internal-transport tcp: the workers may run on other nodes"
    if args.spare_workers:
        return "--spare-workers starts local processes; it does not go with --ray"
    return None


def _json_option(flag: str, text: str | None, check: Callable[[dict], object]) -> dict | None | bool:
    """A JSON-object option checked here (not in every worker) by ``check``, which raises
    ValueError or TypeError when it is bad: the dict, None when absent, False (after an
    error message) when bad."""
    if text is None:
        return None
    import json

    try:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise TypeError("must be a JSON object")
        check(d)
    except (ValueError, TypeError) as exc:
        print(f"memserve: {flag}: {exc}", file=sys.stderr)
        return False
    return d


def _speculative_config(args: argparse.Namespace) -> dict | None | bool:
    from memserve.workers.engine.ngram_proposer import NgramConfig

    return _json_option("--speculative-config", args.speculative_config, NgramConfig.from_dict)


def _kv_events_config(args: argparse.Namespace) -> dict | None | bool:
    from memserve.workers.kv_event_publisher import KVEventsConfig, instance_endpoint

    def check(d: dict) -> None:
        cfg = KVEventsConfig.from_dict(d)
        workers = len(args.gpus.split(",")) if args.gpus else max(args.cpu_workers, 1)
        for i in range(workers):
            instance_endpoint(cfg.endpoint, i)
            if cfg.replay_endpoint:
                instance_endpoint(cfg.replay_endpoint, i)

    return _json_option("--kv-events-config", args.kv_events_config, check)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this model on this hardware and fit its cost model (MemServe §5.3)")
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file, or a repo id (org/name): from the local Hugging Face cache, "
                        "else downloaded (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
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
