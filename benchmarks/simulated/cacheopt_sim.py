"""CacheOpt Figs. 12 and 14 on the simulator: fcfs vs cacheopt vs cacheopt without each
component (/CKA /RSA /PA /GR /PP /PSS) at several arrival rates, on a CacheOpt-like
setup (OPT-13B on one A100, ``opt-13b-a100``; ShareGPT, one turn per request, the
recorded answer lengths; a host tier for swapping). The gateway's output-length
predictor is played by the simulator's noisy oracle (``--predict-error``), padded by
CacheOpt's confidence-based padding (/CKA: a fixed 10%).

SLOs as CacheOpt §5 sets them: fcfs first runs every rate without SLOs; its mean TTFT
and mean TBT over those runs, times a per-request scale uniform in [0.5, 2.5], are each
request's SLOs in every later run. Prints P99 TTFT/TBT, SLO attainment and preemptions
per point, writes one ``memserve simulate`` results file per point, ``summary.json``
and a plot (Fig. 12's four panels; ablations dashed). ``--sustain-rates`` runs fcfs and
cacheopt at more rates under the same SLOs and reports the highest rate each sustains
(TTFT attainment at least ``--sustain-attainment`` there and at every lower rate swept).
``--admission reject`` (or ``queue``) adds fcfs and cacheopt behind the gateway's
admission control (``fcfs+reject``, ``cacheopt+reject``); a refused request counts as a
miss of both its SLOs, and its P99s are the admitted requests'.

    python benchmarks/simulated/cacheopt_sim.py --out /tmp/cacheopt-sim --sustain-rates 2.5,2.75,3,3.25,3.5 --admission reject
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

from memserve.cli import main as memserve
from memserve.costmodel.store import load_cost_model
from memserve.workload.metrics import tbt_attainment_ceiling

SLO_SCALE = (0.5, 2.5)  # CacheOpt §5: each request's SLOs are the base times a scale uniform in this range
ABLATIONS = ("CKA", "RSA", "PA", "GR", "PP", "PSS")
METRICS = (("ttft_p99_ms", "P99 TTFT (ms)"), ("tbt_p99_ms", "P99 TBT (ms)"), ("ttft_attainment", "TTFT SLO attainment"),
           ("tbt_attainment", "TBT SLO attainment"))


def variants(options: str = "", admission: str = "off") -> dict[str, list[str]]:
    """Label -> the simulate flags of that variant (``options``: cacheopt's, for every
    cacheopt variant, before the ablation's ``disable``). Admission control is off but
    for ``fcfs+MODE`` and ``cacheopt+MODE`` when ``admission`` names a mode."""
    out = {"fcfs": ["--schedule-policy", "fcfs"],
           "cacheopt": ["--schedule-policy", "cacheopt", "--schedule-policy-options", options]}
    for name in ABLATIONS:
        flags = ["--schedule-policy", "cacheopt"]
        flags += (["--padding", "fixed", "--schedule-policy-options", options] if name == "CKA"
                  else ["--schedule-policy-options", f"{options} disable={name}".strip()])
        out[f"/{name}"] = flags
    gated = {f"{name}+{admission}": [*out[name], "--admission", admission]
             for name in ("fcfs", "cacheopt")} if admission != "off" else {}
    return {name: [*flags, "--admission", "off"] for name, flags in out.items()} | gated


def run_point(path: Path, args: argparse.Namespace, rate: float, flags: list[str], slo: tuple[float, float] | None) -> dict:
    argv = ["simulate", "--cost-model", args.cost_model, "--workload", "sharegpt", "--max-turns", "1",
            "--fixed-output-len", "--num-requests", str(args.num_requests), "--rate", str(rate),
            "--num-blocks", str(args.num_blocks), "--num-host-blocks", str(args.num_host_blocks),
            "--max-num-seqs", str(args.max_num_seqs), "--predict-error", str(args.predict_error),
            "--seed", str(args.seed), "--no-progress", "--output", str(path), *flags]
    if slo is not None:
        argv += ["--slo-ttft-ms", f"{slo[0]:.3f}", "--slo-tbt-ms", f"{slo[1]:.3f}",
                 "--slo-scale", "{}:{}".format(*SLO_SCALE)]
    with contextlib.redirect_stdout(io.StringIO()):
        if memserve(argv) != 0:
            raise RuntimeError(f"memserve {' '.join(argv)} failed")
    r = json.loads(path.read_text())
    att = r["slo_attainment"]
    return {"ttft_p99_ms": r["ttft_ms"]["p99"], "tbt_p99_ms": r["tbt_ms"]["p99"], "ttft_mean_ms": r["ttft_ms"]["mean"],
            "tbt_mean_ms": r["tbt_ms"]["mean"], "ttft_attainment": att["ttft"], "tbt_attainment": att["tbt"],
            "preemptions": r["simulation"]["preemptions"], "requests": r["num_requests"]["ok"],
            "rejected": r["num_requests"]["failed"]}


def plot(rates: list[float], results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
    for ax, (key, label) in zip(axes, METRICS):
        for name in results[str(rates[0])]:
            style = "--" if name.startswith("/") else "-"
            ax.plot(rates, [results[str(r)][name][key] for r in rates], style, marker="o", label=name,
                    linewidth=2.5 if name == "cacheopt" else 1.2)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(label)
        if "P99" in label:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sustained(points: dict[float, dict], target: float) -> float | None:
    """The highest rate whose TTFT attainment, and every lower rate's, is >= ``target``."""
    best = None
    for rate in sorted(points):
        if points[rate]["ttft_attainment"] < target:
            break
        best = rate
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("cacheopt-sim"))
    p.add_argument("--cost-model", default="opt-13b-a100")
    p.add_argument("--rates", default="1,2,3,4", help="requests per second")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--num-blocks", type=int, default=1000, help="device KV blocks (16 tokens each)")
    p.add_argument("--num-host-blocks", type=int, default=4000)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--predict-error", type=float, default=0.3, help="log-std of the simulated predictor's error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=None, help="comma-separated subset of labels (default: all)")
    p.add_argument("--sustain-rates", default="", help="more rates for fcfs and cacheopt only, with and without "
                                                       "--admission (same SLOs)")
    p.add_argument("--sustain-attainment", type=float, default=0.9)
    p.add_argument("--cacheopt-options", default="", help="--schedule-policy-options of every cacheopt variant")
    p.add_argument("--admission", default="off", choices=("off", "reject", "queue"),
                   help="also run fcfs and cacheopt behind the gateway's admission control in this mode "
                        "(refused requests count as SLO misses)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    table = variants(args.cacheopt_options, args.admission)
    base = [run_point(args.out / f"base-{r}.json", args, r, table["fcfs"], None) for r in rates]
    slo = (sum(b["ttft_mean_ms"] for b in base) / len(base), sum(b["tbt_mean_ms"] for b in base) / len(base))
    print(f"SLO base (fcfs means over the rates): TTFT {slo[0]:.1f} ms, TBT {slo[1]:.1f} ms; scale U{list(SLO_SCALE)}")
    step_floor_ms = load_cost_model(args.cost_model).decode_step_s(1, 0) * 1000
    ceiling = tbt_attainment_ceiling(slo[1], SLO_SCALE, step_floor_ms)
    print(f"TBT attainment ceiling: a one-sequence decode step takes {step_floor_ms:.1f} ms, so the requests whose "
          f"TBT SLO is below it miss it under any policy; at most {ceiling:.3f} can meet theirs")
    print(f"{'rate':>5s} {'variant':15s} {'P99 TTFT ms':>12s} {'P99 TBT ms':>11s} {'TTFT att':>9s} {'TBT att':>8s} "
          f"{'preempt recompute/swap':>23s} {'429':>4s}")
    gated = [f"{name}+{args.admission}" for name in ("fcfs", "cacheopt")] if args.admission != "off" else []
    headline = ["cacheopt", *gated[1:]]
    results: dict = {}
    for r in rates:
        row = results.setdefault(str(r), {})
        for name, flags in table.items():
            if args.variants and name not in args.variants.split(","):
                continue
            m = row[name] = run_point(args.out / f"{name.strip('/')}-{r}.json", args, r, flags, slo)
            pre = m["preemptions"]
            print(f"{r:5.2f} {name:15s} {m['ttft_p99_ms']:12.0f} {m['tbt_p99_ms']:11.1f} {m['ttft_attainment']:9.3f} "
                  f"{m['tbt_attainment']:8.3f} {pre['recompute']:>15d}/{pre['swap']:<7d} {m['rejected']:4d}",
                  flush=True)
        fc = row["fcfs"]
        for name in headline:
            co = row[name]
            print(f"{r:5.2f} {name}/fcfs: P99 TTFT x{co['ttft_p99_ms'] / fc['ttft_p99_ms']:.2f}, "
                  f"P99 TBT x{co['tbt_p99_ms'] / fc['tbt_p99_ms']:.2f}")
    sustain: dict = {}
    if args.sustain_rates:
        for name in ("fcfs", "cacheopt", *gated):
            points = {r: results[str(r)][name] for r in rates if name in results[str(r)]}
            for r in (float(x) for x in args.sustain_rates.split(",")):
                if r not in points:
                    points[r] = run_point(args.out / f"sustain-{name}-{r}.json", args, r, table[name], slo)
            sustain[name] = {"rate": sustained(points, args.sustain_attainment),
                             "points": {str(r): points[r] for r in sorted(points)}}
            print(f"{name}: TTFT / TBT attainment by rate " + ", ".join(
                f"{r:g}: {points[r]['ttft_attainment']:.3f} / {points[r]['tbt_attainment']:.3f}" for r in sorted(points))
                + f"; sustains {sustain[name]['rate']} req/s at >= {args.sustain_attainment}", flush=True)
    (args.out / "summary.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                       "slo_base_ms": slo, "tbt_attainment_ceiling": ceiling,
                                                       "results": results,
                                                       "sustained": sustain}, indent=1))
    plot(rates, results, args.out / "cacheopt_sim.png")
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'cacheopt_sim.png'}")


if __name__ == "__main__":
    main()
