"""A disaggregated cluster for the PD tests: real worker processes (real model, ZeroMQ,
KV transfers) behind the gateway's engine client, without the HTTP layer; ShareGPT
conversations; and the leak check (every worker's allocatable blocks back to its pool)."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

from helpers.paths import SHARED_DATA
from memserve.config import EngineConfig
from memserve.gateway.cluster import Cluster, plan_workers
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.routing.pd_topology import apply_pd_mode
from memserve.ipc.channel import GatewayChannel
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.text.tokenizer import Tokenizer

BLOCK = 16
SHAREGPT = SHARED_DATA / "sharegpt-sample.jsonl"


@asynccontextmanager
async def pd_cluster(roles: list[str], pd_mode: str = "pd-caching-3", num_blocks: int = 128,
                     heartbeat_timeout_s: float = 5.0, handoff_timeout_s: float = 5.0,
                     transfer_mode: str = "by-request-agg", kv_same_host_transport: str = "shm",
                     tensor_parallel_size: int = 1, model_dir: Path | None = None, gpus: list[int] | None = None,
                     **engine_options):
    """(client, tokenizer) over ``roles`` workers (of ``tensor_parallel_size`` ranks each) of
    ``model_dir`` (None: the embedded SmolLM2), on the CPU or on ``gpus`` as ``--instances``
    places them; stopped on exit. The workers share one machine: KV moves in place (shm:
    shared memory on the CPU, CUDA IPC on GPUs) or as ZeroMQ frames (zmq).
    ``engine_options``: more ``EngineConfig`` fields (LoRA adapters, say)."""
    model_dir = model_dir or ensure_model_dir(None)
    channel = GatewayChannel()
    configs = plan_workers(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=num_blocks,
                                        transfer_mode=transfer_mode, kv_same_host_transport=kv_same_host_transport,
                                        tensor_parallel_size=tensor_parallel_size, **engine_options),
                           channel.address, len(roles), gpus, roles)
    apply_pd_mode(configs, pd_mode)
    client = ZmqEngineClient(channel, Cluster(configs, heartbeat_timeout_s), BLOCK, pd_mode=pd_mode,
                             handoff_timeout_s=handoff_timeout_s)
    await client.start()
    try:
        # A random model's folder has no tokenizer: its tests send token ids.
        yield client, Tokenizer.from_folder(model_dir) if (model_dir / "tokenizer.json").exists() else None
    finally:
        await client.close()


async def collect(stream) -> tuple[list[int], int, str | None, str | None]:
    """(tokens, cached prompt tokens, finish reason, error) of one request."""
    tokens, cached, reason, error = [], 0, None, None
    async for out in stream:
        tokens += out.new_token_ids
        cached = max(cached, out.num_cached_tokens)
        reason, error = out.finish_reason, out.error or error
    return tokens, cached, reason, error


def user_turns(num_conversations: int, num_turns: int, max_chars: int = 300) -> list[list[str]]:
    """The first user messages of the first ShareGPT conversations that have enough."""
    out = []
    with open(SHAREGPT) as f:
        for line in f:
            users = [m["content"][:max_chars] for m in json.loads(line)["messages"] if m["role"] == "user"]
            if len(users) >= num_turns and all(users[:num_turns]):
                out.append(users[:num_turns])
            if len(out) == num_conversations:
                break
    return out


def leaks(client: ZmqEngineClient) -> dict[int, int]:
    """Per worker: device blocks neither free nor cached-and-evictable, and KV held for
    handoffs (parked, being sent, received but not resumed)."""
    out = {}
    for w in client.stats()["workers"]:
        held = client.cluster.workers[w["instance_id"]].num_blocks - w["free_blocks"].get("device", 0)
        pd = w["pd"]
        out[w["instance_id"]] = held + pd.get("parked", 0) + pd.get("sending", 0) + pd.get("holding", 0)
    return out


async def settled(client: ZmqEngineClient, timeout_s: float = 15.0) -> dict[int, int]:
    """``leaks`` once it is all zero, or what is left after ``timeout_s`` (heartbeats
    bring the workers' figures every half second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = leaks(client)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.25)


async def wait_stats(client: ZmqEngineClient, instance: int, key: str, at_least: int, timeout_s: float = 10.0) -> int:
    """Worker ``instance``'s ``PDStats`` counter ``key`` once it reaches ``at_least`` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = getattr(client.cluster.workers[instance].stats.pd, key)
        if value >= at_least or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.25)
