"""MemServe Figs. 11-12 shape on real workers: what one prefill-to-decode KV handoff costs
per request in each ``--transfer-mode`` — bytes, messages (ZeroMQ frames of
by-request(-agg), one network call each; by-layer's per-layer messages) and transfer
time — for prompts of several lengths, and the time from the end of the prefill step to
the KV being at the decode instance (``ready_ms``: by-layer sent it during the step).
One `prefill,decode` pair in pd-basic (every handoff moves the whole prompt) per mode,
driven through the gateway's engine client; the figures are the prefill worker's handoff
counters. ``transfer_ms`` runs from the send's start: after the step for by-request(-agg),
from the first layer handed over (inside the step) for by-layer.

    python benchmarks/real/pd_transfer_modes.py [--lengths 128,512,1024] [--requests 4] [--modes by-layer,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from memserve.config import EngineConfig
from memserve.gateway.cluster import Cluster, plan_workers
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.routing.pd_topology import apply_pd_mode
from memserve.ipc.channel import GatewayChannel
from memserve.ipc.messages import SamplingParams
from memserve.model_files.gguf_convert import ensure_model_dir

MODES = ("by-request-agg", "by-request", "by-layer")
KEYS = ("handoffs", "bytes_sent", "messages", "transfer_s", "kv_ready_s")


async def counters(client: ZmqEngineClient, handoffs: int) -> dict:
    """The prefill worker's handoff counters once its heartbeat shows ``handoffs`` of them."""
    deadline = time.monotonic() + 30
    while True:
        pd = client.cluster.workers[0].stats.get("pd", {})
        if pd.get("handoffs", 0) >= handoffs or time.monotonic() > deadline:
            return {k: pd.get(k, 0) for k in KEYS}
        await asyncio.sleep(0.2)


async def run_mode(mode: str, lengths: list[int], requests: int, num_blocks: int) -> dict:
    model_dir = ensure_model_dir(None)
    channel = GatewayChannel()
    configs = plan_workers(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=num_blocks,
                                        transfer_mode=mode), channel.address, 2, None, ["prefill", "decode"])
    apply_pd_mode(configs, "pd-basic")
    client = ZmqEngineClient(channel, Cluster(configs), 16, pd_mode="pd-basic")
    await client.start()
    rng = random.Random(0)
    out = {}
    try:
        done = 0
        for length in lengths:
            before = await counters(client, done)
            for i in range(requests):
                prompt = [rng.randrange(1000, 40000) for _ in range(length)]
                async for _ in client.generate(f"{mode}-{length}-{i}", prompt, SamplingParams(max_tokens=2,
                                                                                             temperature=0.0)):
                    pass
            done += requests
            after = await counters(client, done)
            n = after["handoffs"] - before["handoffs"]
            out[length] = {"bytes": (after["bytes_sent"] - before["bytes_sent"]) / n,
                           "messages": (after["messages"] - before["messages"]) / n,
                           "transfer_ms": 1000 * (after["transfer_s"] - before["transfer_s"]) / n,
                           "ready_ms": 1000 * (after["kv_ready_s"] - before["kv_ready_s"]) / n}
    finally:
        await client.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128,512,1024")
    p.add_argument("--requests", type=int, default=4, help="requests per prompt length")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated transfer modes to measure")
    p.add_argument("--output", help="write the results JSON here")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {mode: asyncio.run(run_mode(mode, lengths, args.requests, args.num_blocks)) for mode in args.modes.split(",")}
    print(f"{'mode':15s} {'prompt':>6s} {'MiB/req':>8s} {'msgs/req':>9s} {'ms/req':>7s} {'ready_ms':>8s}")
    for mode, per in results.items():
        for length, r in per.items():
            print(f"{mode:15s} {length:6d} {r['bytes'] / 2**20:8.2f} {r['messages']:9.0f} {r['transfer_ms']:7.1f} "
                  f"{r['ready_ms']:8.1f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
