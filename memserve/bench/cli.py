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
import math
import os
import signal
import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from memserve.bench.client import (
    DIALECTS,
    ENDPOINTS,
    BenchError,
    ModelListUnavailable,
    OpenAIClient,
    RequestSpec,
)
from memserve.bench.runner import Replayer
from memserve.workload.options import (
    add_load_arguments,
    add_output_arguments,
    add_workload_arguments,
    build_sessions,
    fail,
    json_object,
    point_result,
    positive_float,
    replay_options,
    run_config,
    write_outputs,
)
from memserve.workload.records import RequestRecord
from memserve.workload.replay import ReplayResult
from memserve.workload.report import RunPoint, compare_table, load_points, print_run
from memserve.workload.workloads import (
    Session,
    WorkloadSpec,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


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
    server.add_argument("--extra-body", type=json_object, default={},
                        help="JSON object merged into every request body")
    server.add_argument("--request-timeout", type=positive_float, default=600.0, help="seconds per request (default 600)")

    add_workload_arguments(p)
    add_load_arguments(p)
    add_output_arguments(p)

    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    cmp_ = sub.add_parser("compare", help="print results files side by side with ratios vs the first")
    cmp_.add_argument("results", nargs="+", help="results JSON files (single runs or sweeps)")
    cmp_.add_argument("--plot", metavar="DIR", help="draw all runs on shared axes into DIR")
    cmp_.set_defaults(func=run_compare_command)


def _rates_to_run(args: argparse.Namespace) -> list[float]:
    if args.sweep_rate and (args.rate or args.request_rate):
        raise ValueError("--sweep-rate replaces --rate/--request-rate")
    if args.rate and args.request_rate:
        raise ValueError("give --rate or --request-rate, not both")
    return args.sweep_rate or [args.rate or args.request_rate or math.inf]


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
        lora_modules=args.lora_modules,
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
        from memserve.workload.plots import plot_all

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
