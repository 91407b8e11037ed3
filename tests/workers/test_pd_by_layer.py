"""By-layer KV transfer (MemServe §4.3, ``--transfer-mode by-layer``).

Between two endpoints over real KV pools (both layouts): one message per layer lands
every layer's K and V in the blocks the receiver allocated, bit for bit; a transfer
missing a layer or cancelled fails and leaves the receiver no block held. On real
workers (prefill,decode, pd-caching-2): the prefill step sends one message per layer of
only the blocks the decode instance lacks, greedy answers equal the prefill instance's
alone, and aborts leave no block held, with the layers read in place out of the prefill
instance's pool (shm) or sent as frames (zmq)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from types import SimpleNamespace

import pytest
import torch
from helpers.pd_harness import (
    BLOCK,
    collect,
    pd_cluster,
    settled,
    user_turns,
    wait_stats,
)

from memserve.config import EngineConfig
from memserve.ipc.kv_transfer import KVLayer, KVTransferEndpoint, TransferError
from memserve.ipc.messages import SamplingParams
from memserve.kvcache.address import Tier, addr_block
from memserve.kvcache.mempool import MemPool
from memserve.workers.kv_pools import KVPools
from memserve.workers.model.attention import layer_kv

LAYERS = 4
NUM_BLOCKS = 12
MODEL = SimpleNamespace(num_layers=LAYERS, num_kv_heads=2, head_dim=8)


def make_instance(instance: int, layout: str) -> tuple[MemPool, KVPools, KVTransferEndpoint]:
    cfg = EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_layout=layout)
    pools = KVPools.create(MODEL, cfg, torch.float32, torch.device("cpu"))
    pool = MemPool(instance, {Tier.DEVICE: NUM_BLOCKS}, BLOCK, mover=pools)
    return pool, pools, KVTransferEndpoint(pool, timeout_s=5)


def block_bytes(pools: KVPools, blocks: list[int]) -> list[bytes]:
    return [bytes(b) for block in blocks for b in pools.read_blocks(Tier.DEVICE, [block])]


@pytest.fixture(params=["aggregated", "layer-major"])
def pair(request):
    sender, receiver = make_instance(0, request.param), make_instance(1, request.param)
    sender[2].connect(1, receiver[2].address)
    layers_seen: list[KVLayer] = []
    on_layer = receiver[2]._on_layer
    receiver[2]._on_layer = lambda msg, *rest: (layers_seen.append(msg), on_layer(msg, *rest))[1]
    yield sender, receiver, layers_seen
    sender[2].close()
    receiver[2].close()


def run(receiver: KVTransferEndpoint, future, timeout_s: float = 10.0):
    """Serve the receiver until the sender's future ends; its result or error."""
    deadline = time.monotonic() + timeout_s
    while not future.done():
        assert time.monotonic() < deadline
        receiver.serve(timeout_ms=5)
    return future.exception() or future.result()


def test_one_message_per_layer_assembles_the_blocks(pair):
    (s_pool, s_pools, s_end), (r_pool, r_pools, r_end), seen = pair
    blocks = [addr_block(a) for a in s_pool.alloc_mem(5)]
    s_pools.device.copy_(torch.randn_like(s_pools.device))
    sent = block_bytes(s_pools, blocks)
    r_end.expect("t", 0, 5)
    stream = s_end.open_layers(1, 5, LAYERS, "t", tokens=list(range(5 * BLOCK)))
    for layer in range(LAYERS):
        stream.send(layer, s_pools.read_layer(blocks, layer))
        for kv in layer_kv(s_pools.device, layer, s_pools.layout):
            kv.zero_()  # the blocks may be reused once a layer is handed over: the send has a copy
    dst = run(r_end, stream.future)
    assert [m.layer for m in seen] == list(range(LAYERS)) and [m.final for m in seen] == [False] * 3 + [True]
    assert block_bytes(r_pools, [addr_block(a) for a in dst]) == sent
    received = r_end.drain_received()
    assert len(received) == 1 and received[0].addrs == dst and received[0].inserted == 5
    r_pool.free_mem(dst)
    assert r_pool.match(list(range(5 * BLOCK)), take_ref=False) == dst  # transfer_with_insert: indexed


def test_a_missing_layer_or_a_cancel_fails_and_frees(pair):
    (s_pool, s_pools, s_end), (r_pool, _, r_end), _ = pair
    blocks = [addr_block(a) for a in s_pool.alloc_mem(2)]
    r_end.expect("gap", 0, 2)
    stream = s_end.open_layers(1, 2, LAYERS, "gap")
    for layer in (0, 1, 3):  # layer 2 never sent
        stream.send(layer, s_pools.read_layer(blocks, layer))
    error = run(r_end, stream.future)
    assert isinstance(error, TransferError) and "1 of 4 layers" in str(error)
    assert not r_end.drain_received() and r_pool.stats()["device"]["used"] == 0

    r_end.expect("cancel", 0, 2)
    stream = s_end.open_layers(1, 2, LAYERS, "cancel")
    stream.send(0, s_pools.read_layer(blocks, 0))
    stream.cancel("the request was aborted")
    assert isinstance(run(r_end, stream.future), TransferError)
    assert r_end.cancel("cancel") == 2  # the receiver's blocks go with the ticket (abort or timeout)
    assert r_pool.stats()["device"]["used"] == 0


# ---------------------------------------------------------------- real workers

PREFILL, DECODE = 0, 1
NUM_LAYERS = 30  # SmolLM2-135M
BLOCK_BYTES = NUM_LAYERS * 2 * 3 * 64 * BLOCK * 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


async def by_layer_scenario(transport: str) -> None:
    async with pd_cluster(["prefill", "decode"], "pd-caching-2", transfer_mode="by-layer",
                          kv_same_host_transport=transport) as (client, tok):
        prompts, answers = [], []
        for n, users in enumerate(user_turns(2, 2)):
            messages = []
            for i, user in enumerate(users):
                messages.append({"role": "user", "content": user})
                prompts.append(tok.encode_chat(messages))
                answer, _, reason, error = await collect(client.generate(f"c{n}-{i}", prompts[-1], GREEDY))
                assert error is None and reason in ("stop", "length")
                answers.append(answer)
                messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
        assert client.pd.counts["handoffs"] == 4 and not client.pd.counts["handoff_failed"]
        assert await wait_stats(client, PREFILL, "handoffs", 4) == 4
        stats = client.cluster.workers[PREFILL].stats.pd
        assert stats.messages == 4 * NUM_LAYERS  # one message per layer, whatever the number of blocks
        total = sum(math.ceil(len(p) / BLOCK) for p in prompts)
        assert stats.blocks_skipped > 0  # the second turns: the decode instance had their first blocks
        assert stats.blocks_sent + stats.blocks_skipped == total
        assert stats.bytes_sent == stats.blocks_sent * BLOCK_BYTES
        assert (stats.in_place_sent >= 4) == (transport == "shm"), stats
        assert await wait_stats(client, DECODE, "resumed", 4) == 4  # reported with its next heartbeat

        for i, prompt in enumerate(prompts):  # the prefill instance alone (colocated) answers the same
            alone, _, _, _ = await collect(client.generate(f"ref{i}", prompt, GREEDY, instance=PREFILL))
            assert alone == answers[i], i

        # Aborted during the prefill (the layers may be on their way) and after the first token.
        for stop_after in (0, 1):
            stream = client.generate(f"abort-{stop_after}", prompts[-1],
                                     SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
            if stop_after == 0:
                task = asyncio.ensure_future(stream.__anext__())
                await asyncio.sleep(0.05)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):  # (or its first token came already)
                    await task
            else:
                async for _ in stream:
                    break
            await stream.aclose()
        assert await settled(client) == {PREFILL: 0, DECODE: 0}


@pytest.mark.parametrize("transport", ["shm", pytest.param("zmq", marks=pytest.mark.slow)])
def test_by_layer_handoff_on_real_workers(transport):
    asyncio.run(by_layer_scenario(transport))
