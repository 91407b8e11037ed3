"""KV transfer between two real processes (MemServe §4.3), on both paths: zmq (the blocks
as frames, between numpy movers) and shm (real KV pools in shared memory, which the
receiver maps and copies the blocks out of; ZeroMQ carries the control messages)."""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from typing import Any

import pytest
import zmq
from helpers.kv_pools import TestPools, make_pools
from helpers.mempool import BS, NumpyBlockMover, prompt

from memserve.ipc.kv_transfer import KVAllocRequest, KVTransferEndpoint, TransferError
from memserve.ipc.messages import decode, encode
from memserve.kvcache.address import (
    Tier,
    addr_block,
    addr_instance,
    addr_tier,
    make_addr,
)
from memserve.kvcache.mempool import KVFlags, MemPool, MemPoolError
from memserve.workers.kv_share import SharedKVPools

SENDER, RECEIVER = 0, 1
TIERS = {Tier.DEVICE: 32, Tier.HOST: 16}
TRANSPORTS = ["zmq", "shm"]


def make_instance(instance: int, transport: str = "zmq") -> tuple[MemPool, NumpyBlockMover | TestPools,
                                                                   KVTransferEndpoint]:
    if transport == "zmq":
        mover: NumpyBlockMover | TestPools = NumpyBlockMover(TIERS, block_nbytes=4096)
        pool = MemPool(instance, TIERS, BS, mover=mover)
        return pool, mover, KVTransferEndpoint(pool, timeout_s=20)
    pools = make_pools(TIERS, BS)
    pool = MemPool(instance, TIERS, BS, mover=pools)
    return pool, pools, KVTransferEndpoint(pool, timeout_s=20, shared=SharedKVPools(pools))


def receiver_main(conn: Any, transport: str) -> None:
    """The other worker: serves its endpoint and answers the test's questions."""
    pool, mover, endpoint = make_instance(RECEIVER, transport)
    conn.send(endpoint.address)
    while True:
        endpoint.serve(timeout_ms=5)
        if not conn.poll():
            continue
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "connect":
            endpoint.connect(*args)
            conn.send(None)
        elif cmd == "expect":
            endpoint.expect(*args)
            conn.send(None)
        elif cmd == "match":
            addrs = pool.match(args[0], take_ref=False)
            conn.send((addrs, mover.get(addrs)))
        elif cmd == "read":
            conn.send(mover.get(args[0]))
        elif cmd == "received":
            received = endpoint.drain_received()
            for r in received:
                pool.free_mem(r.addrs)  # the engine would run the request, then free
            conn.send([(r.src_instance, r.addrs, r.tokens, r.private, r.inserted) for r in received])
        elif cmd == "stats":
            conn.send(pool.stats())
        elif cmd == "send_back":  # decode-phase KV back to the prefill instance
            tokens, first_block, seed, ticket = args
            addrs = pool.alloc_mem(len(tokens) // BS - first_block)
            mover.fill(Tier.DEVICE, [addr_block(a) for a in addrs], seed)
            data = mover.get(addrs)
            dst = pool.transfer_with_insert(SENDER, tokens, addrs, flags=KVFlags.RELEASE, first_block=first_block,
                                            ticket=ticket)
            pool.free_mem(addrs)
            conn.send((dst, data))
    endpoint.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def peer(request):
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child_conn, request.param), daemon=True)
    proc.start()
    pool, mover, endpoint = make_instance(SENDER, request.param)
    try:
        assert conn.poll(60), "receiver did not start"
        endpoint.connect(RECEIVER, conn.recv())
        peer = Peer(conn, pool, mover, endpoint)
        peer.ask("connect", SENDER, endpoint.address)
        # shm: the receiver maps both tiers, so every transfer here reads in place.
        assert endpoint.same_host_tiers(RECEIVER) == ({Tier.DEVICE, Tier.HOST} if request.param == "shm" else set())
        yield peer
        assert (endpoint.stats()["in_place_sent"] > 0) == (request.param == "shm")
        conn.send(("stop",))
        proc.join(10)
    finally:
        endpoint.close()
        if proc.is_alive():
            proc.kill()


class Peer:
    def __init__(self, conn, pool: MemPool, mover: NumpyBlockMover | TestPools, endpoint: KVTransferEndpoint) -> None:
        self.conn, self.pool, self.mover, self.endpoint = conn, pool, mover, endpoint

    def ask(self, *cmd: Any) -> Any:
        """Ask the receiver process something, serving our endpoint meanwhile."""
        self.conn.send(cmd)
        while not self.conn.poll():
            self.endpoint.serve(timeout_ms=5)
        return self.conn.recv()

    def ticket(self, max_blocks: int) -> str:
        """Announce a transfer of up to ``max_blocks`` to the receiver, as the gateway does."""
        ticket = secrets.token_hex(8)
        self.ask("expect", ticket, SENDER, max_blocks)
        return ticket

    def computed(self, n: int, seed: int, tier: Tier = Tier.DEVICE) -> list[int]:
        """``n`` held blocks whose KV is some model's output."""
        addrs = self.pool.alloc_mem(n, tier)
        self.mover.fill(tier, [addr_block(a) for a in addrs], seed)
        return addrs


def test_transfer_with_insert_lets_the_receiver_match_the_prompt(peer: Peer):
    tokens = prompt(1, 6) + [9, 9]  # six full blocks and a partial one
    src = peer.computed(7, seed=1)
    before = peer.ask("stats")
    dst = peer.pool.transfer_with_insert(RECEIVER, tokens, src, private={"request_id": "r1"}, ticket=peer.ticket(7))
    assert all(addr_instance(a) == RECEIVER and addr_tier(a) == Tier.DEVICE for a in dst)
    addrs, data = peer.ask("match", tokens)
    assert addrs == dst[:6]
    assert data == peer.mover.get(src[:6])
    [(src_instance, got, got_tokens, private, inserted)] = peer.ask("received")
    assert (src_instance, got, got_tokens, private, inserted) == (SENDER, dst, tokens, {"request_id": "r1"}, 6)
    after = peer.ask("stats")
    assert after["device"]["cached"] - before["device"]["cached"] == 6
    assert after["device"]["free"] == before["device"]["free"] - 6  # the partial block was freed
    peer.pool.free_mem(src)


def test_transfer_into_blocks_allocated_on_the_receiver_beforehand(peer: Peer):
    ticket = peer.ticket(3)
    dst = peer.pool.alloc_mem(3, Tier.HOST, instance=RECEIVER, ticket=ticket)
    assert all(addr_instance(a) == RECEIVER and addr_tier(a) == Tier.HOST for a in dst)
    src = peer.computed(2, seed=2) + peer.computed(1, seed=3, tier=Tier.HOST)  # partly swapped out
    assert peer.pool.transfer(RECEIVER, src, dst, private=["layer", 0], ticket=ticket) == dst
    assert peer.ask("read", dst) == peer.mover.get(src)
    [(_, got, tokens, private, inserted)] = peer.ask("received")
    assert (got, tokens, private, inserted) == (dst, None, ["layer", 0], 0)
    peer.pool.free_mem(src)


def test_incremental_transfer_extends_what_the_receiver_caches(peer: Peer):
    tokens = prompt(4, 5)
    src = peer.computed(5, seed=4)
    peer.pool.transfer_with_insert(RECEIVER, tokens[: 2 * BS], src[:2], flags=KVFlags.RELEASE | KVFlags.HOST,
                                   ticket=peer.ticket(2))
    peer.pool.transfer_with_insert(RECEIVER, tokens, src[2:], flags=KVFlags.RELEASE | KVFlags.HOST, first_block=2,
                                   ticket=peer.ticket(3))
    addrs, data = peer.ask("match", tokens)
    assert len(addrs) == 5 and data == peer.mover.get(src)
    assert peer.ask("received") == []  # RELEASE: nothing for the receiving engine to free
    peer.pool.free_mem(src)


def test_decode_instance_sends_its_kv_back_while_we_serve(peer: Peer):
    tokens = prompt(5, 2)
    src = peer.computed(2, seed=5)
    peer.pool.insert(tokens, src, KVFlags.RELEASE)
    longer = tokens + prompt(6, 3)
    ticket = secrets.token_hex(8)
    peer.endpoint.expect(ticket, RECEIVER, 3)
    dst, data = peer.ask("send_back", longer, 2, 6, ticket)
    hit = peer.pool.match(longer)
    assert hit == src + dst and peer.mover.get(dst) == data
    peer.pool.free_mem(hit)
    assert peer.pool.stats()["device"]["used"] == 0  # cached, held by nobody


def test_failed_transfers_raise_and_leak_nothing(peer: Peer):
    before = peer.ask("stats")
    too_many = peer.computed(20, seed=7) + peer.computed(13, seed=8, tier=Tier.HOST)  # receiver has 32
    with pytest.raises(TransferError, match="could not allocate 33 blocks"):
        peer.pool.transfer(RECEIVER, too_many, ticket=peer.ticket(33))
    with pytest.raises(TransferError, match="at most 32 blocks, not 33"):
        peer.pool.transfer(RECEIVER, too_many, ticket=peer.ticket(32))
    with pytest.raises(TransferError, match="no transfer from this instance is expected"):
        peer.pool.transfer(RECEIVER, too_many[:1], ticket="never-announced")
    not_allocated_there = [make_addr(RECEIVER, Tier.DEVICE, 0)]
    with pytest.raises(TransferError, match="not held"):
        peer.pool.transfer(RECEIVER, too_many[:1], not_allocated_there, ticket=peer.ticket(1))
    peer.pool.free_mem(too_many)
    with pytest.raises(MemPoolError, match="not held"):
        peer.pool.transfer(RECEIVER, too_many[:1], ticket=peer.ticket(1))
    with pytest.raises(MemPoolError, match="no transfer peer"):
        peer.pool.transfer(7, peer.computed(1, seed=9))
    assert peer.ask("stats") == before
    assert peer.ask("received") == []


def _ask(endpoint: KVTransferEndpoint, sock: zmq.Socket, msg: Any) -> Any:
    """Send ``msg`` from a stray socket and serve the endpoint until it answers."""
    sock.send(encode(msg))
    for _ in range(100):
        endpoint.serve(timeout_ms=20)
        if sock.poll(0):
            return decode(sock.recv())
    raise AssertionError("no answer")


@pytest.fixture
def stray() -> tuple[MemPool, KVTransferEndpoint, zmq.Socket]:
    """A receiver and a raw socket anyone on the machine could open to it."""
    pool, _, endpoint = make_instance(RECEIVER)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint.address)
    yield pool, endpoint, sock
    sock.close(linger=0)
    endpoint.close()


def test_garbage_on_the_socket_does_not_stop_serving(stray):
    _, endpoint, sock = stray
    sock.send(b"\x93not msgpack")
    sock.send(b"")
    endpoint.expect("t1", 9, 2)
    reply = _ask(endpoint, sock, KVAllocRequest(1, 9, 2, int(Tier.DEVICE), "t1"))
    assert reply.error is None and len(reply.addrs) == 2  # the garbage was skipped, the request answered


def test_unannounced_or_oversized_allocations_are_refused(stray):
    """One stray message once allocated nearly the whole pool for a fictitious peer."""
    pool, endpoint, sock = stray
    free = pool.stats()["device"]["free"]
    assert "no transfer" in _ask(endpoint, sock, KVAllocRequest(1, 9, 30, int(Tier.DEVICE))).error
    endpoint.expect("t1", SENDER, 4)
    assert "no transfer" in _ask(endpoint, sock, KVAllocRequest(2, 9, 4, int(Tier.DEVICE), "t1")).error
    assert "at most 4" in _ask(endpoint, sock, KVAllocRequest(3, SENDER, 30, int(Tier.DEVICE), "t1")).error
    assert pool.stats()["device"]["free"] == free
    assert len(_ask(endpoint, sock, KVAllocRequest(4, SENDER, 4, int(Tier.DEVICE), "t1")).addrs) == 4
    assert "no transfer" in _ask(endpoint, sock, KVAllocRequest(5, SENDER, 4, int(Tier.DEVICE), "t1")).error


def test_blocks_of_a_transfer_that_never_completes_are_reclaimed(stray):
    pool, endpoint, sock = stray
    free = pool.stats()["device"]["free"]
    endpoint.expect("t1", SENDER, 5, ttl_s=0.3)
    assert len(_ask(endpoint, sock, KVAllocRequest(1, SENDER, 5, int(Tier.DEVICE), "t1")).addrs) == 5
    assert pool.stats()["device"]["free"] == free - 5
    time.sleep(0.35)
    endpoint.serve(timeout_ms=0)
    assert pool.stats()["device"]["free"] == free
