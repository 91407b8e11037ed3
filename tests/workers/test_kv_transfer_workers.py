"""MemPool transfer_with_insert between two real worker processes (real model, real
ZeroMQ): after worker 0 pushes a conversation's cached prefix to worker 1, worker 1's
index holds it (the gateway's mirror, fed by its KV events, says so) and the same request
sent to worker 1 reports it as cached and produces the same tokens."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from memserve.config import EngineConfig
from memserve.gateway.cluster import Cluster, plan_workers
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.ipc.channel import GatewayChannel
from memserve.ipc.messages import ExpectTransfer, SamplingParams, TransferPrefix
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.text.tokenizer import Tokenizer

BLOCK = 16


async def collect(stream) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in stream:
        assert out.error is None, out.error
        tokens += out.new_token_ids
        cached = max(cached, out.num_cached_tokens)
    return tokens, cached


async def two_workers(model_dir, num_blocks: int = 96, **cluster_args) -> tuple[list[int], Cluster, ZmqEngineClient]:
    """Two CPU workers behind a started client, and a chat prompt of a few blocks."""
    tok = Tokenizer.from_folder(model_dir)
    prompt = tok.encode_chat([{"role": "system", "content": "You answer in one short sentence. " * 6},
                              {"role": "user", "content": "Why is the sky blue?"}])
    channel = GatewayChannel()
    engine_cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=num_blocks)
    cluster = Cluster(plan_workers(engine_cfg, channel.address, cpu_workers=2, gpus=None), **cluster_args)
    client = ZmqEngineClient(channel, cluster, BLOCK)
    await client.start()
    return prompt, cluster, client


async def scenario(model_dir) -> None:
    prompt, _, client = await two_workers(model_dir)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0)
        first, cached0 = await collect(client.generate("on-0", prompt, params, instance=0))
        assert cached0 == 0
        assert client.mirrors[1].cached_tokens(prompt) == 0

        sent = await client.transfer_prefix(0, 1, prompt)
        assert sent == len(prompt) // BLOCK
        for _ in range(50):  # KV events travel with the worker's next loop turn
            if client.mirrors[1].cached_tokens(prompt) == sent * BLOCK:
                break
            await asyncio.sleep(0.1)
        assert client.mirrors[1].cached_tokens(prompt) == sent * BLOCK

        again, cached1 = await collect(client.generate("on-1", prompt, params, instance=1))
        assert again == first
        assert cached1 == min(sent, (len(prompt) - 1) // BLOCK) * BLOCK
    finally:
        await client.close()


@pytest.mark.slow  # over 10 s; pd-caching-2 handoffs (tests/workers/test_pd_modes.py) insert by transfer too
def test_transfer_with_insert_between_worker_processes():
    asyncio.run(scenario(ensure_model_dir(None)))


async def slow_peer_scenario(model_dir) -> None:
    """Worker 1 is frozen while worker 0 pushes a prefix to it: worker 0 keeps streaming
    another request's tokens meanwhile, and the transfer completes once 1 wakes up."""
    prompt, cluster, client = await two_workers(model_dir, heartbeat_timeout_s=30)
    try:
        await collect(client.generate("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0), instance=0))
        peer = cluster.workers[1].process.pid
        os.kill(peer, signal.SIGSTOP)
        try:
            transfer = asyncio.create_task(client.transfer_prefix(0, 1, prompt))
            await asyncio.sleep(0.3)  # the transfer has started: worker 1 cannot answer it
            token_times = []
            long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            async for out in client.generate("meanwhile", prompt[:20], long, instance=0):
                token_times += [time.monotonic()] * len(out.new_token_ids)
            assert len(token_times) == 12 and not transfer.done()  # streamed while the transfer waited
        finally:
            os.kill(peer, signal.SIGCONT)
        assert await asyncio.wait_for(transfer, 30) == len(prompt) // BLOCK
    finally:
        await client.close()


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_a_slow_peer_does_not_stall_the_senders_other_requests():
    asyncio.run(slow_peer_scenario(ensure_model_dir(None)))


async def busy_receiver_scenario(model_dir) -> None:
    """A transfer into a worker in the middle of a long prefill step is answered between
    the step's layers (``workers/step_serving.py``): it completes before that step's
    first token, instead of waiting for the step to end, twice (allocation, then data)."""
    prompt, _, client = await two_workers(model_dir, 256, heartbeat_timeout_s=30)
    try:
        await collect(client.generate("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0), instance=0))
        ticket, blocks = "busy-receiver", len(prompt) // BLOCK
        await client.ask(1, ExpectTransfer(9001, ticket, 0, blocks), 30)  # worker 1 is idle: answered at once
        long_prompt = random.Random(0).choices(range(1000, 40000), k=2000)  # one step of seconds on a CPU
        first_token_at: list[float] = []

        async def long_prefill() -> None:
            async for _ in client.generate("long", long_prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                           instance=1):
                first_token_at.append(time.monotonic())

        prefill = asyncio.create_task(long_prefill())
        await asyncio.sleep(0.3)  # worker 1 is inside the long step now
        done = await client.ask(0, TransferPrefix(9002, list(prompt), 1, ticket), 30)
        done_at = time.monotonic()
        await prefill
        assert done.error is None and done.num_blocks == blocks
        assert done_at < first_token_at[0]
    finally:
        await client.close()


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_a_transfer_into_a_busy_worker_is_answered_within_its_step():
    asyncio.run(busy_receiver_scenario(ensure_model_dir(None)))
