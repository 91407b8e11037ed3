"""KV transfers between simulated instances: the ``KVTransferEndpoint`` interface that the
real prefill and decode sides use (``workers/engine/pd_sender.py``, ``workers/engine/pd_receiver.py``)
over simulated links instead of ZeroMQ, so the simulator drives their code as is.

The bookkeeping is the real endpoint's, in the same order: a receiver accepts only a
transfer it was told to ``expect`` (holding its pinned cached prefix), allocates the
blocks when the send starts, and on arrival indexes them after that prefix
(``insert_received``: ``transfer_with_insert``), then frees them (``KVFlags.RELEASE``) or
hands them to its engine with ``drain_received``. What the simulation adds is time: a
transfer of B bytes takes the time of the link between its two instances
(``Topology.transfer_s``: per-message latency + B / bandwidth) and occupies the sender's
outgoing and the receiver's incoming link, so concurrent transfers through one instance
queue behind each other. No bytes move."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from memserve.ipc.kv_transfer import (
    LayerStream,
    ReceivedKV,
    TransferError,
    insert_received,
)
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.sim.topology import Topology


@dataclass
class _Grant:
    src_instance: int
    max_blocks: int
    pinned: list[int]  # the receiver's cached prefix that the sent blocks continue
    addrs: list[int] = field(default_factory=list)  # allocated for the transfer


@dataclass
class LinkStats:
    transfers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # sum of the transfers' times on the link (queueing excluded)


class SimNetwork:
    """The links between the instances, priced by ``topology``; ``schedule(at, fn)``
    runs ``fn`` at virtual time ``at`` (the simulation's event queue); ``on_arrival(src,
    dst)`` is told of every transfer that ended, failed ones included."""

    def __init__(self, topology: Topology, clock: Callable[[], float],
                 schedule: Callable[[float, Callable[[], None]], None], on_arrival: Callable[[int, int], None]) -> None:
        self.topology = topology
        self.clock = clock
        self.schedule = schedule
        self.on_arrival = on_arrival
        self.endpoints: dict[int, SimEndpoint] = {}
        self._out_free: dict[int, float] = {}  # instance -> when its outgoing link is free
        self._in_free: dict[int, float] = {}
        self.stats = LinkStats()

    def endpoint(self, pool: MemPool) -> SimEndpoint:
        ep = self.endpoints[pool.instance_id] = SimEndpoint(self, pool)
        return ep

    def carry(self, src: int, dst: int, num_blocks: int, nbytes: int, arrive: Callable[[], None]) -> None:
        """Occupy both ends' links for the transfer and run ``arrive`` when it is over."""
        start = max(self.clock(), self._out_free.get(src, 0.0), self._in_free.get(dst, 0.0))
        seconds = self.topology.transfer_s(src, dst, nbytes)
        self._out_free[src] = self._in_free[dst] = start + seconds
        self.stats.transfers += 1
        self.stats.blocks += num_blocks
        self.stats.bytes += nbytes
        self.stats.seconds += seconds
        self.schedule(start + seconds, arrive)


class SimEndpoint:
    """One instance's end of the simulated network (the ``KVTransferEndpoint`` methods the
    prefill and decode sides call)."""

    def __init__(self, network: SimNetwork, pool: MemPool) -> None:
        self.network = network
        self.pool = pool
        self._grants: dict[str, _Grant] = {}
        self._received: list[ReceivedKV] = []

    # ---------------------------------------------------------- receiver side
    def expect(self, ticket: str, src_instance: int, max_blocks: int, ttl_s: float | None = None,
               pinned: list[int] | None = None) -> None:
        self._grants[ticket] = _Grant(src_instance, max_blocks, list(pinned or []))

    def cancel(self, ticket: str) -> int:
        grant = self._grants.pop(ticket, None)
        if grant is None:
            return 0
        held = grant.pinned + grant.addrs
        if held:
            self.pool.free_mem(held)
        return len(held)

    def expected(self) -> set[str]:
        return set(self._grants)

    def drain_received(self) -> list[ReceivedKV]:
        received, self._received = self._received, []
        return received

    def _allocate(self, ticket: str, src_instance: int, num_blocks: int) -> list[int]:
        grant = self._grants.get(ticket)
        if grant is None or grant.src_instance != src_instance or grant.addrs:
            raise TransferError("no transfer from this instance is expected under this ticket")
        if num_blocks > grant.max_blocks:
            raise TransferError(f"the transfer was announced for at most {grant.max_blocks} blocks, not {num_blocks}")
        try:
            grant.addrs = self.pool.alloc_mem(num_blocks)
        except (MemPoolError, ValueError) as e:
            raise TransferError(f"could not allocate {num_blocks} blocks: {e}") from e
        return grant.addrs

    def _arrive(self, ticket: str, src_instance: int, tokens: list[int] | None, first_block: int, flags: int,
                private: Any, cache_salt: str | None = None) -> None:
        grant = self._grants.pop(ticket, None)
        if grant is None:
            raise TransferError("not held: the transfer's ticket was cancelled while it was in flight")
        inserted = (insert_received(self.pool, tokens, first_block, grant.addrs, cache_salt)
                    if tokens is not None else 0)
        blocks = grant.pinned + grant.addrs
        if flags & KVFlags.RELEASE:
            self.pool.free_mem(blocks)
        else:
            self._received.append(ReceivedKV(src_instance, blocks, tokens, private, inserted, ticket))

    # ------------------------------------------------------------ sender side
    def open_layers(self, instance: int, num_blocks: int, num_layers: int, ticket: str,
                    tokens: list[int] | None = None, first_block: int = 0,
                    clock: Callable[[], float] | None = None, cache_salt: str | None = None) -> LayerStream:
        raise NotImplementedError("by-layer transfers are not simulated: a simulated step is timed whole")

    def send_async(self, instance: int, src: list[int], dst: Sequence[int] | None, flags: int, private: Any,
                   ticket: str, tokens: list[int] | None = None, first_block: int = 0,
                   frame_nbytes: int | None = None, cancelled: threading.Event | None = None,
                   cache_salt: str | None = None) -> Future[list[int]]:
        """Copy held blocks ``src`` to ``instance``: the receiver allocates now, indexes
        and takes them when the link has carried them (the future is then done).
        ``cancelled`` is never waited on: a simulated receiver always answers."""
        if dst is not None or frame_nbytes is not None:
            raise TransferError("the simulator sends aggregated blocks into receiver-allocated ones only")
        self.pool.check_held(src, "transfer")
        future: Future[list[int]] = Future()
        receiver = self.network.endpoints[instance]
        me = self.pool.instance_id
        try:
            addrs = receiver._allocate(ticket, me, len(src))
        except TransferError as e:
            future.set_exception(e)
            self.network.schedule(self.network.clock(), lambda: self.network.on_arrival(me, instance))
            return future

        def arrive() -> None:
            try:
                receiver._arrive(ticket, me, tokens, first_block, flags, private, cache_salt)
                future.set_result(addrs)
            except TransferError as e:
                future.set_exception(e)
            self.network.on_arrival(me, instance)

        mover = self.pool.mover
        assert mover is not None  # a simulated pool has a NullMover
        self.network.carry(me, instance, len(src), len(src) * mover.block_nbytes, arrive)
        return future
