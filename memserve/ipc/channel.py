"""ZeroMQ channels between the gateway and its workers.

The gateway binds one ROUTER socket; every worker connects a DEALER whose identity is its
instance id. A message is ``[header, *bulk]`` frames: the msgpack header from
``messages.encode`` and optional raw buffers sent without copying. On one machine the
gateway binds an ``ipc://`` socket in its private runtime directory, so only the HTTP
port listens on TCP; TCP on loopback remains for callers that give no address. Sockets
on TCP speak CurveZMQ when the gateway made cluster keys (``ipc/curve.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import zmq
import zmq.asyncio

from memserve.ipc.curve import protect, release
from memserve.ipc.messages import decode, encode

Buffer = bytes | memoryview


class WorkerUnreachable(ConnectionError):
    """The worker a message is for has no connected socket."""


def _identity(instance_id: int) -> bytes:
    return b"w%d" % instance_id


def heartbeat_identity(instance_id: int) -> bytes:
    """The worker's heartbeat thread has a socket of its own; the gateway reads the same
    instance id from either identity."""
    return b"h%d" % instance_id


class GatewayChannel:
    """Asyncio side, owned by the gateway."""

    def __init__(self, address: str = "tcp://127.0.0.1:*") -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        protect(self._sock, address, server=True)
        self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send(self, instance_id: int, msg: Any, bulk: Sequence[Buffer] = ()) -> None:
        """Raises ``WorkerUnreachable`` where the worker's socket is not connected (it died
        and has not been reaped yet, or it has not connected)."""
        try:
            await self._sock.send_multipart([_identity(instance_id), encode(msg), *bulk], copy=not bulk)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: no such peer now
                raise WorkerUnreachable(f"worker {instance_id} is not connected") from exc
            raise

    async def recv(self) -> tuple[int, Any, list[zmq.Frame]]:
        ident, header, *bulk = await self._sock.recv_multipart(copy=False)
        return int(ident.bytes[1:]), decode(header.bytes), bulk

    def close(self) -> None:
        self._sock.close(0)
        release(self._ctx)
        self._ctx.term()


class WorkerChannel:
    """Blocking side, owned by a worker's engine loop (which is not asyncio: it spends its
    time in the model, and polls the socket between steps)."""

    def __init__(self, address: str, instance_id: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, _identity(instance_id))
        self._sock.setsockopt(zmq.LINGER, 1000)
        protect(self._sock, address, server=False)
        self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def watch(self, socket: zmq.Socket) -> None:
        """Also wake ``poll`` when ``socket`` is readable (the KV transfer endpoint)."""
        self._poller.register(socket, zmq.POLLIN)

    def send(self, msg: Any, bulk: Sequence[Buffer] = ()) -> None:
        self._sock.send_multipart([encode(msg), *bulk], copy=not bulk)

    def poll(self, timeout_ms: int) -> list[tuple[Any, list[zmq.Frame]]]:
        """Every gateway message that is waiting, after blocking at most ``timeout_ms``
        for the first message on any watched socket."""
        out = []
        self._poller.poll(timeout_ms)
        while True:
            try:
                header, *bulk = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            out.append((decode(header.bytes), bulk))
        return out

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
