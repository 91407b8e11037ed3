"""KV transfer between instances over ZeroMQ, or in place between workers on one host
(MemServe §4.3).

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

Same-host peers (``same_host.py``). An endpoint given ``shared`` (its worker's pools, as
peers map them) opens each connection with a ``KVShare``: its pools' description, host
identity and process. A receiver on the same host maps those pools and answers which
tiers it mapped; from then on a transfer whose blocks all sit in mapped tiers sends no
frames: its ``KVData`` (or each ``KVLayer``) names the sender's blocks (``src``), and the
receiver copies them out of the mapped pool into the blocks of its grant, then answers as
before. ZeroMQ carries the handshake, the allocation, the headers and the answers; a peer
that cannot map (another host, the transport off at either end) gets frames.

A receiver reads the sender's blocks after the message left the sender, so:

- the sender holds them until the receiver answered, or its process is gone, or the
  message's ``read_by`` deadline passed: a transfer cancelled in between *lingers*, its
  future not done (the caller still holds the blocks) until one of those happens. Only
  the message that completes a transfer lingers: a by-layer transfer cancelled before its
  last layer went out is never delivered, so what its earlier layers read is never used;
- the receiver copies only over the connection whose ``KVShare`` it mapped, and voids a
  copy that ended after ``read_by`` (answered as failed, its blocks freed), so it never
  delivers blocks read after the sender let them go.

A sender whose handshake named the peer's process fails a transfer as soon as that
process is gone (``PeerGone``) instead of at the timeout: nothing it held is read again.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq

from memserve.ipc.curve import protect
from memserve.ipc.messages import decode, encode, register
from memserve.ipc.same_host import (
    MappedPeer,
    ProcessRef,
    SharedPools,
    host_identity,
    same_host,
)
from memserve.kvcache.address import Tier, addr_block, addr_tier, make_addrs
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.kvcache.mover import Buffer

log = logging.getLogger("memserve.kv_transfer")


class TransferError(MemPoolError):
    """A transfer failed at the receiver or timed out."""


class PeerGone(TransferError):
    """The receiver's process is gone: it reads none of the sender's blocks any more."""


# Seconds between checks, while waiting for an answer, whether a transfer was cancelled or
# its receiver's process is gone; also between the sender thread's rounds (``_tend``) over
# lingering transfers and unanswered handshakes.
CANCEL_POLL_S = 0.05
# Seconds between a receiver's checks that the senders whose pools it maps still run.
PEER_CHECK_S = 1.0


@dataclass
class KVShare:
    """First message of a connection from an endpoint with ``shared`` pools: their
    description for the receiver to map, with what shows it is on the same host."""

    kind: ClassVar[str] = "kv_share"
    transfer_id: int
    src_instance: int
    host: str  # same_host.host_identity()
    pid: int
    started: int  # the sender's ProcessRef
    clock: float  # the sender's monotonic clock when it sent this
    pools: dict[str, Any]


@dataclass
class KVShareReply:
    kind: ClassVar[str] = "kv_share_reply"
    transfer_id: int
    tiers: list[int]  # the sender's tiers mapped here (none: frames only)
    pid: int = 0  # the receiver's ProcessRef, on the same host only
    started: int = 0
    error: str | None = None  # why nothing was mapped


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
    # Same host: the sender's blocks, read by the receiver from its mapping of the sender's
    # pool (no frames follow), no later than ``read_by`` (the host's monotonic clock).
    src: list[int] | None = None
    read_by: float = 0.0


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
    src: list[int] | None = None  # as in ``KVData``: this layer of the sender's blocks, read in place
    read_by: float = 0.0


@dataclass
class KVDone:
    kind: ClassVar[str] = "kv_done"
    transfer_id: int
    inserted: int = 0
    error: str | None = None


for _cls in (KVShare, KVShareReply, KVAllocRequest, KVAllocReply, KVData, KVLayer, KVDone):
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


@dataclass(eq=False)
class _Link:
    """The sender's connection to one peer."""

    instance: int
    sock: zmq.Socket
    share_tid: int = 0  # the request id of the unanswered KVShare
    tiers: frozenset[int] = frozenset()  # the tiers the peer mapped: their blocks go in place
    process: ProcessRef | None = None  # the peer's process, when its handshake answer named it


@dataclass
class _Lingering:
    """An in-place transfer the sender gave up on while its receiver may still read the
    sender's blocks: ``fail(error)`` settles it once it cannot."""

    link: _Link
    read_by: float
    fail: Callable[[BaseException], None]
    error: BaseException


@dataclass
class _Mapped:
    """A sender's pools mapped by this receiver, read only for messages that come over the
    connection (``identity``) whose ``KVShare`` mapped them."""

    identity: bytes
    peer: MappedPeer
    process: ProcessRef


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
    each layer's bytes (a copy it owns) as its step computes them or, ``in_place`` (the
    receiver maps this worker's device pool), ``send_blocks`` with the blocks holding the
    layer, and ``cancel`` when the request is gone; the endpoint's sender thread does the
    rest in order. ``future`` ends with the receiver's answer to the last layer (the
    blocks' addresses there); in place, the caller holds the blocks until it is done."""

    def __init__(self, endpoint: KVTransferEndpoint, instance: int, num_blocks: int, num_layers: int, ticket: str,
                 tokens: list[int] | None, first_block: int, clock: Callable[[], float] = time.monotonic,
                 cache_salt: str | None = None, in_place: bool = False) -> None:
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
        self.in_place = in_place
        self.reading = False  # the last layer went in place: the receiver may be reading the blocks

    def send(self, layer: int, buffer: memoryview) -> None:
        """Queue layer ``layer`` (layers go in order; the last one completes the transfer)."""
        self._hand(layer, buffer)

    def send_blocks(self, layer: int, blocks: list[int]) -> None:
        """In place: layer ``layer`` of this worker's device ``blocks`` is computed; the
        receiver reads it from the pool (``send``'s order and completion)."""
        shared = self.endpoint.shared
        assert shared is not None  # in place only where this worker's pools are shared
        shared.publish()
        self._hand(layer, make_addrs(self.endpoint.pool.instance_id, Tier.DEVICE, blocks))

    def _hand(self, layer: int, payload: memoryview | list[int]) -> None:
        if self.first_layer_at is None:
            self.first_layer_at = self.clock()
        self.handed += 1
        self.endpoint._sender.submit(self.endpoint._send_layer, self, layer, payload)

    def cancel(self, reason: str) -> None:
        """Fail the transfer: a wait for the receiver stops, no further layer goes out (a
        last layer sent in place lingers: see the module docstring)."""
        self.cancelled.set()
        self.endpoint._sender.submit(self.endpoint._cancel_stream, self, TransferError(reason))


class KVTransferEndpoint:
    """One worker's end of the KV transfer network, bound to ``pool``; ``shared``: the
    worker's pools as same-host peers map them (None: frames to every peer)."""

    def __init__(
        self,
        pool: MemPool,
        bind: str = "tcp://127.0.0.1:*",
        context: zmq.Context | None = None,
        timeout_s: float = 30.0,
        shared: SharedPools | None = None,
    ) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.shared = shared
        self._ctx = context or zmq.Context.instance()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        protect(self._server, bind, server=True)
        self._server.bind(bind)
        self.address: str = self._server.getsockopt_string(zmq.LAST_ENDPOINT)
        self._me = ProcessRef.current()
        self._peers: dict[int, _Link] = {}
        self._lingering: dict[int, _Lingering] = {}  # request id -> transfer; sender thread only
        self._tend_timer: threading.Timer | None = None  # submits the next ``_tend``; sender thread only
        self._mapped: dict[int, _Mapped] = {}  # sender instance -> its pools mapped here
        self._next_peer_check = 0.0
        self._received: list[ReceivedKV] = []
        self._grants: dict[str, _Grant] = {}
        self._ids = itertools.count(1)
        self.counts = {"in_place_sent": 0, "in_place_received": 0}
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
            self._peers.pop(instance).sock.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        protect(sock, address, server=False)
        sock.connect(address)
        link = self._peers[instance] = _Link(instance, sock)
        if self.shared is None:
            return
        try:
            pools = self.shared.describe()
        except Exception as exc:  # noqa: BLE001 - nothing to map: frames it is
            log.info("KV pools not shared with instance %d (%s: %s)", instance, type(exc).__name__, exc)
            return
        link.share_tid = next(self._ids)
        sock.send(encode(KVShare(link.share_tid, self.pool.instance_id, host_identity(), self._me.pid,
                                 self._me.started, time.monotonic(), pools)))
        self._schedule_tend()

    def close(self) -> None:
        self._sender.submit(self._close_peers).result()
        self._sender.shutdown()
        self._server.close(linger=0)
        for mapped in self._mapped.values():
            mapped.peer.close()
        self._mapped.clear()

    def _close_peers(self) -> None:
        if self._tend_timer is not None:
            self._tend_timer.cancel()
        for tid in list(self._lingering):
            self._lingering.pop(tid).fail(TransferError("the transfer endpoint was closed"))
        for link in self._peers.values():
            link.sock.close(linger=0)
        self._peers.clear()

    def same_host_tiers(self, instance: int) -> frozenset[int]:
        """This worker's tiers whose blocks go to ``instance`` in place, once the
        connection's handshake is answered (waited for here)."""
        return self._await(self._sender.submit(lambda: self._link(instance).tiers))

    def stats(self) -> dict[str, int]:
        """Transfers sent and received in place (same host) so far."""
        return dict(self.counts)

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
        """``send`` without waiting: the blocks' bytes are taken here, or read in place by
        a same-host receiver (they must stay held until the future is done); allocation,
        sending and waiting for the receiver run on the sender thread, so the engine keeps
        stepping meanwhile. Frames are one per run of consecutive blocks, or pieces of
        ``frame_nbytes`` (MemServe's unaggregated by-request transfer: one network call
        per layer's K or V of each block). Setting ``cancelled`` gives up waiting for the
        receiver (a dead or frozen one would hold the sender thread, and the blocks, until
        the timeout); in place, the future then ends once the receiver cannot read the
        blocks any more. ``cache_salt``: the salt ``tokens``' blocks are named with (the
        receiver indexes them under it)."""
        self.pool.check_held(src, "transfer")
        if dst is not None and len(dst) != len(src):
            raise MemPoolError(f"transfer: {len(src)} source blocks but {len(dst)} destinations")
        tiers = self._mapped_tiers(instance)
        in_place = bool(tiers) and all(addr_tier(a) in tiers for a in src)
        buffers: Sequence[Buffer] = ()
        if in_place:
            assert self.shared is not None  # only an endpoint that shares has mapped tiers
            self.shared.publish()
            self.counts["in_place_sent"] += 1
        else:
            buffers = self.pool.read_blocks(src)
            if frame_nbytes:
                buffers = split_frames(buffers, frame_nbytes)
        future: Future[list[int]] = Future()
        self._sender.submit(self._send, future, instance, list(src) if in_place else None, len(src), dst, flags,
                            private, ticket, tokens, first_block, buffers, cancelled, cache_salt)
        return future

    def open_layers(self, instance: int, num_blocks: int, num_layers: int, ticket: str,
                    tokens: list[int] | None = None, first_block: int = 0,
                    clock: Callable[[], float] = time.monotonic, cache_salt: str | None = None) -> LayerStream:
        """Start a by-layer transfer of ``num_blocks`` blocks to ``instance``: the receiver
        allocates them now, on the sender thread, while the sender's step is still ahead.
        In place when the receiver maps this worker's device pool."""
        in_place = Tier.DEVICE in self._mapped_tiers(instance)
        if in_place:
            self.counts["in_place_sent"] += 1
        stream = LayerStream(self, instance, num_blocks, num_layers, ticket, tokens, first_block, clock, cache_salt,
                             in_place)
        self._sender.submit(self._open_layers, stream)
        return stream

    def _mapped_tiers(self, instance: int) -> frozenset[int]:
        """The tiers ``instance`` maps, as known now (none while its handshake is unanswered)."""
        link = self._peers.get(instance)  # the sender thread's: one read of a dict and a field
        return link.tiers if link is not None else frozenset()

    def _await(self, future: Future) -> Any:
        """The result of a sender-thread job, serving incoming requests meanwhile (two
        instances sending to each other at once must not deadlock)."""
        while not future.done():
            self.serve(timeout_ms=2)
        return future.result()

    # The methods below run on the sender thread, the only one that touches peer sockets.

    def _link(self, instance: int, cancelled: threading.Event | None = None) -> _Link:
        """The connection to ``instance``, its handshake answered (waited for here; a
        handshake that fails leaves the link to frames)."""
        link = self._peers.get(instance)
        if link is None:
            raise MemPoolError(f"no transfer peer for instance {instance}: call connect() first")
        if link.share_tid:
            try:
                self._wait(link, link.share_tid, cancelled)
            except TransferError:
                if cancelled is None or not cancelled.is_set():
                    link.share_tid = 0
                raise
        return link

    def _allocate(self, instance: int, size: int, tier: Tier, ticket: str,
                  cancelled: threading.Event | None = None) -> list[int]:
        link = self._link(instance, cancelled)
        tid = next(self._ids)
        link.sock.send(encode(KVAllocRequest(tid, self.pool.instance_id, size, int(tier), ticket)))
        reply = self._wait(link, tid, cancelled)
        if reply.error:
            raise TransferError(f"instance {instance} could not allocate {size} blocks: {reply.error}")
        return list(reply.addrs)

    def _send(self, future: Future[list[int]], instance: int, src: list[int] | None, num_blocks: int,
              dst: Sequence[int] | None, flags: int, private: Any, ticket: str, tokens: list[int] | None,
              first_block: int, buffers: Sequence[Buffer], cancelled: threading.Event | None,
              cache_salt: str | None) -> None:
        """Send a transfer and settle ``future``; ``src``: the blocks, read in place (no
        ``buffers``)."""
        try:
            if cancelled is not None and cancelled.is_set():
                raise TransferError(f"the transfer to instance {instance} was cancelled")
            link = self._link(instance, cancelled)
            if src is not None and not {addr_tier(a) for a in src} <= link.tiers:
                raise TransferError(f"instance {instance} reconnected: it no longer maps this pool")
            if dst is None:
                dst = self._allocate(instance, num_blocks, Tier.HOST if flags & KVFlags.HOST else Tier.DEVICE,
                                     ticket, cancelled)
            tid = next(self._ids)
            mover = self.pool.mover
            assert mover is not None  # send_async checked the blocks through it
            read_by = time.monotonic() + self.timeout_s if src is not None else 0.0
            header = KVData(tid, self.pool.instance_id, list(dst), int(flags), mover.block_nbytes,
                            private, tokens, first_block, ticket, cache_salt, src, read_by)
            # copy=False: the frames point into the mover's memory. They are safe to reuse
            # once the receiver answers, which means it has received every frame.
            link.sock.send_multipart([encode(header), *buffers], copy=False)
            try:
                done = self._wait(link, tid, cancelled)
            except TransferError as exc:
                if src is not None and self._linger(tid, link, read_by, future.set_exception, exc):
                    return
                raise
            if done.error:
                raise TransferError(f"transfer to instance {instance} failed: {done.error}")
            future.set_result(list(dst))
        except Exception as exc:  # noqa: BLE001 - the transfer's failure, reported through its future
            future.set_exception(exc)

    def _open_layers(self, stream: LayerStream) -> None:
        try:
            stream.dst = self._allocate(stream.instance, stream.num_blocks, Tier.DEVICE, stream.ticket,
                                        stream.cancelled)
        except Exception as exc:  # noqa: BLE001 - the transfer's failure, reported through its future
            self._settle(stream, None, exc)

    def _send_layer(self, stream: LayerStream, layer: int, payload: memoryview | list[int]) -> None:
        """Send one layer: its bytes, or (a list) the sender's blocks to read it from."""
        if stream.future.done() or stream.dst is None:
            return  # failed or cancelled: the receiver frees what it allocated
        final = layer == stream.num_layers - 1
        src, frames = (payload, []) if isinstance(payload, list) else (None, [payload])
        try:
            link = self._link(stream.instance)
            if src is not None and Tier.DEVICE not in link.tiers:
                raise TransferError(f"instance {stream.instance} reconnected: it no longer maps this pool")
            tid = next(self._ids)
            read_by = time.monotonic() + self.timeout_s if src is not None else 0.0
            header = KVLayer(tid, self.pool.instance_id, stream.dst, layer, stream.num_layers, stream.ticket, final,
                             tokens=stream.tokens if final else None, first_block=stream.first_block,
                             cache_salt=stream.cache_salt if final else None, src=src, read_by=read_by)
            link.sock.send_multipart([encode(header), *frames], copy=False)  # a frame is the stream's own copy
            if final:
                stream.reading = src is not None
                try:
                    done = self._wait(link, tid, stream.cancelled)
                except TransferError as exc:
                    if src is not None and self._linger(tid, link, read_by,
                                                        lambda e: self._settle(stream, None, e), exc):
                        return
                    raise
                if done.error:
                    raise TransferError(f"transfer to instance {stream.instance} failed: {done.error}")
                self._settle(stream, stream.dst, None)
        except Exception as exc:  # noqa: BLE001 - as above
            self._settle(stream, None, exc)

    def _cancel_stream(self, stream: LayerStream, error: TransferError) -> None:
        """``LayerStream.cancel``: fail the stream, unless its last layer lingers."""
        if not stream.reading:
            self._settle(stream, None, error)

    @staticmethod
    def _settle(stream: LayerStream, result: list[int] | None, error: BaseException | None) -> None:
        """End a by-layer transfer (once: later outcomes are ignored); sender thread only."""
        stream.reading = False
        if stream.future.done():
            return
        stream.done_at = stream.clock()
        if error is None:
            assert result is not None  # a transfer that went through has its blocks
            stream.future.set_result(result)
        else:
            stream.future.set_exception(error)

    def _linger(self, tid: int, link: _Link, read_by: float, fail: Callable[[BaseException], None],
                error: TransferError) -> bool:
        """Keep an in-place transfer given up on (``error``) unsettled while its receiver
        may still read the blocks; False when it cannot any more."""
        if isinstance(error, PeerGone) or time.monotonic() > read_by:
            return False
        self._lingering[tid] = _Lingering(link, read_by, fail, error)
        self._schedule_tend()
        return True

    def _schedule_tend(self) -> None:
        """Have ``_tend`` run on this thread in ``CANCEL_POLL_S`` (one pending at a time)."""
        if self._tend_timer is None:
            self._tend_timer = threading.Timer(CANCEL_POLL_S, self._submit_tend)
            self._tend_timer.daemon = True
            self._tend_timer.start()

    def _submit_tend(self) -> None:
        """The timer's job (its own thread)."""
        try:
            self._sender.submit(self._tend)
        except RuntimeError:  # the endpoint closed meanwhile
            pass

    def _tend(self) -> None:
        """Read the answers waiting on links with an unanswered handshake or a lingering
        transfer, and settle lingering transfers whose receiver is gone or whose deadline
        passed; again in ``CANCEL_POLL_S`` while there are any."""
        self._tend_timer = None
        links = [link for link in self._peers.values() if link.share_tid]
        links += [x.link for x in self._lingering.values() if x.link not in links]
        for link in links:
            while not link.sock.closed and link.sock.poll(0, zmq.POLLIN):
                self._take(link)
        now = time.monotonic()
        for tid, lingering in list(self._lingering.items()):
            process = lingering.link.process
            if now > lingering.read_by or process is None or not process.alive():
                del self._lingering[tid]
                lingering.fail(lingering.error)
        if self._lingering or any(link.share_tid for link in self._peers.values()):
            self._schedule_tend()

    def _take(self, link: _Link) -> Any:
        """One reply from ``link``. A handshake's answer sets the link up; an answer to a
        lingering transfer settles it."""
        reply = decode(link.sock.recv())
        if isinstance(reply, KVShareReply) and reply.transfer_id == link.share_tid:
            link.share_tid = 0
            peer = ProcessRef(reply.pid, reply.started)
            if reply.pid and peer.alive():
                link.process = peer
            if reply.error is None and link.process is not None:
                link.tiers = frozenset(reply.tiers)
            else:
                log.info("KV transfers to instance %d go as frames: %s", link.instance,
                         reply.error or "its process is not visible here")
        lingering = self._lingering.pop(reply.transfer_id, None)
        if lingering is not None:
            lingering.fail(lingering.error)
        return reply

    def _wait(self, link: _Link, tid: int, cancelled: threading.Event | None = None) -> Any:
        """The reply to request ``tid`` (late answers to requests that timed out are
        skipped); gives up early once ``cancelled`` is set or the peer's process is gone."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"no answer to transfer request {tid} within {self.timeout_s} s")
            if cancelled is not None:
                if cancelled.is_set():
                    raise TransferError(f"transfer request {tid} was cancelled")
                remaining = min(remaining, CANCEL_POLL_S)
            if link.process is not None:
                if not link.process.alive():
                    raise PeerGone(f"the receiver of transfer request {tid} (pid {link.process.pid}) is gone")
                remaining = min(remaining, CANCEL_POLL_S)
            if link.sock.poll(int(remaining * 1000), zmq.POLLIN):  # whole ms, as pyzmq would round
                reply = self._take(link)
                if reply.transfer_id == tid:
                    return reply

    # ---------------------------------------------------------- receiver side

    def serve(self, timeout_ms: int = 0) -> int:
        """Handle the requests waiting (waiting up to ``timeout_ms`` for the first);
        returns how many were handled."""
        self.reclaim_expired()
        now = time.monotonic()
        if self._mapped and now >= self._next_peer_check:
            self._next_peer_check = now + PEER_CHECK_S
            self._unmap_dead()
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
                reply = self._on_data(header, data, identity.bytes)
            elif isinstance(header, KVLayer):
                reply = self._on_layer(header, data, identity.bytes)
                if reply is None:  # a layer on its way: no answer
                    handled += 1
                    continue
            elif isinstance(header, KVShare):
                reply = self._on_share(header, identity.bytes)
            else:
                continue
            self._server.send_multipart([identity, encode(reply)])
            handled += 1

    def _on_share(self, msg: KVShare, identity: bytes) -> KVShareReply:
        """Map a same-host sender's pools for the transfers that come over this connection."""
        if not same_host(msg.host):
            return KVShareReply(msg.transfer_id, [], error="the sender is on another host")
        sender = ProcessRef(msg.pid, msg.started)
        refused = None
        if self.shared is None:
            refused = "the same-host transport is off here"
        elif not sender.alive():
            refused = "the sender's process is not visible here (another pid namespace)"
        elif not 0 <= time.monotonic() - msg.clock < self.timeout_s:
            refused = "the monotonic clocks differ (another time namespace)"
        else:
            try:
                peer = self.shared.open(msg.pools)
            except Exception as e:  # noqa: BLE001 - frames for this sender, not our crash
                refused = f"its pools cannot be mapped here: {type(e).__name__}: {e}"
        if refused is not None:
            return KVShareReply(msg.transfer_id, [], self._me.pid, self._me.started, refused)
        old = self._mapped.pop(msg.src_instance, None)
        if old is not None:
            old.peer.close()
        self._mapped[msg.src_instance] = _Mapped(identity, peer, sender)
        return KVShareReply(msg.transfer_id, sorted(peer.tiers), self._me.pid, self._me.started)

    def _unmap_dead(self) -> None:
        """Unmap the pools of senders whose process is gone (their memory goes with them)."""
        for instance in [i for i, m in self._mapped.items() if not m.process.alive()]:
            self._mapped.pop(instance).peer.close()

    def _copy_in(self, msg: KVData | KVLayer, identity: bytes, layer: int | None) -> None:
        """Copy the sender's blocks ``msg.src`` (every layer, or ``layer``) into ``msg.dst``
        from the sender's pools mapped over this connection, by the sender's deadline."""
        mapped = self._mapped.get(msg.src_instance)
        if mapped is None or mapped.identity != identity:
            raise MemPoolError("no pool of the sender is mapped over this connection")
        assert msg.src is not None  # an in-place message
        if len(msg.src) != len(msg.dst):
            raise MemPoolError(f"{len(msg.src)} source blocks for {len(msg.dst)} destinations")
        self.pool.check_held(msg.dst, "transfer")
        if time.monotonic() > msg.read_by:
            raise TransferError("the sender's read deadline passed before the copy")
        mapped.peer.copy_in(list(msg.src), list(msg.dst), layer)
        if time.monotonic() > msg.read_by:  # the sender may have reused its blocks meanwhile
            raise TransferError("the copy ended after the sender's read deadline")

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

    def _on_data(self, msg: KVData, frames: list[zmq.Frame], identity: bytes) -> KVDone:
        pool = self.pool
        grant = self._grants.get(msg.ticket)
        if grant is None or grant.src_instance != msg.src_instance or not grant.addrs or list(msg.dst) != grant.addrs:
            return KVDone(msg.transfer_id, error="not held: the blocks were not allocated for this transfer's ticket")
        del self._grants[msg.ticket]
        pinned = grant.pinned
        try:
            mover = pool.mover
            if mover is None or msg.block_nbytes != mover.block_nbytes:
                raise MemPoolError(f"block layout mismatch: sender {msg.block_nbytes} B/block, receiver "
                                   f"{mover.block_nbytes if mover else 'no mover'} B/block (the workers must share "
                                   f"the model, --dtype, --kv-cache-dtype, --block-size and tensor-parallel size)")
            if msg.src is not None:
                self._copy_in(msg, identity, None)
                self.counts["in_place_received"] += 1
            else:
                buffers = [f.buffer for f in frames]
                nbytes = sum(len(b) for b in buffers)
                if nbytes != len(msg.dst) * msg.block_nbytes:
                    raise MemPoolError(f"block layout mismatch: {nbytes} B for {len(msg.dst)} blocks of "
                                       f"{msg.block_nbytes} B")
                pool.write_blocks(msg.dst, buffers)
        except Exception as e:  # noqa: BLE001 - any failure is the sender's answer, not our crash
            pool.free_mem(pinned + msg.dst)
            return KVDone(msg.transfer_id, error=f"{type(e).__name__}: {e}")
        return self._deliver(msg, pinned)

    def _on_layer(self, msg: KVLayer, frames: list[zmq.Frame], identity: bytes) -> KVDone | None:
        """Write one layer into the blocks allocated for the ticket; the last layer's
        message completes the transfer (or answers the first error met on the way)."""
        grant = self._grants.get(msg.ticket)
        if grant is None or grant.src_instance != msg.src_instance or not grant.addrs or list(msg.dst) != grant.addrs:
            return KVDone(msg.transfer_id, error="not held: the blocks were not allocated for this transfer's "
                                                 "ticket") if msg.final else None
        if grant.error is None:
            try:
                if msg.src is not None:
                    self._copy_in(msg, identity, msg.layer)
                else:
                    tiers = {addr_tier(a) for a in msg.dst}
                    mover = self.pool.mover
                    if len(frames) != 1 or len(tiers) != 1 or mover is None or not hasattr(mover, "write_layer"):
                        raise MemPoolError("a by-layer message holds one frame for blocks of one tier of a "
                                           "runner's pool")
                    mover.write_layer(Tier(tiers.pop()), [addr_block(a) for a in msg.dst], msg.layer,
                                      frames[0].buffer)
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
        if msg.src is not None:
            self.counts["in_place_received"] += 1
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
