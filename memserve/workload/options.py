"""The workload, load and output flags that ``memserve bench`` and ``memserve simulate``
share (same names, same meaning), and what they build: the sessions to replay, the
replay options, the run's recorded settings and its results files."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from memserve.workload.dataset import (
    TextCorpus,
    default_sharegpt_path,
    load_conversations,
)
from memserve.workload.metrics import compute_metrics
from memserve.workload.replay import ReplayOptions, ReplayResult
from memserve.workload.report import RunPoint, write_json
from memserve.workload.tokens import make_token_counter
from memserve.workload.workloads import (
    MULTI_TURN_WORKLOADS,
    WORKLOADS,
    LengthDist,
    Session,
    WorkloadSpec,
    build_workload,
)

DEFAULT_COUNTS = {"sharegpt": 50, "long-doc-qa": 20, "shared-prefix": 200, "random": 200}

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value

def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value

def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("a rate must be > 0 (or inf)")
    return value

def _rates(text: str) -> list[float]:
    rates = [_rate(x) for x in text.split(",") if x.strip()]
    if not rates or any(math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError("--sweep-rate takes finite rates, e.g. 0.5,1,2,4")
    return rates

def _scale_range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError("expected LO:HI, e.g. 0.5:2.5") from None
    if not 0 < lo <= hi < math.inf:
        raise argparse.ArgumentTypeError("expected 0 < LO <= HI")
    return lo, hi

def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value

def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags, shared with ``memserve simulate`` (same names, same meaning)."""
    wl = p.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    wl.add_argument("--dataset", help="ShareGPT JSONL, plain or .xz (default: $MEMSERVE_DATA, else the sample in the package)")
    wl.add_argument("--tokenizer", help="tokenizer.json or model folder for token lengths (default ~4 chars/token)")
    wl.add_argument("--num-sessions", type=_positive_int, help="sessions (multi-turn workloads; default 50, long-doc-qa 20)")
    wl.add_argument("--num-requests", type=_positive_int, help="requests (single-turn workloads; default 200)")
    wl.add_argument("--max-turns", type=_positive_int, help="use at most this many turns of each session")
    wl.add_argument("--max-session-tokens", type=_positive_int, help="sharegpt: skip conversations longer than this")
    wl.add_argument("--prefix-len", type=_positive_int, default=1024, help="shared-prefix: system prompt tokens")
    wl.add_argument("--num-prefixes", type=_positive_int, default=1, help="shared-prefix: distinct system prompts")
    wl.add_argument("--doc-len", type=_positive_int, default=2048, help="long-doc-qa: document tokens")
    wl.add_argument("--questions-per-doc", type=_positive_int, default=4, help="long-doc-qa: questions (turns) per document")
    wl.add_argument("--input-len", type=_length, default=LengthDist("fixed", 128),
                    help="random/shared-prefix prompt tokens: N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN")
    wl.add_argument("--output-len", type=_length, default=LengthDist("fixed", 128),
                    help="synthetic workloads' target output tokens (used with --fixed-output-len)")
    wl.add_argument("--share-ratio", type=_positive_int, default=1,
                    help="replay every session this many times as distinct sessions (MemServe Fig. 15)")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME",
                    help="LoRA adapters to request (vLLM bench's flag): each conversation names one, spread "
                         "evenly, for all its turns")

def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """How the workload is offered, shared with ``memserve simulate``."""
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=_rate, help="session starts per second, Poisson (default inf: all at once)")
    load.add_argument("--request-rate", type=_rate, help="request starts per second for single-turn workloads")
    load.add_argument("--sweep-rate", type=_rates, help="comma-separated rates to run one after another")
    load.add_argument("--concurrency", type=_positive_int, help="cap on requests in flight")
    load.add_argument("--duration", type=positive_float, help="stop sending new requests after this many seconds")
    load.add_argument("--warmup", type=int, default=0,
                      help="unmeasured requests sent first (servers that compile or allocate on first use)")
    load.add_argument("--think-time", type=float, default=0.0, help="mean pause between turns, seconds")
    load.add_argument("--max-tokens", type=_positive_int,
                      help="output cap (natural mode default 256; caps recorded lengths with --fixed-output-len)")
    load.add_argument("--fixed-output-len", action="store_true",
                      help="ask for exactly the recorded answer's length (max_tokens + ignore_eos) and replay "
                           "recorded answers as history")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    load.add_argument("--slo-ttft-ms", type=float, help="per-request TTFT SLO (sent and scored)")
    load.add_argument("--slo-tbt-ms", type=float, help="per-request TBT SLO (sent and scored)")
    load.add_argument("--slo-scale", type=_scale_range, metavar="LO:HI",
                      help="scale each request's SLOs by a factor drawn uniformly from [LO, HI] "
                           "(CacheOpt §5 uses 0.5:2.5 of the baseline's mean latencies)")

def add_output_arguments(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--output", "-o", help="write results JSON here")
    out.add_argument("--plot", metavar="DIR", help="write PNG plots here")
    out.add_argument("--label", help="name of this run in tables and plots (default: the model)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

def fail(message: str, code: int) -> int:
    Console(stderr=True).print(f"[bold red]memserve bench: error:[/] {message}", highlight=False, soft_wrap=True)
    return code

def workload_spec(args: argparse.Namespace, parts: int) -> WorkloadSpec:
    if args.num_sessions is not None and args.num_requests is not None:
        raise ValueError("give --num-sessions or --num-requests, not both")
    count = args.num_sessions if args.num_sessions is not None else args.num_requests
    return WorkloadSpec(
        name=args.workload,
        num_sessions=count if count is not None else DEFAULT_COUNTS[args.workload],
        seed=args.seed,
        max_turns=args.max_turns,
        max_session_tokens=args.max_session_tokens,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        doc_len=args.doc_len,
        questions_per_doc=args.questions_per_doc,
        input_len=args.input_len,
        output_len=args.output_len,
        parts=parts,
        share_ratio=args.share_ratio,
    )

def replay_options(args: argparse.Namespace, rate: float) -> ReplayOptions:
    """The load flags as replay options (shared with ``memserve simulate``)."""
    return ReplayOptions(
        rate=rate,
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        fixed_output_len=args.fixed_output_len,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tbt_ms=args.slo_tbt_ms,
        slo_scale=args.slo_scale,
        think_time_s=args.think_time,
        seed=args.seed,
        lora_modules=tuple(args.lora_modules),
    )

def build_sessions(args: argparse.Namespace, parts: int) -> tuple[WorkloadSpec, list[list[Session]], str]:
    """The workload flags as sessions: (spec, one list of sessions per part, dataset path)."""
    spec = workload_spec(args, parts)
    dataset = Path(args.dataset) if args.dataset else default_sharegpt_path()
    conversations = load_conversations(dataset)
    return spec, build_workload(spec, conversations, TextCorpus(conversations, make_token_counter(args.tokenizer))), \
        str(dataset)

def run_config(args: argparse.Namespace, model: str, spec: WorkloadSpec, dataset: str) -> dict:
    """The run's settings as JSON-safe values (infinite rates as the string "inf")."""
    skip = {"func", "bench_command", "api_key", "input_len", "output_len", "rate", "request_rate", "sweep_rate"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    rate = args.rate or args.request_rate
    config.update(
        model=model,
        dataset=dataset,
        num_sessions=spec.num_sessions,
        input_len=asdict(spec.input_len),
        output_len=asdict(spec.output_len),
        rate="inf" if rate is None or math.isinf(rate) else rate,
        sweep_rate=args.sweep_rate,
        token_lengths="tokenizer" if args.tokenizer else "heuristic ~4 chars/token",
        multi_turn=args.workload in MULTI_TURN_WORKLOADS,
    )
    return config

def point_result(result: ReplayResult) -> dict:
    return {
        **compute_metrics(result.records, result.duration_s),
        "interrupted": result.interrupted,
        "aborted": result.aborted,
        "cancelled_requests": result.cancelled,
        "requests": [r.to_json() for r in result.records],
    }

def write_outputs(
    args: argparse.Namespace, config: dict, label: str, points: list[RunPoint], console: Console
) -> None:
    if not points:
        return
    if args.output:
        if args.sweep_rate:
            data = {"config": config, "label": label, "sweep": [{"rate": p.rate, **p.result} for p in points]}
        else:
            data = {"config": config, "label": label, **points[0].result}
        write_json(args.output, data)
        console.print(f"results written to {args.output}")
    if args.plot:
        from memserve.workload.plots import plot_all

        for path in plot_all(points, args.plot):
            console.print(f"plot written to {path}")
