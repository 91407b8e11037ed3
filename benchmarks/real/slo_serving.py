"""CacheOpt §5 on real workers: SLO attainment and tail latency of scheduling policies.

For each policy of ``--policies`` (the first is the baseline, ``fcfs``), start
`memserve up --schedule-policy POLICY --admission off` (``POLICY+reject`` or
``POLICY+queue``: with that admission control, which needs ``--cost-model`` in
``--up-args``; a refused request counts as a miss of both SLOs) and replay ShareGPT requests
with `memserve bench` at each rate of ``--rates`` (Poisson arrivals, one turn per
conversation, recorded answer lengths). Then print, per policy and rate, P99 TTFT and
TBT and TTFT/TBT SLO attainment, the sustainable rate (the highest rate at which both
attainments stay >= ``--attainment``, interpolated linearly between the last rate that
held and the first that did not) and the ratios of every policy to the baseline.

SLOs as CacheOpt §5 sets them: each request's TTFT and TBT SLOs are the baseline's mean
TTFT and mean TBT (pooled over all rates) times one scale drawn uniformly from
``--slo-scale`` (0.5:2.5) per request. The means are only known after the baseline ran,
so the baseline runs without SLOs and its records are scored afterwards against the
SLOs the other policies are sent (same seed, same draws): fcfs and the gateway with
admission off never read a request's SLOs, so a second baseline run would measure the
same thing. Prompts need no chunking here (``--max-session-tokens`` stays below the
step budget), so CacheOpt's per-chunk TTFT scaling is not needed.

Full size (long: run it on a quiet machine)::

    python benchmarks/real/slo_serving.py --policies fcfs,cacheopt --rates 0.25,0.5,1,2 \\
        --num-requests 120 --out /tmp/slo-serving

Smoke: ``--policies fcfs --rates 1,4 --num-requests 6 --max-tokens 16``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memserve.bench.server_process import serving
from memserve.workload.metrics import compute_metrics
from memserve.workload.records import RequestRecord
from memserve.workload.replay import ReplayOptions


@contextmanager
def serving_policy(args: argparse.Namespace, policy: str, log: Path) -> Iterator[str]:
    """`memserve up` with ``policy`` (``POLICY+MODE``: behind admission control in that
    mode; otherwise admission is off), healthy; yields its URL and stops it afterwards."""
    schedule, _, admission = policy.partition("+")
    flags = ["--cpu-workers", str(args.cpu_workers), "--num-blocks", str(args.num_blocks),
             "--max-num-seqs", str(args.max_num_seqs), "--schedule-policy", schedule,
             "--admission", admission or "off", *shlex.split(args.up_args)]
    with serving(flags, log, threads=None, timeout_s=600) as server:
        yield server.base_url


def slo_options(args: argparse.Namespace, mean_ttft_ms: float, mean_tbt_ms: float) -> ReplayOptions:
    """The SLO part of the replay options every policy's requests are sent (and scored) with."""
    return ReplayOptions(slo_ttft_ms=mean_ttft_ms, slo_tbt_ms=mean_tbt_ms, slo_scale=args.slo_scale, seed=args.seed)


def bench(args: argparse.Namespace, url: str, out: Path, slos: ReplayOptions | None) -> dict:
    """One `memserve bench` sweep over ``args.rates``; its results file, parsed."""
    cmd = [sys.executable, "-m", "memserve.cli", "bench", "--base-url", url, "--workload", "sharegpt",
           "--num-sessions", str(args.num_requests), "--max-turns", "1",
           "--max-session-tokens", str(args.max_session_tokens), "--fixed-output-len",
           "--max-tokens", str(args.max_tokens), "--sweep-rate", ",".join(f"{r:g}" for r in args.rates),
           "--seed", str(args.seed), "--warmup", "2", "--no-progress", "--output", str(out)]
    if args.dataset:
        cmd += ["--dataset", args.dataset]
    if slos is not None:
        lo, hi = slos.slo_scale or (1.0, 1.0)
        cmd += ["--slo-ttft-ms", f"{slos.slo_ttft_ms:.3f}", "--slo-tbt-ms", f"{slos.slo_tbt_ms:.3f}",
                "--slo-scale", f"{lo:g}:{hi:g}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if args.quiet else None)
    return json.loads(out.read_text())


def pooled_mean(sweep: list[dict], metric: str) -> float:
    """The mean of ``metric`` (ttft_ms, tbt_ms) over all the sweep's samples."""
    total = sum(p[metric]["mean"] * p[metric]["count"] for p in sweep if p[metric]["count"])
    count = sum(p[metric]["count"] for p in sweep)
    if not count:
        raise RuntimeError(f"the baseline run measured no {metric}: did every request fail?")
    return total / count


def scored(sweep: list[dict], slos: ReplayOptions) -> list[dict]:
    """A sweep run without SLOs, its metrics recomputed as if each request had carried the
    SLOs ``slos`` gives it."""
    points = []
    for point in sweep:
        records = [RequestRecord.from_json(r) for r in point["requests"]]
        for r in records:
            r.slo_ttft_ms, r.slo_tbt_ms = slos.slos(r.session_id, r.turn)
        points.append({"rate": point["rate"], **compute_metrics(records, point["duration_s"])})
    return points


def attainment(point: dict) -> float:
    """Both SLOs' attainment: the lower of the TTFT and TBT ones."""
    a = point["slo_attainment"]
    return min(a["ttft"], a["tbt"])


def sustainable_rate(points: list[dict], threshold: float) -> float | None:
    """The highest rate whose attainment stays >= ``threshold``, going up the rates,
    interpolated linearly to where it crosses; None if even the lowest rate falls short."""
    points = sorted(points, key=lambda p: p["rate"])
    last: dict | None = None
    for point in points:
        if attainment(point) < threshold:
            if last is None:
                return None
            a0, a1 = attainment(last), attainment(point)
            return last["rate"] + (point["rate"] - last["rate"]) * (a0 - threshold) / (a0 - a1)
        last = point
    return points[-1]["rate"] if points else None


def rows(policy: str, points: list[dict]) -> list[dict]:
    return [{"policy": policy, "rate": p["rate"], "p99_ttft_ms": p["ttft_ms"]["p99"], "p99_tbt_ms": p["tbt_ms"]["p99"],
             "ttft_attainment": p["slo_attainment"]["ttft"], "tbt_attainment": p["slo_attainment"]["tbt"],
             "ok": p["num_requests"]["ok"], "failed": p["num_requests"]["failed"]} for p in points]


def ratios(base: list[dict], other: list[dict]) -> list[dict]:
    """Per rate: how many times lower the other policy's P99s are (baseline / other) and
    its attainment minus the baseline's."""
    out = []
    for b, o in zip(base, other):
        out.append({"rate": b["rate"],
                    "p99_ttft_lower_x": _div(b["p99_ttft_ms"], o["p99_ttft_ms"]),
                    "p99_tbt_lower_x": _div(b["p99_tbt_ms"], o["p99_tbt_ms"]),
                    "ttft_attainment_gain": o["ttft_attainment"] - b["ttft_attainment"],
                    "tbt_attainment_gain": o["tbt_attainment"] - b["tbt_attainment"]})
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(summary: dict) -> None:
    print(f"\nSLO base: mean TTFT {summary['slo_base_ms']['ttft']:.0f} ms, mean TBT "
          f"{summary['slo_base_ms']['tbt']:.0f} ms (baseline {summary['baseline']}), scale {summary['slo_scale']}")
    print(f"{'policy':<16} {'rate/s':>7} {'P99 TTFT ms':>12} {'P99 TBT ms':>11} {'TTFT att':>9} {'TBT att':>8} "
          f"{'ok':>4} {'failed':>6}")
    for policy, table in summary["policies"].items():
        for r in table["rows"]:
            print(f"{policy:<16} {r['rate']:>7g} {_fmt(r['p99_ttft_ms']):>12} {_fmt(r['p99_tbt_ms']):>11} "
                  f"{_fmt(r['ttft_attainment'], 3):>9} {_fmt(r['tbt_attainment'], 3):>8} {r['ok']:>4} {r['failed']:>6}")
        print(f"{policy:<16} sustainable rate at attainment >= {summary['attainment_threshold']}: "
              f"{_fmt(table['sustainable_rate'], 2)}/s")
    for policy, per_rate in summary["vs_baseline"].items():
        print(f"\n{policy} vs {summary['baseline']} (P99 x lower, attainment gain):")
        for r in per_rate["per_rate"]:
            print(f"  rate {r['rate']:g}/s: TTFT {_fmt(r['p99_ttft_lower_x'], 2)}x, TBT {_fmt(r['p99_tbt_lower_x'], 2)}x, "
                  f"TTFT att {r['ttft_attainment_gain']:+.3f}, TBT att {r['tbt_attainment_gain']:+.3f}")
        print(f"  sustainable rate: {_fmt(per_rate['sustainable_rate_x'], 2)}x")
    if summary["vs_baseline"]:  # one line for scripts/gpu_check's table: the highest rate
        print("summary: " + "; ".join(
            f"{policy} vs {summary['baseline']} at {r['rate']:g}/s: TBT att {r['tbt_attainment_gain']:+.3f}, "
            f"TTFT att {r['ttft_attainment_gain']:+.3f}"
            for policy, per_rate in summary["vs_baseline"].items() for r in per_rate["per_rate"][-1:]))


def summarize(args: argparse.Namespace, slos: ReplayOptions, sweeps: dict[str, list[dict]]) -> dict:
    baseline = args.policies[0]
    policies = {p: {"rows": rows(p, points), "sustainable_rate": sustainable_rate(points, args.attainment)}
                for p, points in sweeps.items()}
    base = policies[baseline]
    vs = {p: {"per_rate": ratios(base["rows"], t["rows"]),
              "sustainable_rate_x": _div(t["sustainable_rate"], base["sustainable_rate"])}
          for p, t in policies.items() if p != baseline}
    return {"baseline": baseline, "slo_base_ms": {"ttft": slos.slo_ttft_ms, "tbt": slos.slo_tbt_ms},
            "slo_scale": list(args.slo_scale), "attainment_threshold": args.attainment, "rates": args.rates,
            "num_requests": args.num_requests, "policies": policies, "vs_baseline": vs}


def _rates(text: str) -> list[float]:
    rates = sorted(float(r) for r in text.split(","))
    if not rates or not all(0 < r < math.inf for r in rates):
        raise argparse.ArgumentTypeError("positive finite rates, e.g. 0.5,1,2")
    return rates


def _scale(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(":"))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", type=lambda s: s.split(","), default=["fcfs", "cacheopt"],
                   help="schedule policies, the baseline first (it must not read SLOs: fcfs); POLICY+reject "
                        "or POLICY+queue runs it behind that admission control")
    p.add_argument("--rates", type=_rates, default=[0.25, 0.5, 1.0, 2.0], help="request rates (Poisson, /s)")
    p.add_argument("--num-requests", type=int, default=120, help="ShareGPT requests per rate")
    p.add_argument("--max-tokens", type=int, default=256, help="cap on the recorded answer lengths")
    p.add_argument("--max-session-tokens", type=int, default=1500, help="skip longer conversations")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker (small: KV pressure)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--cpu-workers", type=int, default=1)
    p.add_argument("--slo-scale", type=_scale, default=(0.5, 2.5), metavar="LO:HI")
    p.add_argument("--attainment", type=float, default=0.9, help="attainment a sustainable rate keeps")
    p.add_argument("--dataset", help="ShareGPT JSONL (default: memserve bench's)")
    p.add_argument("--up-args", default="", help="more `memserve up` flags for every policy, e.g. "
                   "'--cost-model cpu.json' (one string)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/slo-serving"))
    p.add_argument("--quiet", action="store_true", help="no per-run tables from memserve bench")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    baseline = args.policies[0]
    with serving_policy(args, baseline, args.out / f"up-{baseline}.log") as url:
        base_run = bench(args, url, args.out / f"{baseline}.json", None)
    slos = slo_options(args, pooled_mean(base_run["sweep"], "ttft_ms"), pooled_mean(base_run["sweep"], "tbt_ms"))
    sweeps = {baseline: scored(base_run["sweep"], slos)}
    for policy in args.policies[1:]:
        with serving_policy(args, policy, args.out / f"up-{policy}.log") as url:
            sweeps[policy] = bench(args, url, args.out / f"{policy}.json", slos)["sweep"]
    summary = summarize(args, slos, sweeps)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    report(summary)
    print(f"\nresults in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
