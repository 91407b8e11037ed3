"""Real engines in two processes on one machine, moving KV over both same-host paths
(``ipc/same_host.py``): the sender computes a prompt's KV and sends it by layer and by
request; the receiver decodes over it. Shared by the CPU test and its CUDA variant (where
shm is CUDA IPC): only the device differs."""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from helpers.engine_generate import generate
from memserve.config import EngineConfig
from memserve.ipc.kv_transfer import KVTransferEndpoint
from memserve.kvcache.address import Tier, addr_block
from memserve.kvcache.mempool import KVFlags
from memserve.testing.random_models import TINY_SIZES
from memserve.workers.engine.engine import Engine
from memserve.workers.kv_share import shared_pools
from memserve.workers.real_engine import build_engine

TRANSPORTS = ("zmq", "shm")
SENDER, RECEIVER = 0, 1
BLOCK = 16


def engine_for(folder: Path, device: str, transport: str, instance: int) -> tuple[Engine, KVTransferEndpoint]:
    cfg = EngineConfig(model=str(folder), dtype="float32", device=device, enforce_eager=True, num_blocks=64,
                       block_size=BLOCK, kv_same_host_transport=transport)
    engine = build_engine(cfg, folder, instance)
    return engine, KVTransferEndpoint(engine.mempool, timeout_s=30, shared=shared_pools(engine.runner.pools, transport))


def block_bytes(engine: Engine, addrs: list[int]) -> bytes:
    return b"".join(bytes(b) for b in engine.runner.pools.read_blocks(Tier.DEVICE, [addr_block(a) for a in addrs]))


def receiver_main(conn: Any, folder: Path, device: str) -> None:
    """The receiving worker: one engine per transport, each behind its own endpoint."""
    engines = {t: engine_for(folder, device, t, RECEIVER) for t in TRANSPORTS}
    conn.send({t: endpoint.address for t, (_, endpoint) in engines.items()})
    while True:
        for _, endpoint in engines.values():
            endpoint.serve(timeout_ms=2)
        if not conn.poll():
            continue
        cmd, transport, *args = conn.recv()
        if cmd == "stop":
            break
        engine, endpoint = engines[transport]
        if cmd == "expect":
            endpoint.expect(*args)
            conn.send(None)
        elif cmd == "received":  # the bytes of each transfer that arrived, then freed
            received = endpoint.drain_received()
            conn.send([block_bytes(engine, kv.addrs) for kv in received])
            for kv in received:
                engine.mempool.free_mem(kv.addrs)
        elif cmd == "generate":  # the prompt's blocks as cached here, then greedy tokens over them
            prompt, max_tokens = args
            cached = block_bytes(engine, engine.mempool.match(prompt, take_ref=False))
            conn.send((cached, generate(engine, [prompt], max_tokens)[0], endpoint.stats()))
    for _, endpoint in engines.values():
        endpoint.close()


def ask(conn: Any, *cmd: Any) -> Any:
    conn.send(cmd)
    assert conn.poll(60), f"no answer to {cmd[0]}"
    return conn.recv()


def wait(future: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not future.done():
        assert time.monotonic() < deadline, "the transfer did not end"
        time.sleep(0.005)
    return future.result()


def send_both_ways(folder: Path, device: str) -> None:
    """Over each path: the KV arrives bit for bit, by layer and by request (indexed), the
    receiver reuses all of it, and its greedy tokens are the same on both paths."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child_conn, folder, device), daemon=True)
    proc.start()
    senders = {t: engine_for(folder, device, t, SENDER) for t in TRANSPORTS}
    prompt = torch.randint(0, TINY_SIZES["vocab_size"], (70,), generator=torch.Generator().manual_seed(0)).tolist()
    full = len(prompt) // BLOCK * BLOCK
    tokens = {}
    try:
        assert conn.poll(300), "the receiver did not start"
        addresses = conn.recv()
        for transport, (engine, endpoint) in senders.items():
            endpoint.connect(RECEIVER, addresses[transport])
            assert endpoint.same_host_tiers(RECEIVER) == ({Tier.DEVICE} if transport == "shm" else set())
            generate(engine, [prompt], 4)  # the sender's prefill caches the prompt
            src = engine.kv_connector.hold_prefix(prompt)
            sent = block_bytes(engine, src)
            blocks = [addr_block(a) for a in src]

            ticket = secrets.token_hex(8)
            ask(conn, "expect", transport, ticket, SENDER, len(src))
            stream = endpoint.open_layers(RECEIVER, len(src), engine.kv_connector.num_layers, ticket)
            assert stream.in_place == (transport == "shm")
            for layer in range(stream.num_layers):
                if stream.in_place:
                    stream.send_blocks(layer, blocks)
                else:
                    stream.send(layer, engine.kv_connector.read_layer(blocks, layer))
            wait(stream.future)
            assert ask(conn, "received", transport) == [sent]  # by layer, bit for bit

            ticket = secrets.token_hex(8)
            ask(conn, "expect", transport, ticket, SENDER, len(src))
            engine.mempool.transfer_with_insert(RECEIVER, prompt[:full], src, flags=KVFlags.RELEASE, ticket=ticket)
            engine.kv_connector.free(src)
            cached, (tokens[transport], num_cached), stats = ask(conn, "generate", transport, prompt, 8)
            assert cached == sent  # by request, bit for bit, and indexed
            assert num_cached == full  # the receiver computed only the partial block
            assert stats["in_place_received"] == (2 if transport == "shm" else 0)
        assert tokens["shm"] == tokens["zmq"]
        conn.send(("stop", ""))
        proc.join(30)
    finally:
        for _, endpoint in senders.values():
            endpoint.close()
        if proc.is_alive():
            proc.kill()
