"""MemServe Figs. 11-12 shape on real workers: what one prefill-to-decode KV handoff costs
per request in each ``--transfer-mode`` — bytes, messages (ZeroMQ frames of
by-request(-agg), one network call each; by-layer's per-layer messages) and transfer
time — for prompts of several lengths, and the time from the end of the prefill step to
the KV being at the decode instance (``ready_ms``: by-layer sent it during the step).
One `prefill,decode` pair in pd-basic (every handoff moves the whole prompt) per mode,
driven through the gateway's engine client; the figures are the prefill worker's handoff
counters. ``transfer_ms`` runs from the send's start: after the step for by-request(-agg),
from the first layer handed over (inside the step) for by-layer. Each mode runs once per
``--transports`` entry, the same-host path the two workers take (shm: the decode worker
reads the KV out of the prefill worker's pool, by shared memory on the CPU or CUDA IPC on
GPUs; zmq: ZeroMQ frames), and the last line compares them.

    python benchmarks/real/pd_transfer_modes.py [--lengths 128,512,1024] [--requests 4] [--modes by-layer,...]
        [--transports zmq,shm] [--model DIR] [--gpus 0,0] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from memserve.config import EngineConfig
from memserve.gateway.cluster import Cluster, plan_workers
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.routing.pd_topology import apply_pd_mode
from memserve.ipc.channel import GatewayChannel
from memserve.ipc.messages import SamplingParams
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model.model_config import ModelConfig

MODES = ("by-request-agg", "by-request", "by-layer")
KEYS = ("handoffs", "bytes_sent", "messages", "transfer_s", "kv_ready_s")


async def counters(client: ZmqEngineClient, handoffs: int) -> dict:
    """The prefill worker's handoff counters once its heartbeat shows ``handoffs`` of them."""
    deadline = time.monotonic() + 30
    while True:
        pd = client.cluster.workers[0].stats.pd
        if pd.handoffs >= handoffs or time.monotonic() > deadline:
            return {k: getattr(pd, k) for k in KEYS}
        await asyncio.sleep(0.2)


async def run_mode(args: argparse.Namespace, mode: str, transport: str, lengths: list[int]) -> dict:
    model_dir = Path(args.model) if args.model else ensure_model_dir(None)
    vocab = ModelConfig.from_folder(model_dir).vocab_size
    channel = GatewayChannel()
    engine = EngineConfig(model=str(model_dir), dtype=args.dtype, num_blocks=args.num_blocks, transfer_mode=mode,
                          kv_same_host_transport=transport)
    configs = plan_workers(engine, channel.address, 2, args.gpus, ["prefill", "decode"])
    apply_pd_mode(configs, "pd-basic")
    client = ZmqEngineClient(channel, Cluster(configs), 16, pd_mode="pd-basic")
    await client.start()
    rng = random.Random(0)
    out = {}
    try:
        done = 0
        for length in lengths:
            before = await counters(client, done)
            for i in range(args.requests):
                prompt = [rng.randrange(vocab) for _ in range(length)]
                async for _ in client.generate(f"{mode}-{length}-{i}", prompt, SamplingParams(max_tokens=2,
                                                                                             temperature=0.0)):
                    pass
            done += args.requests
            after = await counters(client, done)
            n = after["handoffs"] - before["handoffs"]
            out[length] = {"bytes": (after["bytes_sent"] - before["bytes_sent"]) / n,
                           "messages": (after["messages"] - before["messages"]) / n,
                           "transfer_ms": 1000 * (after["transfer_s"] - before["transfer_s"]) / n,
                           "ready_ms": 1000 * (after["kv_ready_s"] - before["kv_ready_s"]) / n}
    finally:
        await client.close()
    return out


def report(results: dict[tuple[str, str], dict]) -> None:
    print(f"{'mode':15s} {'path':>4s} {'prompt':>6s} {'MiB/req':>8s} {'msgs/req':>9s} {'ms/req':>7s} {'ready_ms':>8s}")
    for (mode, transport), per in results.items():
        for length, r in per.items():
            print(f"{mode:15s} {transport:>4s} {length:6d} {r['bytes'] / 2**20:8.2f} {r['messages']:9.0f} "
                  f"{r['transfer_ms']:7.1f} {r['ready_ms']:8.1f}")
    pairs = [(mode, results[mode, "zmq"], results[mode, "shm"]) for mode, transport in results
             if transport == "zmq" and (mode, "shm") in results]
    if pairs:  # one line for scripts/gpu_check's table: the longest prompt
        print("summary: zmq/shm ms, " + "; ".join(
            f"{mode} {length}: ready {zmq[length]['ready_ms']:.1f}/{shm[length]['ready_ms']:.1f}, transfer "
            f"{zmq[length]['transfer_ms']:.1f}/{shm[length]['transfer_ms']:.1f}"
            for mode, zmq, shm in pairs for length in list(zmq)[-1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128,512,1024")
    p.add_argument("--requests", type=int, default=4, help="requests per prompt length")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated transfer modes to measure")
    p.add_argument("--transports", default="shm", help="comma-separated same-host paths: shm, zmq")
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--gpus", type=lambda s: [int(g) for g in s.split(",")], help="the two workers' GPUs, e.g. 0,0")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output", help="write the results JSON here")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {(mode, transport): asyncio.run(run_mode(args, mode, transport, lengths))
               for mode in args.modes.split(",") for transport in args.transports.split(",")}
    report(results)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({f"{mode}/{transport}": per for (mode, transport), per in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
