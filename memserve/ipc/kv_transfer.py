"""KV transfer between instances over ZeroMQ (MemServe §4.3).

Each worker owns one ``KVTransferEndpoint``: a ROUTER socket that serves requests from
other instances, and one DEALER per peer for its own requests. The worker's event loop
calls ``serve()`` (or polls ``socket``) so peers are answered between engine steps.

A transfer is three steps:

1. allocation: the sender asks the receiver to ``alloc_mem`` (skipped when the sender
   passes ``dst``, e.g. blocks it allocated earlier with ``alloc_mem(instance=...)``);
2. transmission: one message whose first frame is a msgpack header and whose other
   frames are the blocks' bytes, one zero-copy frame per run of consecutive blocks; the
   receiver writes them into ``dst`` through its mover;
3. insertion (``transfer_with_insert``): the receiver indexes the blocks under the given
   tokens, then answers; the sender's call returns when that answer arrives.

Every transfer carries a *ticket* that the receiver was told to expect (``expect``: by
the gateway, which announces each transfer to its receiver before it asks the sender to
start). A receiver allocates only for a ticket it expects, from the instance named with
it, up to the number of blocks named with it, and writes a data message only into the
blocks allocated for its ticket; blocks allocated for a transfer that does not complete
within the ticket's lifetime are freed. A local process that reaches the socket can thus
neither drain the pool nor overwrite another request's KV.

Sending runs on the endpoint's own sender thread, which alone owns the peer sockets:
``send_async`` returns at once and the engine keeps stepping while a slow peer answers.
The blocking calls (``send``, ``allocate``: MemPool's synchronous API) keep serving the
endpoint's ROUTER while they wait, so two instances sending to each other at once do not
deadlock.

A by-layer transfer (MemServe §4.3, ``open_layers``) sends one message per layer while
the sender's prefill step computes the next: the blocks are allocated when it opens,
each ``KVLayer`` message carries one layer's K and V of every block (unanswered), and
the last layer's message completes the transfer as ``KVData`` does (insertion, answer).
The receiver writes each layer into the blocks allocated for the ticket as it arrives.

The receiver's engine collects
what arrived (addresses, tokens, the sender's ``private`` payload) with
``drain_received``; it then holds one reference on each received block, unless the
sender set ``KVFlags.RELEASE``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq

from memserve.ipc.curve import protect
from memserve.ipc.messages import decode, encode, register
from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.kvcache.mover import Buffer


class TransferError(MemPoolError):
    """A transfer failed at the receiver or timed out."""


# Seconds between checks, while waiting for an answer, whether a by-layer transfer was cancelled.
CANCEL_POLL_S = 0.05


@dataclass
class KVAllocRequest:
    kind: ClassVar[str] = "kv_alloc"
    transfer_id: int
    src_instance: int
    num_blocks: int
    tier: int
    ticket: str = ""


@dataclass
class KVAllocReply:
    kind: ClassVar[str] = "kv_alloc_reply"
    transfer_id: int
    addrs: list[int]
    error: str | None = None


@dataclass
class KVData:
    """Header of a data message; the block bytes follow as separate frames."""

    kind: ClassVar[str] = "kv_data"
    transfer_id: int
    src_instance: int
    dst: list[int]
    flags: int
    block_nbytes: int
    private: Any = None
    tokens: list[int] | None = None  # set by transfer_with_insert
    first_block: int = 0  # the blocks sent are blocks first_block.. of tokens
    ticket: str = ""
    cache_salt: str | None = None  # the tokens' request's: their blocks are named with it


@dataclass
class KVLayer:
    """Header of one layer of a by-layer transfer; layer ``layer``'s K and V of every
    block of ``dst`` follow as one frame. Unanswered, except the ``final`` message, which
    completes the transfer (the fields from ``flags`` on mean what they mean in ``KVData``)."""

    kind: ClassVar[str] = "kv_layer"
    transfer_id: int
    src_instance: int
    dst: list[int]
    layer: int
    num_layers: int
    ticket: str = ""
    final: bool = False
    flags: int = 0
    private: Any = None
    tokens: list[int] | None = None
    first_block: int = 0
    cache_salt: str | None = None


@dataclass
class KVDone:
    kind: ClassVar[str] = "kv_done"
    transfer_id: int
    inserted: int = 0
    error: str | None = None


for _cls in (KVAllocRequest, KVAllocReply, KVData, KVLayer, KVDone):
    register(_cls)


def split_frames(buffers: Sequence[Buffer], frame_nbytes: int) -> list[memoryview]:
    """Zero-copy pieces of ``frame_nbytes`` of each buffer, in order."""
    views = [memoryview(b).cast("B") for b in buffers]
    return [v[i : i + frame_nbytes] for v in views for i in range(0, len(v), frame_nbytes)]


@dataclass
class _Grant:
    """A transfer this receiver was told to expect, and the blocks allocated for it."""

    src_instance: int
    max_blocks: int
    deadline: float
    addrs: list[int] = field(default_factory=list)
    # The receiver's cached prefix, held for the transfer (incremental transfer): the
    # sent blocks continue it. Handed on with the received blocks, or freed.
    pinned: list[int] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)  # by-layer: the layers written so far
    error: str | None = None  # by-layer: why a layer could not be written (answered at the last)

    def blocks(self) -> list[int]:
        return self.pinned + self.addrs


@dataclass
class ReceivedKV:
    """Blocks another instance sent here, for the receiving engine."""

    src_instance: int
    addrs: list[int]  # the receiver's pinned prefix (if any), then the blocks sent
    tokens: list[int] | None
    private: Any
    inserted: int
    ticket: str = ""


class LayerStream:
    """The sender's side of one by-layer transfer. The engine thread calls ``send`` with
    each layer's bytes (a copy it owns) as its step computes them, and ``cancel`` when the
    request is gone; the endpoint's sender thread does the rest in order. ``future`` ends
    with the receiver's answer to the last layer (the blocks' addresses there)."""

    def __init__(self, endpoint: KVTransferEndpoint, instance: int, num_blocks: int, num_layers: int, ticket: str,
                 tokens: list[int] | None, first_block: int, clock: Callable[[], float] = time.monotonic,
                 cache_salt: str | None = None) -> None:
        self.endpoint = endpoint
        self.instance = instance
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.ticket = ticket
        self.tokens = tokens
        self.first_block = first_block
        self.cache_salt = cache_salt
        self.future: Future[list[int]] = Future()
        self.cancelled = threading.Event()
        self.dst: list[int] | None = None  # set by the sender thread once allocated
        self.handed = 0  # layers handed to the sender thread
        self.clock = clock
        self.first_layer_at: float | None = None
        self.done_at: float | None = None  # when it ended (the receiver's answer, or the failure)

    def send(self, layer: int, buffer: memoryview) -> None:
        """Queue layer ``layer`` (layers go in order; the last one completes the transfer)."""
        if self.first_layer_at is None:
            self.first_layer_at = self.clock()
        self.handed += 1
        self.endpoint._sender.submit(self.endpoint._send_layer, self, layer, buffer)

    def cancel(self, reason: str) -> None:
        """Fail the transfer: a wait for the receiver stops, no further layer goes out."""
        self.cancelled.set()
        self.endpoint._sender.submit(self.endpoint._settle, self, None, TransferError(reason))


class KVTransferEndpoint:
    """One worker's end of the KV transfer network, bound to ``pool``."""

    def __init__(
        self,
        pool: MemPool,
        bind: str = "tcp://127.0.0.1:*",
        context: zmq.Context | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        protect(self._server, bind, server=True)
        self._server.bind(bind)
        self.address: str = self._server.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[int, zmq.Socket] = {}
        self._received: list[ReceivedKV] = []
        self._grants: dict[str, _Grant] = {}
        self._ids = itertools.count(1)
        # Peer sockets live on this one thread: ZeroMQ sockets are not shared across threads.
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-send")
        pool.attach_transfer(self)

    @property
    def socket(self) -> zmq.Socket:
        """The serving socket, for the worker's poller: call ``serve()`` when readable."""
        return self._server

    def connect(self, instance: int, address: str) -> None:
        self._sender.submit(self._connect, instance, address)

    def _connect(self, instance: int, address: str) -> None:
        if instance in self._peers:
            self._peers.pop(instance).close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        protect(sock, address, server=False)
        sock.connect(address)
        self._peers[instance] = sock

    def close(self) -> None:
        self._sender.submit(self._close_peers).result()
        self._sender.shutdown()
        self._server.close(linger=0)

    def _close_peers(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()

    def expect(self, ticket: str, src_instance: int, max_blocks: int, ttl_s: float | None = None,
               pinned: list[int] | None = None) -> None:
        """Accept one transfer of at most ``max_blocks`` from ``src_instance`` under
        ``ticket`` within ``ttl_s`` (default: the endpoint's timeout). ``pinned``: held
        blocks of this pool that the transfer continues; the grant owns them now."""
        ttl = self.timeout_s if ttl_s is None else ttl_s
        self._grants[ticket] = _Grant(src_instance, max_blocks, time.monotonic() + ttl, pinned=list(pinned or []))

    def cancel(self, ticket: str) -> int:
        """Stop expecting ``ticket`` (its request was aborted): free what its grant holds;
        returns the number of blocks freed. A transfer under it arriving later is refused."""
        grant = self._grants.pop(ticket, None)
        if grant is None:
            return 0
        held = grant.blocks()
        if held:
            self.pool.free_mem(held)
        return len(held)

    def expected(self) -> set[str]:
        """The tickets still expected."""
        return set(self._grants)

    def reclaim_expired(self) -> int:
        """Forget expired tickets and free the blocks allocated for them; returns the
        number of blocks freed."""
        now = time.monotonic()
        freed = 0
        for ticket in [t for t, g in self._grants.items() if g.deadline <= now]:
            freed += self.cancel(ticket)
        return freed

    def drain_received(self) -> list[ReceivedKV]:
        received, self._received = self._received, []
        return received

    # ------------------------------------------------------------ sender side

    def allocate(self, instance: int, size: int, tier: Tier, ticket: str) -> list[int]:
        """``alloc_mem`` on another instance for the transfer ``ticket``; the blocks are
        handed to its engine once data is transferred into them."""
        return self._await(self._sender.submit(self._allocate, instance, size, tier, ticket))

    def send(self, instance: int, src: list[int], dst: Sequence[int] | None, flags: int, private: Any, ticket: str,
             tokens: list[int] | None = None, first_block: int = 0, cache_salt: str | None = None) -> list[int]:
        """Copy held blocks ``src`` to ``instance`` under ``ticket``; returns their
        addresses there."""
        return self._await(self.send_async(instance, src, dst, flags, private, ticket, tokens, first_block,
                                           cache_salt=cache_salt))

    def send_async(self, instance: int, src: list[int], dst: Sequence[int] | None, flags: int, private: Any,
                   ticket: str, tokens: list[int] | None = None, first_block: int = 0,
                   frame_nbytes: int | None = None,
                   cancelled: threading.Event | None = None, cache_salt: str | None = None) -> Future[list[int]]:
        """``send`` without waiting: the blocks' bytes are taken here (they must stay held
        until the future is done); allocation, sending and waiting for the receiver run on
        the sender thread, so the engine keeps stepping meanwhile. Frames are one per run
        of consecutive blocks, or pieces of ``frame_nbytes`` (MemServe's unaggregated
        by-request transfer: one network call per layer's K or V of each block). Setting
        ``cancelled`` gives up waiting for the receiver (a dead or frozen one would hold
        the sender thread, and the blocks, until the timeout). ``cache_salt``: the salt
        ``tokens``' blocks are named with (the receiver indexes them under it)."""
        self.pool.check_held(src, "transfer")
        if dst is not None and len(dst) != len(src):
            raise MemPoolError(f"transfer: {len(src)} source blocks but {len(dst)} destinations")
        buffers: Sequence[Buffer] = self.pool.read_blocks(src)
        if frame_nbytes:
            buffers = split_frames(buffers, frame_nbytes)
        return self._sender.submit(self._send, instance, len(src), dst, flags, private, ticket, tokens, first_block,
                                   buffers, cancelled, cache_salt)

    def open_layers(self, instance: int, num_blocks: int, num_layers: int, ticket: str,
                    tokens: list[int] | None = None, first_block: int = 0,
                    clock: Callable[[], float] = time.monotonic, cache_salt: str | None = None) -> LayerStream:
        """Start a by-layer transfer of ``num_blocks`` blocks to ``instance``: the receiver
        allocates them now, on the sender thread, while the sender's step is still ahead."""
        stream = LayerStream(self, instance, num_blocks, num_layers, ticket, tokens, first_block, clock, cache_salt)
        self._sender.submit(self._open_layers, stream)
        return stream

    def _await(self, future: Future) -> Any:
        """The result of a sender-thread job, serving incoming requests meanwhile (two
        instances sending to each other at once must not deadlock)."""
        while not future.done():
            self.serve(timeout_ms=2)
        return future.result()

    # The methods below run on the sender thread, the only one that touches peer sockets.

    def _allocate(self, instance: int, size: int, tier: Tier, ticket: str,
                  cancelled: threading.Event | None = None) -> list[int]:
        peer = self._peer(instance)
        tid = next(self._ids)
        peer.send(encode(KVAllocRequest(tid, self.pool.instance_id, size, int(tier), ticket)))
        reply = self._wait(peer, tid, cancelled)
        if reply.error:
            raise TransferError(f"instance {instance} could not allocate {size} blocks: {reply.error}")
        return list(reply.addrs)

    def _send(self, instance: int, num_blocks: int, dst: Sequence[int] | None, flags: int, private: Any, ticket: str,
              tokens: list[int] | None, first_block: int, buffers: Sequence[Buffer],
              cancelled: threading.Event | None = None, cache_salt: str | None = None) -> list[int]:
        if cancelled is not None and cancelled.is_set():
            raise TransferError(f"the transfer to instance {instance} was cancelled")
        peer = self._peer(instance)
        if dst is None:
            dst = self._allocate(instance, num_blocks, Tier.HOST if flags & KVFlags.HOST else Tier.DEVICE, ticket,
                                 cancelled)
        tid = next(self._ids)
        mover = self.pool.mover
        assert mover is not None  # send_async read the blocks through it
        header = KVData(tid, self.pool.instance_id, list(dst), int(flags), mover.block_nbytes,
                        private, tokens, first_block, ticket, cache_salt)
        # copy=False: the frames point into the mover's memory. They are safe to reuse
        # once the receiver answers, which means it has received every frame.
        peer.send_multipart([encode(header), *buffers], copy=False)
        done = self._wait(peer, tid, cancelled)
        if done.error:
            raise TransferError(f"transfer to instance {instance} failed: {done.error}")
        return list(dst)

    def _open_layers(self, stream: LayerStream) -> None:
        try:
            stream.dst = self._allocate(stream.instance, stream.num_blocks, Tier.DEVICE, stream.ticket,
                                        stream.cancelled)
        except Exception as exc:  # noqa: BLE001 - the transfer's failure, reported through its future
            self._settle(stream, None, exc)

    def _send_layer(self, stream: LayerStream, layer: int, buffer: memoryview) -> None:
        if stream.future.done() or stream.dst is None:
            return  # failed or cancelled: the receiver frees what it allocated
        final = layer == stream.num_layers - 1
        try:
            peer = self._peer(stream.instance)
            tid = next(self._ids)
            header = KVLayer(tid, self.pool.instance_id, stream.dst, layer, stream.num_layers, stream.ticket, final,
                             tokens=stream.tokens if final else None, first_block=stream.first_block,
                             cache_salt=stream.cache_salt if final else None)
            peer.send_multipart([encode(header), buffer], copy=False)  # the buffer is the stream's own copy
            if final:
                done = self._wait(peer, tid, stream.cancelled)
                if done.error:
                    raise TransferError(f"transfer to instance {stream.instance} failed: {done.error}")
                self._settle(stream, stream.dst, None)
        except Exception as exc:  # noqa: BLE001 - as above
            self._settle(stream, None, exc)

    @staticmethod
    def _settle(stream: LayerStream, result: list[int] | None, error: BaseException | None) -> None:
        """End a by-layer transfer (once: later outcomes are ignored); sender thread only."""
        if stream.future.done():
            return
        stream.done_at = stream.clock()
        if error is None:
            assert result is not None  # a transfer that went through has its blocks
            stream.future.set_result(result)
        else:
            stream.future.set_exception(error)

    def _peer(self, instance: int) -> zmq.Socket:
        sock = self._peers.get(instance)
        if sock is None:
            raise MemPoolError(f"no transfer peer for instance {instance}: call connect() first")
        return sock

    def _wait(self, peer: zmq.Socket, tid: int, cancelled: threading.Event | None = None) -> Any:
        """The reply to request ``tid`` (late answers to requests that timed out are
        skipped); gives up early once ``cancelled`` is set."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"no answer to transfer request {tid} within {self.timeout_s} s")
            if cancelled is not None:
                if cancelled.is_set():
                    raise TransferError(f"transfer request {tid} was cancelled")
                remaining = min(remaining, CANCEL_POLL_S)
            if peer.poll(int(remaining * 1000), zmq.POLLIN):  # whole ms, as pyzmq would round
                reply = decode(peer.recv())
                if reply.transfer_id == tid:
                    return reply

    # ---------------------------------------------------------- receiver side

    def serve(self, timeout_ms: int = 0) -> int:
        """Handle the requests waiting (waiting up to ``timeout_ms`` for the first);
        returns how many were handled."""
        self.reclaim_expired()
        handled = 0
        if not self._server.poll(timeout_ms, zmq.POLLIN):
            return 0
        while True:
            try:
                frames = self._server.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return handled
            try:
                identity, header, data = frames[0], decode(frames[1].bytes), frames[2:]
            except Exception:  # noqa: BLE001 - garbage from a peer must not stop the worker
                continue
            if isinstance(header, KVAllocRequest):
                reply: Any = self._on_alloc(header)
            elif isinstance(header, KVData):
                reply = self._on_data(header, data)
            elif isinstance(header, KVLayer):
                reply = self._on_layer(header, data)
                if reply is None:  # a layer on its way: no answer
                    handled += 1
                    continue
            else:
                continue
            self._server.send_multipart([identity, encode(reply)])
            handled += 1

    def _on_alloc(self, req: KVAllocRequest) -> KVAllocReply:
        grant = self._grants.get(req.ticket)
        if grant is None or grant.src_instance != req.src_instance or grant.addrs:
            return KVAllocReply(req.transfer_id, [], "no transfer from this instance is expected under this ticket")
        if req.num_blocks > grant.max_blocks:
            return KVAllocReply(req.transfer_id, [], f"the transfer was announced for at most {grant.max_blocks} "
                                                     f"blocks, not {req.num_blocks}")
        try:
            grant.addrs = self.pool.alloc_mem(req.num_blocks, Tier(req.tier))
        except (MemPoolError, ValueError) as e:
            return KVAllocReply(req.transfer_id, [], str(e))
        return KVAllocReply(req.transfer_id, grant.addrs)

    def _on_data(self, msg: KVData, frames: list[zmq.Frame]) -> KVDone:
        pool = self.pool
        grant = self._grants.get(msg.ticket)
        if grant is None or grant.src_instance != msg.src_instance or not grant.addrs or list(msg.dst) != grant.addrs:
            return KVDone(msg.transfer_id, error="not held: the blocks were not allocated for this transfer's ticket")
        del self._grants[msg.ticket]
        pinned = grant.pinned
        try:
            buffers = [f.buffer for f in frames]
            nbytes = sum(len(b) for b in buffers)
            mover = pool.mover
            if mover is None or msg.block_nbytes != mover.block_nbytes or nbytes != len(msg.dst) * msg.block_nbytes:
                raise MemPoolError(
                    f"block layout mismatch: sender {msg.block_nbytes} B/block, {nbytes} B for {len(msg.dst)} blocks; "
                    f"receiver {mover.block_nbytes if mover else 'no mover'} B/block"
                )
            pool.write_blocks(msg.dst, buffers)
        except Exception as e:  # noqa: BLE001 - any failure is the sender's answer, not our crash
            pool.free_mem(pinned + msg.dst)
            return KVDone(msg.transfer_id, error=f"{type(e).__name__}: {e}")
        return self._deliver(msg, pinned)

    def _on_layer(self, msg: KVLayer, frames: list[zmq.Frame]) -> KVDone | None:
        """Write one layer into the blocks allocated for the ticket; the last layer's
        message completes the transfer (or answers the first error met on the way)."""
        grant = self._grants.get(msg.ticket)
        if grant is None or grant.src_instance != msg.src_instance or not grant.addrs or list(msg.dst) != grant.addrs:
            return KVDone(msg.transfer_id, error="not held: the blocks were not allocated for this transfer's "
                                                 "ticket") if msg.final else None
        if grant.error is None:
            try:
                tiers = {addr_tier(a) for a in msg.dst}
                mover = self.pool.mover
                if len(frames) != 1 or len(tiers) != 1 or mover is None or not hasattr(mover, "write_layer"):
                    raise MemPoolError("a by-layer message holds one frame for blocks of one tier of a runner's pool")
                mover.write_layer(Tier(tiers.pop()), [addr_block(a) for a in msg.dst], msg.layer, frames[0].buffer)
                grant.layers.add(msg.layer)
            except Exception as e:  # noqa: BLE001 - answered with the last layer
                grant.error = f"{type(e).__name__}: {e}"
        if not msg.final:
            return None
        del self._grants[msg.ticket]
        missing = msg.num_layers - len(grant.layers)
        error = grant.error or (f"{missing} of {msg.num_layers} layers did not arrive" if missing else None)
        if error is not None:
            self.pool.free_mem(grant.pinned + msg.dst)
            return KVDone(msg.transfer_id, error=error)
        return self._deliver(msg, grant.pinned)

    def _deliver(self, msg: KVData | KVLayer, pinned: list[int]) -> KVDone:
        """The blocks of a complete transfer: indexed (``transfer_with_insert``), then
        handed to the engine or, with ``KVFlags.RELEASE``, left to the index."""
        pool = self.pool
        try:
            tokens = msg.tokens
            inserted = (insert_received(pool, tokens, msg.first_block, msg.dst, msg.cache_salt)
                        if tokens is not None else 0)
        except Exception as e:  # noqa: BLE001 - as in _on_data
            pool.free_mem(pinned + msg.dst)
            return KVDone(msg.transfer_id, error=f"{type(e).__name__}: {e}")
        if msg.flags & KVFlags.RELEASE:
            pool.free_mem(pinned + msg.dst)
        else:
            self._received.append(ReceivedKV(msg.src_instance, pinned + msg.dst, msg.tokens, msg.private, inserted,
                                             msg.ticket))
        return KVDone(msg.transfer_id, inserted)


def insert_received(pool: MemPool, tokens: list[int], first_block: int, addrs: list[int],
                    cache_salt: str | None = None) -> int:
    """The insertion step of ``transfer_with_insert`` at the receiver: index the received
    blocks ``addrs`` (blocks ``first_block..`` of ``tokens``) after the prefix this
    instance already caches; returns the blocks indexed (shared with the simulator).
    ``cache_salt``: the salt the sender named the blocks with (the names must agree)."""
    hashes = block_hashes(tokens, pool.block_size, salt=cache_salt)
    prefix = pool.match((), take_ref=False, hashes=hashes[:first_block]) if first_block else []
    if len(prefix) < first_block:
        return 0  # the prefix was evicted here meanwhile: nothing to hang the blocks on
    return pool.insert(tokens, prefix + addrs, hashes=hashes)
