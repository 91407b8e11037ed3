"""The receiving side of worker-to-worker KV transfers: a decode instance taking over a
request from a prefill instance (MemServe §5.1), or any instance receiving a pushed
prefix (prefix pulls, pd-caching-3's decode-phase KV going back to the prefill side).

``expect`` answers the gateway's ``ExpectTransfer``: with ``token_ids`` it pins this
instance's cached prefix of them for the ticket, so the sender moves only the blocks
missing here (pd-caching-2's incremental transfer). KV that arrives for a request waits
here, held, until the gateway's resume request (an ``AddRequest`` carrying the first
token and ``kv_ticket``) hands it to the KV connector as that request's computed prefix.
Aborts cancel the ticket; KV nobody resumes within ``hold_s`` is freed. A by-layer
transfer (``--transfer-mode by-layer``) is expected before the sender's prefill runs; its
layers are written into the ticket's blocks as they arrive (``ipc/kv_transfer.py``) and
reach this side whole, like any other transfer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from memserve.ipc.kv_transfer import ReceivedKV
from memserve.ipc.messages import (
    AddRequest,
    ExpectTransfer,
    HandoffDone,
    RequestOutput,
    TransferExpected,
)

if TYPE_CHECKING:
    from memserve.workers.engine.engine import Engine

# Seconds received KV waits for its request's resume before it is freed.
HOLD_S = 30.0


class ReceiveEndpoint(Protocol):
    """What the receiver needs of its transfer endpoint (``ipc/kv_transfer.py``'s over
    ZeroMQ; the simulator's over its modelled network)."""

    def expect(self, ticket: str, src_instance: int, max_blocks: int, ttl_s: float | None = None,
               pinned: list[int] | None = None) -> None:
        ...

    def cancel(self, ticket: str) -> int:
        ...

    def expected(self) -> set[str]:
        ...


@dataclass
class _Arrived:
    addrs: list[int]
    deadline: float


class KVReceiver:
    def __init__(self, engine: Engine, endpoint: ReceiveEndpoint, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.kv = engine.kv_connector
        self.endpoint = endpoint
        self.hold_s = hold_s
        self.clock = clock
        self._tickets: dict[str, str] = {}  # request id -> ticket of the KV it waits for
        self._arrived: dict[str, _Arrived] = {}  # ticket -> blocks received for it
        self.counts = {"resumed": 0, "resumed_without_kv": 0, "blocks_received": 0, "blocks_pinned": 0,
                       "reclaimed": 0}

    def expect(self, msg: ExpectTransfer) -> TransferExpected:
        """Accept the transfer; pin the device-resident cached prefix of ``token_ids``."""
        pinned = self.kv.hold_device_prefix(msg.token_ids, msg.cache_salt) if msg.token_ids else []
        self.endpoint.expect(msg.ticket, msg.src_instance, msg.max_blocks, msg.ttl_s, pinned=pinned)
        if msg.request_id:
            self._tickets[msg.request_id] = msg.ticket
        self.counts["blocks_pinned"] += len(pinned)
        return TransferExpected(msg.transfer_id, len(pinned))

    def on_received(self, received: list[ReceivedKV]) -> list[HandoffDone]:
        """Keep KV that arrived for a request until it resumes, and tell the gateway it is
        here (it need not wait for the sender's report, which leaves the sender only at
        its next step boundary: a long prefill step later); free any other."""
        waiting = {ticket: request_id for request_id, ticket in self._tickets.items()}
        arrived = []
        for kv in received:
            if kv.ticket in waiting:
                self._arrived[kv.ticket] = _Arrived(kv.addrs, self.clock() + self.hold_s)
                self.counts["blocks_received"] += len(kv.addrs)
                arrived.append(HandoffDone(waiting[kv.ticket], kv.ticket, len(kv.addrs)))
            else:
                self.kv.free(kv.addrs)
        return arrived

    def resume(self, msg: AddRequest) -> RequestOutput | None:
        """Continue a request another instance started: its KV (when it arrived under
        ``kv_ticket``) becomes its computed prompt; without it, the prompt is recomputed
        (from this instance's cache where it has one)."""
        self._tickets.pop(msg.request_id, None)
        arrived = self._arrived.pop(msg.kv_ticket, None) if msg.kv_ticket else None
        if msg.kv_ticket:
            self.endpoint.cancel(msg.kv_ticket)  # a transfer that never arrived: its blocks go now
        out = self.engine.add_request(msg)
        if arrived is not None and out is None:  # queued: its admission takes the KV over
            self.kv.adopt(msg.request_id, arrived.addrs, len(msg.prompt_token_ids))
        elif arrived is not None:  # rejected at once
            self.kv.free(arrived.addrs)
        self.counts["resumed" if arrived is not None else "resumed_without_kv"] += 1
        return out

    def abort(self, request_id: str) -> None:
        """The request was aborted before it resumed here: drop its ticket and its KV."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        self.endpoint.cancel(ticket)
        arrived = self._arrived.pop(ticket, None)
        if arrived is not None:
            self.kv.free(arrived.addrs)

    def reclaim(self) -> None:
        """Free KV whose request never resumed (its gateway gave up on it)."""
        now = self.clock()
        for ticket in [t for t, a in self._arrived.items() if a.deadline <= now]:
            self.kv.free(self._arrived.pop(ticket).addrs)
            self.counts["reclaimed"] += 1
        live = set(self._arrived) | set(self.endpoint.expected())
        self._tickets = {r: t for r, t in self._tickets.items() if t in live}

    def stats(self) -> dict:
        return {**self.counts, "holding": len(self._arrived)}
