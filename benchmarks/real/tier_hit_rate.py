"""Hit rate and TTFT of the tiered KV store by eviction policy and by tiers
(AttentionStore Figs. 21, 23, 24 shape), on a ShareGPT multi-turn replay with more
conversations than the device pool holds; one run, ratios within it.

Configurations, at equal capacity per comparison:
  policies: lru, fifo, scheduler-aware, each with device + host + disk tiers;
  tiers:    device only, device + host, device + host + disk (scheduler-aware).

Every session's first turn arrives at once and each next turn as soon as the previous
answer is complete (closed loop, greedy): the worker's waiting queue is deep, so the
conversation at its head is the one that waited longest, which is exactly the one LRU
evicts first; scheduler-aware eviction reads the queue instead (§3.3.2).

Real engine (default): SmolLM2-135M on this machine, engine-level (no HTTP), TTFT from
the wall clock. ``--simulate``: the same comparison at cluster scale in the simulator
(the shipped engine, scheduler, MemPool and router on a cost-model clock with a paper
preset), via ``memserve simulate``'s own flags after ``--``.

    python benchmarks/real/tier_hit_rate.py [--sessions 12] [--turns 3] [--plot tier_hit_rate.png]
    python benchmarks/real/tier_hit_rate.py --simulate --plot sim.png -- --cost-model llama2-13b-h800 \\
        --num-sessions 300 --max-turns 6 --rate 4 --instances 2 --router session
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("lru", "fifo", "scheduler-aware")


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class Outcome:
    label: str
    turns: list[Turn] = field(default_factory=list)
    tier_hits: dict[str, int] = field(default_factory=dict)  # blocks matched per tier
    prefetch_hits: int = 0

    def hit_rate(self, first_turn: int = 1) -> float:
        """Cached share of the prompt tokens of turns from ``first_turn`` (0-based)."""
        ts = [t for t in self.turns if t.turn >= first_turn]
        prompt = sum(t.prompt_tokens for t in ts)
        return sum(t.cached_tokens for t in ts) / prompt if prompt else 0.0

    def ttft_ms(self, first_turn: int = 1) -> float:
        ts = [t.ttft_s for t in self.turns if t.turn >= first_turn]
        return 1000 * sum(ts) / len(ts) if ts else float("nan")

    def row(self) -> dict:
        hits = sum(self.tier_hits.values()) or 1
        return {"label": self.label, "hit_rate": round(self.hit_rate(), 4),
                "hit_rate_all_turns": round(self.hit_rate(0), 4), "ttft_ms": round(self.ttft_ms(), 2),
                "ttft_ms_turn_1": round(_first_turn_ttft(self), 2),
                "hits_by_tier": {t: round(n / hits, 3) for t, n in self.tier_hits.items()},
                "prefetch_hits": self.prefetch_hits}


def _first_turn_ttft(o: Outcome) -> float:
    ts = [t.ttft_s for t in o.turns if t.turn == 0]
    return 1000 * sum(ts) / len(ts) if ts else float("nan")


# ------------------------------------------------------------------ real engine

def conversations(tokenizer, n: int, turns: int, max_tokens: int, max_len: int) -> list[list[dict]]:
    """The first ``n`` ShareGPT conversations with ``turns`` user turns whose last turn
    (with short answers) fits ``max_len`` tokens."""
    from memserve.workload.dataset import default_sharegpt_path, open_text

    out = []
    for line in open_text(default_sharegpt_path()).read().splitlines():
        conv = json.loads(line)["messages"]
        users = [m["content"] for m in conv if m["role"] == "user"][:turns]
        if len(users) < turns or any(len(u) > 1500 for u in users):
            continue
        history: list[dict] = []
        for u in users:
            history += [{"role": "user", "content": u}, {"role": "assistant", "content": "x " * max_tokens}]
        if len(tokenizer.encode_chat(history[:-1])) < max_len - max_tokens:
            out.append([{"role": "user", "content": u} for u in users])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} conversations fit; ask for fewer")


def replay(engine, tokenizer, convs: list[list[dict]], max_tokens: int, label: str,
           arrival: Callable[[], float] = time.perf_counter) -> Outcome:
    """Closed-loop replay on one engine: every session's first turn queued at once, each
    next turn queued when the previous answer is complete (its history holds the
    answer the engine produced)."""
    from memserve.ipc.messages import AddRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    history: list[list[dict]] = [[] for _ in convs]
    sent: dict[str, tuple[int, int, float, int]] = {}
    first_token: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    outcome = Outcome(label)

    def send(s: int, k: int) -> None:
        history[s].append(convs[s][k])
        prompt = tokenizer.encode_chat(history[s])
        rid = f"{label}-{s}-{k}"
        sent[rid] = (s, k, arrival(), len(prompt))
        answers[rid] = []
        assert engine.add_request(AddRequest(rid, prompt, params, session_id=f"s{s}")) is None

    for s in range(len(convs)):
        send(s, 0)
    while engine.has_work:
        for out in engine.step():
            now = arrival()
            first_token.setdefault(out.request_id, now)
            answers[out.request_id] += out.new_token_ids
            if not out.finished:
                continue
            s, k, at, n = sent[out.request_id]
            outcome.turns.append(Turn(s, k, n, out.num_cached_tokens, first_token[out.request_id] - at))
            history[s].append({"role": "assistant", "content": tokenizer.decode(answers[out.request_id])})
            if k + 1 < len(convs[s]):
                send(s, k + 1)
    io = engine.mempool.stats()["tier_io"]
    outcome.tier_hits = {t: v["hits"] for t, v in io.items()}
    outcome.prefetch_hits = io.get("host", {}).get("prefetch_hits", 0)
    return outcome


def real_configs(args) -> list[tuple[str, dict]]:
    """(label, EngineConfig overrides); the disk budget is given in blocks."""
    tiers = {"num_host_blocks": args.host_blocks, "disk_blocks": args.disk_blocks}
    out = [(p, {"eviction_policy": p, **tiers}) for p in POLICIES]
    out += [("device only", {"eviction_policy": "lru", "num_host_blocks": 0, "disk_blocks": 0}),
            ("+host", {"eviction_policy": "scheduler-aware", "num_host_blocks": args.host_blocks, "disk_blocks": 0})]
    return out


def run_real(args) -> list[Outcome]:
    from memserve.config import EngineConfig
    from memserve.kvcache.disk_store import HEADER_NBYTES
    from memserve.model_files.gguf_convert import ensure_model_dir
    from memserve.text.tokenizer import Tokenizer
    from memserve.workers.real_engine import build_engine

    model_dir = ensure_model_dir(None)
    tokenizer = Tokenizer.from_folder(model_dir)
    max_len = args.device_blocks * 16
    convs = conversations(tokenizer, args.sessions, args.turns, args.max_tokens, max_len)
    block_nbytes = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M, float32: 30 layers, 3 KV heads of 64
    outcomes = []
    for label, over in selected(real_configs(args), args.only):
        disk_blocks = over.pop("disk_blocks")
        with tempfile.TemporaryDirectory() as disk_dir:
            cfg = EngineConfig(dtype="float32", num_blocks=args.device_blocks, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=512, max_model_len=max_len,
                               disk_cache_dir=disk_dir if disk_blocks else None,
                               disk_cache_gb=disk_blocks * (block_nbytes + HEADER_NBYTES) / 2**30, **over)
            engine = build_engine(cfg, model_dir)
            started = time.perf_counter()
            outcome = replay(engine, tokenizer, convs, args.max_tokens, label.replace(" ", "_"))
            engine.close()
        outcome.label = label
        outcomes.append(outcome)
        print(f"{label:>16}: hit rate {outcome.hit_rate():6.1%} (turns >= 2), TTFT {outcome.ttft_ms():7.1f} ms, "
              f"hits by tier {outcome.row()['hits_by_tier']}, prefetch hits {outcome.prefetch_hits} "
              f"[{time.perf_counter() - started:.0f} s]", flush=True)
    return outcomes


def selected(configs: list[tuple[str, dict]], only: str | None) -> list[tuple[str, dict]]:
    if not only:
        return configs
    wanted = only.split(",")
    unknown = set(wanted) - {label for label, _ in configs}
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; choose from {[c for c, _ in configs]}")
    return [c for c in configs if c[0] in wanted]


# ------------------------------------------------------------------- simulator

def sim_configs(args, base) -> list[tuple[str, dict]]:
    host, disk = base.num_host_blocks or 4 * base.num_blocks, args.sim_disk_blocks or 16 * base.num_blocks
    out = [(p, {"eviction_policy": p, "num_host_blocks": host, "num_disk_blocks": disk}) for p in POLICIES]
    out += [("device only", {"eviction_policy": "lru", "num_host_blocks": 0, "num_disk_blocks": 0}),
            ("+host", {"eviction_policy": "scheduler-aware", "num_host_blocks": host, "num_disk_blocks": 0})]
    return out


def run_simulated(args, sim_argv: list[str]) -> list[Outcome]:
    from memserve.bench.cli import build_sessions, replay_options
    from memserve.config import EngineConfig
    from memserve.costmodel.store import load_cost_model
    from memserve.gateway.routing.router import Balance, Router
    from memserve.sim.cli import add_parser
    from memserve.sim.simulator import Simulation
    from memserve.sim.tokens import HFTokenizer, SyntheticTokenizer

    root = argparse.ArgumentParser(prog="memserve")
    add_parser(root.add_subparsers())
    base = root.parse_args(["simulate", *sim_argv])
    cost = load_cost_model(base.cost_model)
    _, parts, _ = build_sessions(base, 1)
    tokenizer = HFTokenizer(base.tokenizer) if base.tokenizer else SyntheticTokenizer()
    outcomes = []
    for label, over in selected(sim_configs(args, base), args.only):
        disk = over.pop("num_disk_blocks")
        cfg = EngineConfig(block_size=base.block_size, num_blocks=base.num_blocks, max_num_seqs=base.max_num_seqs,
                           max_num_batched_tokens=base.max_num_batched_tokens, max_model_len=base.max_model_len,
                           **over)
        router = Router.named(base.router, cost, Balance(base.router_balance_abs, base.router_balance_rel,
                                                         base.router_cache_threshold))
        rate = base.rate or float("inf")
        started = time.perf_counter()
        sim = Simulation(cost, cfg, base.instances, router, tokenizer, replay_options(base, rate), disk)
        sim.run(parts[0])
        outcome = Outcome(label)
        for r in sim.records:
            if r.ok and r.chunk_times:
                outcome.turns.append(Turn(hash(r.session_id), r.turn - 1, r.prompt_tokens or 0, r.cached_tokens or 0,
                                          r.chunk_times[0] - r.start))
        for inst in sim.instances:
            for tier, io in inst.engine.mempool.stats()["tier_io"].items():
                outcome.tier_hits[tier] = outcome.tier_hits.get(tier, 0) + io["hits"]
                outcome.prefetch_hits += io.get("prefetch_hits", 0)
        outcomes.append(outcome)
        print(f"{label:>16}: hit rate {outcome.hit_rate():6.1%} (turns >= 2), TTFT {outcome.ttft_ms():8.1f} ms, "
              f"hits by tier {outcome.row()['hits_by_tier']}, prefetch hits {outcome.prefetch_hits} "
              f"[{len(sim.records)} requests, {time.perf_counter() - started:.1f} s wall]", flush=True)
    return outcomes


# ------------------------------------------------------------------------ plot

def plot(outcomes: list[Outcome], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [o.label for o in outcomes]
    colors = ["tab:blue" if o.label in POLICIES else "tab:gray" for o in outcomes]
    bottoms = [0.0] * len(outcomes)
    for tier, color in (("device", "tab:green"), ("host", "tab:orange"), ("disk", "tab:red")):
        shares = []
        for o in outcomes:
            hits = sum(o.tier_hits.values())
            shares.append(o.hit_rate() * o.tier_hits.get(tier, 0) / hits if hits else 0.0)
        ax_hit.bar(labels, [100 * s for s in shares], bottom=[100 * b for b in bottoms], color=color, label=tier)
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    ax_hit.set_ylabel("hit rate, turns >= 2 (%)")
    ax_hit.set_title("cached share of prompt tokens, by tier hit")
    ax_hit.legend()
    ax_ttft.bar(labels, [o.ttft_ms() for o in outcomes], color=colors)
    ax_ttft.set_ylabel("mean TTFT, turns >= 2 (ms)")
    ax_ttft.set_title("time to first token")
    for ax in (ax_hit, ax_ttft):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("\n".join(textwrap.wrap(title, 140)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    argv = sys.argv[1:]
    sim_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, sim_argv = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulate", action="store_true", help="run in the simulator; its flags follow --")
    p.add_argument("--sessions", type=int, default=12, help="real: conversations")
    p.add_argument("--turns", type=int, default=3, help="real: user turns per conversation")
    p.add_argument("--max-tokens", type=int, default=16, help="real: answer tokens per turn")
    p.add_argument("--device-blocks", type=int, default=48, help="real: device KV blocks (16 tokens each)")
    p.add_argument("--host-blocks", type=int, default=48, help="real: host-tier blocks")
    p.add_argument("--disk-blocks", type=int, default=96, help="real: disk-tier blocks")
    p.add_argument("--max-num-seqs", type=int, default=2, help="real: requests running at once")
    p.add_argument("--sim-disk-blocks", type=int, default=0,
                   help="simulate: disk-tier blocks per instance (default 16x --num-blocks; host: "
                        "--num-host-blocks, default 4x --num-blocks)")
    p.add_argument("--only", help="comma-separated configuration labels to run (default: all)")
    p.add_argument("--plot", help="write the figure here (PNG)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.simulate:
        if not sim_argv:
            p.error("--simulate needs memserve simulate's flags after --, at least --cost-model")
        outcomes = run_simulated(args, sim_argv)
        title = f"simulated (disk {args.sim_disk_blocks or '16x --num-blocks'} blocks): " + " ".join(sim_argv)
    else:
        outcomes = run_real(args)
        title = (f"SmolLM2-135M, {args.sessions} sessions x {args.turns} turns, device {args.device_blocks} / "
                 f"host {args.host_blocks} / disk {args.disk_blocks} blocks")
    rows = [o.row() for o in outcomes]
    by = {r["label"]: r for r in rows}
    if all(p_ in by for p_ in ("lru", "scheduler-aware")):
        print(f"scheduler-aware - lru: {100 * (by['scheduler-aware']['hit_rate'] - by['lru']['hit_rate']):+.1f} "
              f"points of hit rate (turns >= 2)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(outcomes, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
