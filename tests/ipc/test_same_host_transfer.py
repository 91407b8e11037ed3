"""Same-host KV transfers between real processes on the CPU (``ipc/same_host.py``,
``workers/kv_share.py``): the receiver maps the sender's pools, shared memory here and CUDA
IPC on a GPU through the same code (``tests/cuda/test_cuda_same_host.py``).

Real engines: KV a sender computed and transferred in place is bit-exact at the receiver,
whose greedy tokens over it equal those over the ZeroMQ path. Real pools: by-layer
transfers read in place are bit-exact; a receiver that cannot map gets frames. Failures:
a receiver killed mid-transfer fails only the transfers it touches and the sender leaks no
block (both paths); a transfer cancelled while the receiver may still read the sender's
blocks keeps them until it cannot; a copy that ends after the sender's deadline is void."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.kv_pools import TestPools, make_pools
from helpers.same_host_engines import send_both_ways

from memserve.ipc.kv_transfer import KVTransferEndpoint, PeerGone, TransferError
from memserve.ipc.same_host import ProcessRef, host_identity, same_host
from memserve.kvcache.address import Tier, addr_block
from memserve.kvcache.mempool import MemPool
from memserve.testing.random_models import save_tiny_model
from memserve.workers.kv_share import SharedKVPools, shared_pools

SENDER = 0
BLOCK = 4
TIERS = {Tier.DEVICE: 24}
TRANSPORTS = ["zmq", "shm"]


# ------------------------------------------------------------------ real engines

def test_kv_moved_in_place_is_bit_exact_and_decodes_as_over_zeromq(tmp_path):
    save_tiny_model(tmp_path, "llama")
    send_both_ways(tmp_path, "cpu")


# -------------------------------------------------------------------- real pools

def pools_receiver_main(conn: Any, instance: int, transport: str) -> None:
    """A receiving worker over real pools: serves its endpoint, answers the test."""
    pools = make_pools(TIERS, BLOCK, transport)
    pool = MemPool(instance, TIERS, BLOCK, mover=pools)
    endpoint = KVTransferEndpoint(pool, timeout_s=20, shared=shared_pools(pools, transport))
    conn.send(endpoint.address)
    while True:
        endpoint.serve(timeout_ms=2)
        if not conn.poll():
            continue
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "expect":
            endpoint.expect(*args)
            conn.send(None)
        elif cmd == "received":  # the bytes of what arrived, then freed as an engine would
            got = []
            for kv in endpoint.drain_received():
                got.append(pools.get(kv.addrs))
                pool.free_mem(kv.addrs)
            conn.send(got)
        elif cmd == "used":
            conn.send(pool.stats()["device"]["used"])
    endpoint.close()


class Receiver:
    """A receiving worker process, as the sender sees it."""

    def __init__(self, instance: int, transport: str) -> None:
        ctx = mp.get_context("spawn")
        self.instance = instance
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=pools_receiver_main, args=(child, instance, transport), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "the receiver did not start"
        self.address = self.conn.recv()

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(20), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def ticket(self, max_blocks: int) -> str:
        ticket = secrets.token_hex(8)
        self.ask("expect", ticket, SENDER, max_blocks)
        return ticket

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGCONT)
            self.conn.send(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Sender:
    def __init__(self, transport: str, timeout_s: float = 20.0, layout: str = "aggregated") -> None:
        self.pools: TestPools = make_pools(TIERS, BLOCK, transport, layout)
        self.pool = MemPool(SENDER, TIERS, BLOCK, mover=self.pools)
        self.endpoint = KVTransferEndpoint(self.pool, timeout_s=timeout_s, shared=shared_pools(self.pools, transport))

    def connect(self, receiver: Receiver) -> frozenset[int]:
        self.endpoint.connect(receiver.instance, receiver.address)
        return self.endpoint.same_host_tiers(receiver.instance)

    def computed(self, n: int, seed: int) -> list[int]:
        addrs = self.pool.alloc_mem(n)
        self.pools.fill(Tier.DEVICE, [addr_block(a) for a in addrs], seed)
        return addrs

    def used(self) -> int:
        return self.pool.stats()["device"]["used"]


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.stop()


def settle(future, timeout_s: float = 10.0):
    """The future's exception (or None) once done; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not future.done():
        assert time.monotonic() < deadline, "the transfer never settled: its blocks would be held for ever"
        time.sleep(0.01)
    return future.exception()


@pytest.mark.parametrize("layout", ["aggregated", "layer-major"])
def test_by_layer_in_place_is_bit_exact(receivers, layout):
    sender = Sender("shm", layout=layout)
    receivers.append(receiver := Receiver(1, "shm"))
    if layout == "layer-major":  # the receiver's pools are aggregated: it maps nothing, frames it is
        assert sender.connect(receiver) == frozenset()
        return
    assert sender.connect(receiver) == {Tier.DEVICE}
    src = sender.computed(5, seed=1)
    stream = sender.endpoint.open_layers(1, 5, 4, receiver.ticket(5))
    assert stream.in_place
    for layer in range(4):
        stream.send_blocks(layer, [addr_block(a) for a in src])
    assert settle(stream.future) is None
    assert receiver.ask("received") == [sender.pools.get(src)]
    sender.pool.free_mem(src)
    sender.endpoint.close()


def test_a_receiver_that_does_not_share_gets_frames(receivers):
    sender = Sender("shm")
    receivers.append(receiver := Receiver(1, "zmq"))
    assert sender.connect(receiver) == frozenset()
    src = sender.computed(3, seed=2)
    sender.pool.transfer(1, src, ticket=receiver.ticket(3))
    assert receiver.ask("received") == [sender.pools.get(src)]
    assert sender.endpoint.stats()["in_place_sent"] == 0
    sender.pool.free_mem(src)
    sender.endpoint.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_killed_mid_transfer_fails_its_transfer_alone_and_leaks_nothing(receivers, transport):
    """Receiver 1 dies holding the sender's data message; receiver 2's transfer, queued
    behind it on the sender thread, goes through. shm: the sender sees the process gone
    at once; zmq: at its timeout."""
    sender = Sender(transport, timeout_s=3.0)
    receivers += [Receiver(1, transport), Receiver(2, transport)]
    for receiver in receivers:
        sender.connect(receiver)
    doomed, other = receivers
    dst = sender.pool.alloc_mem(4, instance=1, ticket=(ticket := doomed.ticket(4)))
    src, src2 = sender.computed(4, seed=3), sender.computed(4, seed=4)
    doomed.signal(signal.SIGSTOP)  # it will read nothing more
    lost = sender.endpoint.send_async(1, src, dst, 0, None, ticket)
    sent = sender.endpoint.send_async(2, src2, None, 0, None, other.ticket(4))
    time.sleep(0.3)
    assert not lost.done()
    doomed.signal(signal.SIGKILL)
    started = time.monotonic()
    error = settle(lost)
    assert isinstance(error, PeerGone if transport == "shm" else TransferError)
    assert time.monotonic() - started < (1.0 if transport == "shm" else 5.0)
    assert settle(sent) is None and other.ask("received") == [sender.pools.get(src2)]
    sender.pool.free_mem(src + src2)
    assert sender.used() == 0 and other.ask("used") == 0
    sender.endpoint.close()


def test_a_cancelled_in_place_transfer_holds_its_blocks_while_the_receiver_may_read(receivers):
    sender = Sender("shm")
    receivers.append(receiver := Receiver(1, "shm"))
    sender.connect(receiver)
    src = sender.computed(3, seed=5)
    for end in (signal.SIGCONT, signal.SIGKILL):
        dst = sender.pool.alloc_mem(3, instance=1, ticket=(ticket := receiver.ticket(3)))
        receiver.signal(signal.SIGSTOP)
        cancelled = threading.Event()
        future = sender.endpoint.send_async(1, src, dst, 0, None, ticket, cancelled=cancelled)
        time.sleep(0.2)
        cancelled.set()  # the request was aborted: the sender thread stops waiting ...
        time.sleep(0.3)
        assert not future.done()  # ... but the frozen receiver may still read the blocks
        receiver.signal(end)  # it reads them and answers, or dies: either way, they are free now
        assert isinstance(settle(future), TransferError)
        if end == signal.SIGCONT:
            assert receiver.ask("received") == [sender.pools.get(src)]
    # the sender thread was free meanwhile: a transfer to a live peer goes through
    receivers.append(other := Receiver(2, "shm"))
    sender.connect(other)
    assert sender.pool.transfer(2, src, ticket=other.ticket(3)) and other.ask("received") == [sender.pools.get(src)]
    sender.pool.free_mem(src)
    assert sender.used() == 0
    sender.endpoint.close()


def test_a_copy_after_the_senders_deadline_is_void(receivers):
    sender = Sender("shm", timeout_s=0.5)
    receivers.append(receiver := Receiver(1, "shm"))
    sender.connect(receiver)
    src = sender.computed(2, seed=6)
    dst = sender.pool.alloc_mem(2, instance=1, ticket=(ticket := receiver.ticket(2)))
    receiver.signal(signal.SIGSTOP)
    future = sender.endpoint.send_async(1, src, dst, 0, None, ticket)
    assert isinstance(settle(future), TransferError)  # timed out: past its deadline, the blocks are free
    sender.pool.free_mem(src)
    receiver.signal(signal.SIGCONT)  # it reads the message now, too late
    assert receiver.ask("received") == [] and receiver.ask("used") == 0
    sender.endpoint.close()


# ------------------------------------------------------------------ in one process

def test_pools_of_another_layout_are_not_mapped():
    aggregated = SharedKVPools(make_pools(TIERS, BLOCK))
    description = aggregated.describe()
    assert aggregated.open(description).tiers == {Tier.DEVICE}
    with pytest.raises(ValueError, match="the peer.s blocks are aggregated"):
        SharedKVPools(make_pools(TIERS, BLOCK, layout="layer-major")).open(description)
    with pytest.raises(RuntimeError, match="no KV pool"):
        SharedKVPools(make_pools(TIERS, BLOCK, "zmq")).describe()  # private memory


def test_process_and_host_identity():
    me = ProcessRef.current()
    assert me.alive() and not ProcessRef(me.pid, me.started + 1).alive()  # a reused pid is another process
    assert same_host(host_identity()) and not same_host("elsewhere/" + host_identity().split("/")[1])
    child = mp.get_context("spawn").Process(target=time.sleep, args=(30,))
    child.start()
    ref = ProcessRef.of(child.pid)
    assert ref.alive()
    child.kill()
    time.sleep(0.2)
    assert not ref.alive()  # a zombie until joined: gone all the same
    child.join()
    assert not ref.alive()
