"""``memserve bench``: replay a workload against an OpenAI-compatible server and report
what users feel; ``memserve bench compare``: put results files side by side.

Exit codes: 0 done; 1 no request succeeded (or the run aborted on server errors);
2 bad options, unreadable data or an unreachable server; 130 interrupted by Ctrl-C
(what was measured is still written).

Also runnable as ``python -m memserve.bench.cli ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memserve.bench.client import (
    DIALECTS,
    ENDPOINTS,
    BenchError,
    ModelListUnavailable,
    OpenAIClient,
    RequestSpec,
)
from memserve.bench.dataset import TextCorpus, default_sharegpt_path, load_conversations
from memserve.bench.metrics import compute_metrics
from memserve.bench.records import RequestRecord
from memserve.bench.report import RunPoint, compare_table, load_points, print_run, write_json
from memserve.bench.runner import Replayer, ReplayOptions, ReplayResult
from memserve.bench.tokens import make_token_counter
from memserve.bench.workloads import (
    MULTI_TURN_WORKLOADS,
    WORKLOADS,
    LengthDist,
    Session,
    WorkloadSpec,
    build_workload,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_COUNTS = {"sharegpt": 50, "long-doc-qa": 20, "shared-prefix": 200, "random": 200}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _positive_float(text: str) -> float:
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


def _json_object(text: str) -> dict:
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


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` (with its ``compare`` subcommand) to a CLI's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="replay a workload against an OpenAI-compatible server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=run_bench_command)
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, with or without /v1")
    server.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    server.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                        help="chat: /v1/chat/completions; completions: /v1/completions with a plain transcript")
    server.add_argument("--dialect", choices=DIALECTS, default="memserve",
                        help="extension fields to send: memserve (also vLLM/SGLang), openai (none), "
                             "transformers (transformers serve)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (env OPENAI_API_KEY)")
    server.add_argument("--extra-body", type=_json_object, default={},
                        help="JSON object merged into every request body")
    server.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds per request (default 600)")

    add_workload_arguments(p)
    add_load_arguments(p)
    add_output_arguments(p)

    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    cmp_ = sub.add_parser("compare", help="print results files side by side with ratios vs the first")
    cmp_.add_argument("results", nargs="+", help="results JSON files (single runs or sweeps)")
    cmp_.add_argument("--plot", metavar="DIR", help="draw all runs on shared axes into DIR")
    cmp_.set_defaults(func=run_compare_command)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags, shared with ``memserve simulate`` (same names, same meaning)."""
    wl = p.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    wl.add_argument("--dataset", help="ShareGPT JSONL (default ../shared/data/sharegpt-sample.jsonl or $MEMSERVE_DATA)")
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


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """How the workload is offered, shared with ``memserve simulate``."""
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=_rate, help="session starts per second, Poisson (default inf: all at once)")
    load.add_argument("--request-rate", type=_rate, help="request starts per second for single-turn workloads")
    load.add_argument("--sweep-rate", type=_rates, help="comma-separated rates to run one after another")
    load.add_argument("--concurrency", type=_positive_int, help="cap on requests in flight")
    load.add_argument("--duration", type=_positive_float, help="stop sending new requests after this many seconds")
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
    )


def build_sessions(args: argparse.Namespace, parts: int) -> tuple[WorkloadSpec, list[list[Session]], str]:
    """The workload flags as sessions: (spec, one list of sessions per part, dataset path)."""
    spec = workload_spec(args, parts)
    dataset = Path(args.dataset) if args.dataset else default_sharegpt_path()
    conversations = load_conversations(dataset)
    return spec, build_workload(spec, conversations, TextCorpus(conversations, make_token_counter(args.tokenizer))), \
        str(dataset)


def _rates_to_run(args: argparse.Namespace) -> list[float]:
    if args.sweep_rate and (args.rate or args.request_rate):
        raise ValueError("--sweep-rate replaces --rate/--request-rate")
    if args.rate and args.request_rate:
        raise ValueError("give --rate or --request-rate, not both")
    return args.sweep_rate or [args.rate or args.request_rate or math.inf]


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


def run_bench_command(args: argparse.Namespace) -> int:
    """Ctrl-C during a replay stops it and writes the results; before or after one, it
    just ends the command."""
    try:
        return _run_bench_command(args)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_INTERRUPTED)


def _run_bench_command(args: argparse.Namespace) -> int:
    try:
        rates = _rates_to_run(args)
        spec, parts, dataset = build_sessions(args, len(rates))
    except (ValueError, FileNotFoundError, OSError) as e:
        return fail(str(e), EXIT_USAGE)
    return asyncio.run(_bench(args, rates, spec, parts, dataset))


class _Interrupts:
    """Ctrl-C (SIGINT) halts the replay in progress and ends the sweep; what finished is
    still reported and written."""

    def __init__(self) -> None:
        self.requested = False
        self.replayer: Replayer | None = None

    def __call__(self) -> None:
        self.requested = True
        if self.replayer is not None:
            self.replayer.halt()

    def install(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:  # only possible from the main thread
            loop.add_signal_handler(signal.SIGINT, self)
            return True
        except (ValueError, RuntimeError, NotImplementedError):
            return False


async def _bench(
    args: argparse.Namespace, rates: list[float], spec: WorkloadSpec, parts: list[list[Session]], dataset: str
) -> int:
    loop = asyncio.get_running_loop()
    interrupts = _Interrupts()
    installed = interrupts.install(loop)
    try:
        return await _bench_with(args, rates, spec, parts, dataset, interrupts)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def _bench_with(
    args: argparse.Namespace,
    rates: list[float],
    spec: WorkloadSpec,
    parts: list[list[Session]],
    dataset: str,
    interrupts: _Interrupts,
) -> int:
    console = Console(soft_wrap=True)
    err_console = Console(stderr=True, soft_wrap=True, highlight=False)
    client = OpenAIClient(
        base_url=args.base_url,
        model=args.model or "",
        endpoint=args.endpoint,
        dialect=args.dialect,
        temperature=args.temperature,
        api_key=args.api_key,
        timeout_s=args.request_timeout,
        extra_body=args.extra_body,
    )
    async with client:
        try:
            models = await client.list_models()
        except ModelListUnavailable as e:
            if not args.model:
                return fail(f"{e}; pass --model", EXIT_USAGE)
            err_console.print(f"note: {e}; going on with --model {args.model}", highlight=False)
            models = [args.model]
        except BenchError as e:
            return fail(str(e), EXIT_USAGE)
        if not args.model:
            if not models:
                return fail(f"{client.base_url}/v1/models lists no model; pass --model", EXIT_USAGE)
            client.model = models[0]
        elif args.model not in models:
            listed = ", ".join(models) or "empty"
            err_console.print(f"note: {args.model!r} is not in /v1/models ({listed}); trying it anyway",
                              highlight=False)
        failure = await _warm_up(client, args.warmup)
        if failure is not None:
            return fail(f"warm-up request failed with {failure.status}: {failure.error}", EXIT_FAILED)
        label = args.label or client.model
        config = run_config(args, client.model, spec, dataset)
        points: list[RunPoint] = []
        outcome = EXIT_OK
        for rate, sessions in zip(rates, parts):
            if interrupts.requested:
                break
            result = await _replay(client, args, rate, sessions, err_console, interrupts)
            points.append(RunPoint(label, rate if args.sweep_rate else None, point_result(result)))
            print_run(console, points[-1])
            if result.aborted:
                outcome = fail(result.aborted, EXIT_FAILED)
                break
            if not any(r.ok for r in result.records) and not interrupts.requested:
                outcome = fail(_all_failed_message(result.records), EXIT_FAILED)
                break
            errors = points[-1].result["errors"]
            if errors["count"]:
                by_status = ", ".join(f"{k}: {v}" for k, v in errors["by_status"].items())
                err_console.print(f"warning: {errors['count']} requests failed ({by_status})", highlight=False)
    if interrupts.requested and outcome == EXIT_OK:
        err_console.print("interrupted" + (": writing what was measured" if points else ""))
        outcome = EXIT_INTERRUPTED
    write_outputs(args, config, label, points, console)
    return outcome


async def _warm_up(client: OpenAIClient, count: int) -> RequestRecord | None:
    """Send ``count`` short requests one by one, outside the measurement; the first
    failure, if any."""
    for i in range(count):
        spec = RequestSpec(session_id=f"warmup-{i}", turn=0,
                           messages=[{"role": "user", "content": f"Warm-up {i}: say hello."}], max_tokens=8)
        record = await client.send(spec)
        if not record.ok:
            return record
    return None


def _all_failed_message(records: list[RequestRecord]) -> str:
    if not records:
        return "no request finished"
    first = records[0]
    return f"all {len(records)} requests failed; first: {first.status}: {first.error}"


async def _replay(
    client: OpenAIClient,
    args: argparse.Namespace,
    rate: float,
    sessions: list[Session],
    console: Console,
    interrupts: _Interrupts,
) -> ReplayResult:
    options = replay_options(args, rate)
    total = sum(len(s.turns) for s in sessions)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console,
        disable=args.no_progress,
        transient=True,
    )
    task = progress.add_task(f"rate {rate:g}/s", total=total, failed=0)
    failed = 0

    def done(record: RequestRecord) -> None:
        nonlocal failed
        failed += not record.ok
        progress.update(task, advance=1, failed=failed)

    replayer = Replayer(client, options, on_request_done=done)
    interrupts.replayer = replayer
    client.t0 = time.perf_counter()
    try:
        with progress:
            return await replayer.run(sessions)
    finally:
        interrupts.replayer = None


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
        from memserve.bench.plots import plot_all

        for path in plot_all(points, args.plot):
            console.print(f"plot written to {path}")


def run_compare_command(args: argparse.Namespace) -> int:
    try:
        points = [p for path in args.results for p in load_points(path)]
    except (OSError, ValueError, KeyError) as e:
        return fail(f"cannot read results: {e}", EXIT_USAGE)
    if not points:
        return fail("the results files hold no runs", EXIT_USAGE)
    console = Console(soft_wrap=True)
    console.print(compare_table(points))
    if args.plot:
        from memserve.bench.plots import plot_all

        for path in plot_all(points, args.plot):
            console.print(f"plot written to {path}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
