"""A cached prefix pulled from another worker against recomputed, at N prompt tokens:
measured, and as the router's eq. 2 prices it with the link it measured between two Ray nodes.

1. ``memserve profile --quick --threads 1`` fits this machine's cost model (a worker of
   ``--cpu-threads 1``), whose ``prefill_s(N)`` is eq. 2's recompute time.
2. Pull, measured: ``MemPool.transfer`` of N tokens' blocks between two processes
   (``workers/transfer_probe.py``, the profile's probe, median of 3 after one unmeasured
   transfer). On one machine two Ray nodes' workers share the host, so their pull takes
   this same path (shm); between hosts the network would set the pace.
3. A ``ray.cluster_utils.Cluster`` on 127.0.0.1 (a head without CPUs, two worker nodes
   of one CPU each, as tests/e2e/test_ray_cluster.py builds it) serves two CPU workers,
   one on each node, with that cost model. The gateway's KV link probe between them is
   read from its log; ``RoutingContext.transfer_s`` over that link is eq. 2's pull price.
   Recompute, measured: the time of a fresh (uncached) N-token prompt with
   ``max_tokens=1`` sent to that server, so one worker prefills it on its node.
4. Prints both, and the break-even prompt length each side implies: eq. 2's, the
   shortest whole-block prompt whose priced pull is below its priced prefill; the
   measured one, bracketed by the measured N (short N such as 16 and 64 place it).

N is capped by the model's context (8192 for SmolLM2-135M): longer prompts are pulled
but not recomputed.

    python benchmarks/real/cross_node_pull.py [--tokens 16,64,256,1024,4096,16384] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from cold_start import REPO

from memserve.bench.server_process import ServerHandle, serving
from memserve.config import EngineConfig
from memserve.costmodel.model import BandwidthCost, CostModel
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.route_types import Balance, RoutingContext
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.transfer_probe import TransferProbe

LOOPBACK = "127.0.0.1"
LINK_LINE = re.compile(r"KV link 0 <-> 1: ([\d.e+-]+) GB/s, ([\d.e+-]+) ms a transfer")
BLOCK_SIZE = 16


def profile(out: Path) -> CostModel:
    """This machine's cost model for one compute thread (a worker of ``--cpu-threads 1``)."""
    subprocess.run([sys.executable, "-m", "memserve.cli", "profile", "--quick", "--threads", "1",
                    "--dtype", "float32", "--output", str(out)], check=True, cwd=REPO)
    return load_cost_model(out)


def measured_pulls(model_dir: Path, tokens: list[int], repeats: int) -> dict[int, float]:
    """Seconds of one ``MemPool.transfer`` of each N tokens' blocks between two processes."""
    blocks = {n: -(-n // BLOCK_SIZE) for n in tokens}
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE)
    with TransferProbe(model_dir, cfg, max(blocks.values()), lambda: None) as probe:
        probe.measure(max(blocks.values()))  # connects the sockets and faults the receiver's pages in
        return {n: statistics.median(probe.measure(b) for _ in range(repeats)) for n, b in blocks.items()}


def timed_prompt(server: ServerHandle, ids: list[int]) -> tuple[float, int, int]:
    """(seconds, prompt tokens, cached tokens) of one completion of ``ids`` with max_tokens 1."""
    body = json.dumps({"model": server.model, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(server.base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        usage = json.loads(r.read())["usage"]
    seconds = time.perf_counter() - start
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return seconds, usage["prompt_tokens"], cached


def on_two_ray_nodes(cost_path: Path, tokens: list[int], repeats: int, vocab: int, num_blocks: int,
                     tmp: Path) -> tuple[BandwidthCost, dict[int, float]]:
    """The gateway's measured link between two workers on two Ray nodes, and the seconds of
    a fresh prompt of each N tokens on that server (median of ``repeats``)."""
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keeps Ray on 127.0.0.1
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": LOOPBACK,
                                                            "include_dashboard": False})
    try:
        for name in ("node_a", "node_b"):
            cluster.add_node(num_cpus=1, resources={name: 1}, node_ip_address=LOOPBACK)
        flags = ["--ray", cluster.address, "--cpu-workers", "2", "--num-blocks", str(num_blocks),
                 "--cost-model", str(cost_path), "--router", "least-load"]
        with serving(flags, tmp / "memserve.log", cwd=REPO) as server:
            found = LINK_LINE.search(server.log_path.read_text())
            if found is None:
                raise RuntimeError(f"no KV link measured (log: {server.log_path})")
            link = BandwidthCost(float(found[2]) / 1e3, float(found[1]) * 1e9)
            rng = random.Random(0)
            recompute: dict[int, float] = {}
            for n in tokens:
                runs = []
                for _ in range(repeats):
                    # Random ids: no prompt shares a prefix with another, so nothing is cached.
                    seconds, prompt_tokens, cached = timed_prompt(server, [rng.randrange(vocab) for _ in range(n)])
                    assert prompt_tokens == n and cached == 0, (prompt_tokens, cached)
                    runs.append(seconds)
                recompute[n] = statistics.median(runs)
                print(f"recompute {n:6} tokens: {recompute[n] * 1e3:9.1f} ms", flush=True)
    finally:
        cluster.shutdown()
    return link, recompute


def measured_break_even(pulls: dict[int, float], recompute: dict[int, float]) -> str:
    """Where the measured points put the break-even: between the longest N that recomputes
    faster and the shortest that pulls faster. Prefill grows faster than linearly (attention),
    so a line through the points would misplace it."""
    wins = sorted(n for n in recompute if pulls[n] < recompute[n])
    losses = sorted(n for n in recompute if pulls[n] >= recompute[n])
    if not wins:
        return f"above {max(recompute)} tokens (recompute faster at every N measured)"
    if not losses or max(losses) < wins[0]:
        low = max(losses) if losses else 0
        return f"between {low} and {wins[0]} tokens" if low else f"at or below {wins[0]} tokens (pull faster at every N)"
    return f"not one crossing: pull faster at {wins}, recompute at {losses}"


def priced_break_even(ctx: RoutingContext, cost: CostModel, limit: int) -> int | None:
    """The shortest prompt (whole blocks) whose eq. 2 pull price is below its recompute price."""
    for blocks in range(1, limit // BLOCK_SIZE + 1):
        if ctx.transfer_s(0, 1, blocks) < cost.prefill_s(blocks * BLOCK_SIZE):
            return blocks * BLOCK_SIZE
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,64,256,1024,4096,16384", help="prompt lengths N, comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="recomputes of each N (pulls: 3)")
    ap.add_argument("--cost-model", default=None, help="a cost model JSON (default: profile one now)")
    args = ap.parse_args()
    tokens = [int(n) for n in args.tokens.split(",")]
    model_dir = ensure_model_dir(None)
    model = ModelConfig.from_folder(str(model_dir))
    context = model.max_position_embeddings
    fits = [n for n in tokens if n < context]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cost_path = Path(args.cost_model) if args.cost_model else tmp / "cost.json"
        cost = load_cost_model(cost_path) if args.cost_model else profile(cost_path)
        pulls = measured_pulls(model_dir, tokens, 3)
        num_blocks = 4 * -(-max(fits) // BLOCK_SIZE)  # the link probe takes at most a quarter of a pool
        link, recompute = on_two_ray_nodes(cost_path, fits, args.repeats, model.vocab_size, num_blocks, tmp)
    ctx = RoutingContext(cost=cost, balance=Balance(), block_size=BLOCK_SIZE, links={(0, 1): link, (1, 0): link})
    print(f"\nKV link measured by the gateway between the two Ray nodes: {link.bytes_per_s / 1e9:.3g} GB/s, "
          f"{link.latency_s * 1e3:.3g} ms a transfer; cost model's one-machine transfer: "
          f"{cost.transfer.bytes_per_s / 1e9:.3g} GB/s, {cost.transfer.latency_s * 1e3:.3g} ms; "
          f"{cost.kv_bytes_per_token} KV bytes a token")
    print(f"{'N':>6} {'MB':>7} {'pull meas.':>11} {'pull eq.2':>10} {'recomp. meas.':>14} {'recomp. eq.2':>13}")
    for n in tokens:
        priced_pull = ctx.transfer_s(0, 1, -(-n // BLOCK_SIZE))
        measured = f"{recompute[n] * 1e3:11.1f} ms" if n in recompute else f"{'(> context)':>14}"
        print(f"{n:6} {n * cost.kv_bytes_per_token / 1e6:7.1f} {pulls[n] * 1e3:8.1f} ms {priced_pull * 1e3:7.1f} ms "
              f"{measured} {cost.prefill_s(n) * 1e3:10.1f} ms")
    priced = priced_break_even(ctx, cost, context)
    print(f"break-even (pull faster above): eq. 2 priced {priced} tokens; measured "
          f"{measured_break_even(pulls, recompute)}")


if __name__ == "__main__":
    main()
