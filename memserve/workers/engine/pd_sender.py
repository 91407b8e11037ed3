"""The prefill side of disaggregated prefill/decode (MemServe §5.1).

A request the gateway marks ``handoff`` runs here with ``max_tokens=1``: the prefill and
the first token, which goes to the client at once. Its KV blocks are not freed when it
leaves the scheduler but parked (``KVConnector.retain``) until the gateway names the
decode instance in a ``HandoffStart``; they are then sent on the transfer endpoint's
sender thread, so the engine keeps stepping, and freed once the decode instance has them
(blocks indexed here stay cached: pd-caching-1 and up). An abort, a failed send or a
``HandoffStart`` without destination frees them too: nothing outlives its request.

The gateway names the decode instance while the prefill runs, so its ``HandoffStart``
usually arrives before the request is parked: it is kept (``_named``) and the send
starts the moment the prefill step ends, instead of after the next step (the loop reads
messages only between steps, and a prefill step can take seconds).

The first output is passed on unfinished: for the client the request goes on, on the
decode instance.

``--transfer-mode by-layer``: the gateway names the decode instance before the prefill
(its ``HandoffStart`` arrives ahead of the ``AddRequest``), and the KV goes out layer by
layer during the prefill step (``pd_layer_sender.py``); the blocks are freed when the
request leaves, since the sends carry copies, or, sent in place (a same-host receiver
reads them out of this worker's pool), when the transfer ends. A request whose
destination comes only after its first token (the early naming failed) is sent after the
step, one frame per layer's K or V of each block, as in by-request."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from memserve.ipc.kv_transfer import LayerStream
from memserve.ipc.messages import AddRequest, HandoffDone, HandoffStart, RequestOutput
from memserve.kvcache.address import addr_block
from memserve.kvcache.blocks import contiguous_runs
from memserve.workers.engine.pd_layer_sender import LayerSender

if TYPE_CHECKING:
    from memserve.workers.engine.engine import Engine

log = logging.getLogger("memserve.worker")


class HandoffEndpoint(Protocol):
    """What the sender needs of its transfer endpoint (``ipc/kv_transfer.py``'s over
    ZeroMQ; the simulator's over its modelled network)."""

    def send_async(self, instance: int, src: list[int], dst: Sequence[int] | None, flags: int, private: Any,
                   ticket: str, tokens: list[int] | None = None, first_block: int = 0,
                   frame_nbytes: int | None = None, cancelled: threading.Event | None = None,
                   cache_salt: str | None = None) -> Future[list[int]]:
        ...

    def open_layers(self, instance: int, num_blocks: int, num_layers: int, ticket: str,
                    tokens: list[int] | None = None, first_block: int = 0,
                    clock: Callable[[], float] = time.monotonic, cache_salt: str | None = None) -> LayerStream:
        ...


@dataclass
class _Sending:
    start: HandoffStart
    addrs: list[int]  # held here until the send is done
    future: Future
    started: float
    num_bytes: int
    num_messages: int
    num_blocks: int
    parked: float  # when the prefill step ended
    stream: LayerStream | None = None  # by-layer
    finished: float | None = None  # when the receiver answered (set on the sender thread)
    cancelled: threading.Event | None = None  # other modes: set on abort, the sender stops waiting


@dataclass
class _Parked:
    prompt: list[int]
    addrs: list[int]
    at: float
    salt: str | None = None  # the request's cache_salt: the receiver names the blocks with it


class HandoffSender:
    def __init__(self, engine: Engine, endpoint: HandoffEndpoint, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.clock = clock
        self._prompts: dict[str, list[int]] = {}  # handoff requests not yet parked
        self._salts: dict[str, str] = {}  # the cache_salt of those that have one
        self._parked: dict[str, _Parked] = {}
        self._sending: list[_Sending] = []
        # by-layer: destinations named before the prefill, and the transfers of the
        # requests still prefilling (request -> (HandoffStart, stream)).
        self.layers: LayerSender | None = None
        self.kv = engine.kv_connector
        if engine.cfg.transfer_mode == "by-layer":
            self.layers = LayerSender(self.kv.read_layer)
            self.kv.add_step_hooks(self.layers.hooks_for)
        self._early: dict[str, HandoffStart] = {}
        self._streams: dict[str, tuple[HandoffStart, LayerStream]] = {}
        # Other modes: destinations named while the request prefills, sent when it parks.
        self._named: dict[str, HandoffStart] = {}
        self._answers: list[HandoffDone] = []  # answers of those sends, for the next ``poll``
        # kv_ready_s: from the end of the prefill step to the KV being at the receiver.
        self.counts = {"handoffs": 0, "failed": 0, "blocks_sent": 0, "blocks_skipped": 0, "bytes_sent": 0,
                       "messages": 0, "transfer_s": 0.0, "kv_ready_s": 0.0}

    @property
    def busy(self) -> bool:
        return bool(self._sending)

    def add(self, msg: AddRequest) -> RequestOutput | None:
        """Queue a handoff request: the prefill and the first token only, KV kept."""
        self._prompts[msg.request_id] = list(msg.prompt_token_ids)
        if msg.params.kv_salt:  # the receiver names the prompt's blocks with it too
            self._salts[msg.request_id] = msg.params.kv_salt
        self.kv.retain(msg.request_id)
        out = self.engine.add_request(dataclasses.replace(msg, params=dataclasses.replace(msg.params, max_tokens=1)))
        if out is not None:  # rejected at once
            self._drop(msg.request_id)
        elif msg.request_id in self._early:
            self._open(msg.request_id)
        return out

    def _open(self, request_id: str) -> None:
        """by-layer: open the transfer of a request about to prefill (the receiver
        allocates the blocks it lacks meanwhile) and arm its prefill step."""
        start = self._early.pop(request_id)
        prompt = self._prompts[request_id]
        block_size = self.kv.block_size
        num_blocks = math.ceil(len(prompt) / block_size)
        skip = min(start.first_block, num_blocks - 1)  # at least the prompt's tail block goes
        tokens = prompt[: len(prompt) // block_size * block_size] if start.insert else None
        stream = self.endpoint.open_layers(start.dst_instance, num_blocks - skip, self.kv.num_layers, start.ticket,
                                           tokens, skip, self.clock, cache_salt=self._salts.get(request_id))
        self._streams[request_id] = (dataclasses.replace(start, first_block=skip), stream)
        assert self.layers is not None  # only by-layer names destinations early
        self.layers.arm(request_id, stream, skip)

    def filter(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Park the KV of handoff requests that produced their first token; their output
        goes on unfinished. A first token that ends the request (a stop token) or any
        other ending (abort, error) ends it here, and its kept blocks are freed."""
        for out in outputs:
            prompt = self._prompts.get(out.request_id)
            if prompt is None or not out.finished:
                continue
            if out.finish_reason == "length" and out.new_token_ids:
                del self._prompts[out.request_id]
                salt = self._salts.pop(out.request_id, None)
                addrs = self.kv.take_retained(out.request_id)
                if out.request_id in self._streams:
                    self._sent_by_layer(out.request_id, addrs)
                else:
                    self._parked[out.request_id] = _Parked(prompt, addrs, self.clock(), salt)
                    named = self._named.pop(out.request_id, None)
                    answer = self.start(named) if named is not None else None
                    if answer is not None:
                        self._answers.append(answer)
                out.finished, out.finish_reason = False, None
            else:
                self._drop(out.request_id)
        return outputs

    def _sent_by_layer(self, request_id: str, addrs: list[int]) -> None:
        """The prefill step handed every layer to the sender thread: free the blocks now
        (copies went) or when the transfer ends (in place), and watch it like any send."""
        start, stream = self._streams.pop(request_id)
        if not stream.in_place:
            self.kv.free(addrs)
        if stream.handed < stream.num_layers:  # the step failed and ran again: the layers went only in part
            stream.cancel("the prefill step did not send every layer")
        nbytes = stream.num_blocks * self.kv.block_nbytes
        self.counts["blocks_skipped"] += start.first_block
        self._watch(_Sending(start, addrs if stream.in_place else [], stream.future,
                             stream.first_layer_at or self.clock(), nbytes, stream.num_layers, stream.num_blocks,
                             self.clock(), stream))

    def start(self, msg: HandoffStart) -> HandoffDone | None:
        """Send a parked request's KV from block ``first_block`` on; an answer now when
        there is nothing to send (unknown request, no destination), else at ``poll``.
        A destination named before the request parked is kept for it: by-layer, for its
        prefill step to send through; other modes, to send when it parks."""
        if self.layers is not None and msg.dst_instance >= 0 and msg.request_id not in self._parked:
            self._early[msg.request_id] = msg
            if msg.request_id in self._prompts:  # already queued: its prefill has not run yet
                self._open(msg.request_id)
            return None
        if msg.dst_instance >= 0 and msg.request_id in self._prompts:  # still prefilling
            self._named[msg.request_id] = msg
            return None
        parked = self._parked.pop(msg.request_id, None)
        prompt, addrs = (parked.prompt, parked.addrs) if parked else ([], [])
        if parked is None or msg.dst_instance < 0 or not addrs:
            if addrs:
                self.kv.free(addrs)
            return None if msg.dst_instance < 0 else HandoffDone(msg.request_id, msg.ticket, 0,
                                                                  error="no KV kept for this request")
        skip = min(msg.first_block, len(addrs) - 1)
        if skip:
            self.kv.free(addrs[:skip])  # the receiver holds these already
        send = addrs[skip:]
        block_size = self.kv.block_size
        tokens = prompt[: len(prompt) // block_size * block_size] if msg.insert else None
        nbytes = len(send) * self.kv.block_nbytes
        frame_nbytes = self._frame_nbytes()
        frames = nbytes // frame_nbytes if frame_nbytes else len(contiguous_runs([addr_block(a) for a in send]))
        cancelled = threading.Event()
        try:
            future = self.endpoint.send_async(msg.dst_instance, send, None, 0, None, msg.ticket, tokens, skip,
                                              frame_nbytes, cancelled, cache_salt=parked.salt)
        except Exception as exc:  # noqa: BLE001 - reported to the gateway like a failed send
            future = Future()
            future.set_exception(exc)
        self.counts["blocks_skipped"] += skip
        self._watch(_Sending(msg, send, future, self.clock(), nbytes, frames, len(send), parked.at,
                             cancelled=cancelled))
        return None

    def _watch(self, s: _Sending) -> None:
        """Track a send until ``poll``; its end is stamped when the receiver answers."""
        s.future.add_done_callback(lambda _: setattr(s, "finished", self.clock()))
        self._sending.append(s)

    def _frame_nbytes(self) -> int | None:
        """by-request-agg: None (a frame per run of blocks, each block holding every
        layer's K and V); by-request (and by-layer's sends after the step): one layer's
        K or V of one block per frame."""
        if self.engine.cfg.transfer_mode == "by-request-agg":
            return None
        return self.kv.block_nbytes // (2 * self.kv.num_layers)

    def poll(self) -> list[HandoffDone]:
        """Sends that ended: free their blocks, report them."""
        done, pending = self._answers, []
        self._answers = []
        for s in self._sending:
            if not s.future.done():
                pending.append(s)
                continue
            if s.addrs:
                self.kv.free(s.addrs)
            # by-layer: often done before the step that sent it ended, before ``_watch``
            finished = s.stream.done_at if s.stream is not None else s.finished
            finished = finished if finished is not None else self.clock()
            seconds = finished - s.started
            error = s.future.exception()
            if error is None:
                self.counts["handoffs"] += 1
                self.counts["blocks_sent"] += s.num_blocks
                self.counts["bytes_sent"] += s.num_bytes
                self.counts["messages"] += s.num_messages
                self.counts["transfer_s"] += seconds
                self.counts["kv_ready_s"] += max(0.0, finished - s.parked)
                done.append(HandoffDone(s.start.request_id, s.start.ticket, s.num_blocks, s.num_bytes,
                                        s.num_messages, seconds))
            else:
                log.warning("handoff of %s to instance %d failed: %s", s.start.request_id, s.start.dst_instance,
                            error)
                self.counts["failed"] += 1
                done.append(HandoffDone(s.start.request_id, s.start.ticket, 0, error=str(error)))
        self._sending = pending
        return done

    def abort(self, request_id: str) -> None:
        """The request was aborted: free its kept KV (a send in flight frees at ``poll``;
        a by-layer one stops waiting for its receiver)."""
        self._drop(request_id)
        parked = self._parked.pop(request_id, None)
        if parked is not None and parked.addrs:
            self.kv.free(parked.addrs)
        for s in self._sending:
            if s.start.request_id != request_id:
                continue
            if s.stream is not None:
                s.stream.cancel("the request was aborted")
            elif s.cancelled is not None:
                s.cancelled.set()

    def _drop(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._salts.pop(request_id, None)
        self._early.pop(request_id, None)
        self._named.pop(request_id, None)
        if self.layers is not None:
            self.layers.disarm(request_id)
        _, stream = self._streams.pop(request_id, (None, None))
        if stream is not None:
            stream.cancel("the request ended on the prefill instance")
        addrs = self.kv.take_retained(request_id)
        if addrs:
            self.kv.free(addrs)

    def stats(self) -> dict:
        return {**self.counts, "parked": len(self._parked), "sending": len(self._sending)}
