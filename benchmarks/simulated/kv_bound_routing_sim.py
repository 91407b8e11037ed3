"""Cost against prompt-tree (and session) routing where the outcome turns on KV memory:
the real run's setting (``global_scheduler_real.py``: 3 CPU workers, 512 KV blocks each,
long-doc-qa with 768-token documents) on the simulator, one run per seed. A cluster at
the edge of KV thrash either keeps its documents or starts evicting documents whose next
questions are queued, so one run's P99 TTFT swings 2x or more with the seed and cannot
rank two policies. Prints, per (session-start rate, share ratio) point, each policy's
P99 and mean TTFT averaged over the seeds, cost / prompt-tree, and in how many seeds
cost's P99 TTFT was at most prompt-tree's; writes ``summary.json``.

``--slowdown`` stretches the profile's compute (``CostModel.slowed``): the real run's
three one-thread workers share two cores, 1.5x slower than the one-worker profile.
``--workload sharegpt`` replays ShareGPT as the real run does (3 turns, sessions of at
most 1,500 tokens).

    python -m memserve.cli profile --quick --threads 1 --dtype float32 --output cpu-1t.json
    python benchmarks/simulated/kv_bound_routing_sim.py --out /tmp/kv-bound --cost-model cpu-1t.json --slowdown 1.5 \\
        --points 0.3:2,0.4:2,0.5:2,0.5:3 --seeds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from global_scheduler_sim import run_point

from memserve.costmodel.store import load_cost_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "real"))  # the real run's settings
from global_scheduler_real import SHAREGPT_MAX_SESSION_TOKENS, SHAREGPT_MAX_TURNS  # noqa: E402

POLICIES = ("session", "prompt-tree", "cost")
AVERAGED = ("ttft_p99_ms", "ttft_mean_ms", "cached_token_ratio")  # over the seeds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("kv-bound-routing-sim"))
    p.add_argument("--cost-model", required=True, help="a memserve profile JSON or a preset name")
    p.add_argument("--slowdown", type=float, default=1.0, help="compute slowdown of each worker against the profile")
    p.add_argument("--points", default="0.3:2,0.4:2,0.5:2,0.5:3", help="RATE:SHARE_RATIO, comma-separated")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--num-sessions", type=int, default=40, help="sessions before sharing")
    p.add_argument("--num-blocks", type=int, default=512, help="device KV blocks per instance")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="the instances' (0: no cap)")
    p.add_argument("--no-shared-prefill-hold", action="store_true", help="the instances' (memserve simulate's flag)")
    p.add_argument("--doc-len", type=int, default=768)
    p.add_argument("--questions-per-doc", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workload", choices=("long-doc-qa", "sharegpt"), default="long-doc-qa")
    p.add_argument("--sharegpt-max-turns", type=int, default=SHAREGPT_MAX_TURNS)
    p.add_argument("--sharegpt-max-session-tokens", type=int, default=SHAREGPT_MAX_SESSION_TOKENS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "cost-model.json"
    load_cost_model(args.cost_model).slowed(args.slowdown).save(model)
    policies = args.policies.split(",")
    summary: dict = {}
    for point in args.points.split(","):
        rate, share = point.split(":")
        runs: dict[str, list[dict]] = {policy: [] for policy in policies}
        for seed in range(args.seeds):
            point_args = argparse.Namespace(**{**vars(args), "cost_model": str(model), "rate": float(rate),
                                               "seed": seed})
            out = args.out / f"r{rate}-sr{share}-seed{seed}"
            out.mkdir(exist_ok=True)
            for policy in policies:
                runs[policy].append(run_point(out, point_args, args.workload, int(share), policy))
        row = summary[point] = {policy: {**{key: statistics.fmean(r[key] for r in rs) for key in AVERAGED},
                                         "p99_by_seed": [r["ttft_p99_ms"] for r in rs]}
                                for policy, rs in runs.items()}
        for policy, m in row.items():
            print(f"{rate} starts/s share {share}  {policy:11s}  P99 TTFT {m['ttft_p99_ms'] / 1000:6.1f} s  "
                  f"mean TTFT {m['ttft_mean_ms'] / 1000:5.1f} s  cached {m['cached_token_ratio']:.3f}  "
                  f"(mean of {args.seeds} seeds)", flush=True)
        if {"cost", "prompt-tree"} <= row.keys():
            cost, pt = row["cost"], row["prompt-tree"]
            wins = sum(c <= t for c, t in zip(cost["p99_by_seed"], pt["p99_by_seed"]))
            print(f"{rate} starts/s share {share}  cost / prompt-tree: "
                  f"P99 TTFT {cost['ttft_p99_ms'] / pt['ttft_p99_ms']:.2f}, "
                  f"mean TTFT {cost['ttft_mean_ms'] / pt['ttft_mean_ms']:.2f}; "
                  f"cost's P99 <= prompt-tree's in {wins} of {args.seeds} seeds", flush=True)
    (args.out / "summary.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                       "results": summary}, indent=1))
    print(f"wrote {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
