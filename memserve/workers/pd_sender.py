"""The prefill side of disaggregated prefill/decode (MemServe §5.1).

A request the gateway marks ``handoff`` runs here with ``max_tokens=1``: the prefill and
the first token, which goes to the client at once. Its KV blocks are not freed when it
leaves the scheduler but parked (``KVCacheManager.retain``) until the gateway names the
decode instance in a ``HandoffStart``; they are then sent on the transfer endpoint's
sender thread, so the engine keeps stepping, and freed once the decode instance has them
(blocks indexed here stay cached: pd-caching-1 and up). An abort, a failed send or a
``HandoffStart`` without destination frees them too: nothing outlives its request.

The first output is passed on unfinished: for the client the request goes on, on the
decode instance."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memserve.ipc.kv_transfer import KVTransferEndpoint
from memserve.ipc.messages import AddRequest, HandoffDone, HandoffStart, RequestOutput
from memserve.kvcache.address import addr_block
from memserve.kvcache.blocks import contiguous_runs

if TYPE_CHECKING:
    from memserve.workers.engine import Engine

log = logging.getLogger("memserve.worker")


@dataclass
class _Sending:
    start: HandoffStart
    addrs: list[int]  # held here until the send is done
    future: Future
    started: float
    num_bytes: int
    num_messages: int


class HandoffSender:
    def __init__(self, engine: Engine, endpoint: KVTransferEndpoint, clock=time.monotonic) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.clock = clock
        self._prompts: dict[str, list[int]] = {}  # handoff requests not yet parked
        self._parked: dict[str, tuple[list[int], list[int]]] = {}  # request -> (prompt, blocks)
        self._sending: list[_Sending] = []
        self.counts = {"handoffs": 0, "failed": 0, "blocks_sent": 0, "blocks_skipped": 0, "bytes_sent": 0,
                       "messages": 0, "transfer_s": 0.0}

    @property
    def busy(self) -> bool:
        return bool(self._sending)

    def add(self, msg: AddRequest) -> RequestOutput | None:
        """Queue a handoff request: the prefill and the first token only, KV kept."""
        self._prompts[msg.request_id] = list(msg.prompt_token_ids)
        self.engine.scheduler.kv.retain(msg.request_id)
        out = self.engine.add_request(dataclasses.replace(msg, params=dataclasses.replace(msg.params, max_tokens=1)))
        if out is not None:  # rejected at once
            self._drop(msg.request_id)
        return out

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
                self._parked[out.request_id] = (prompt, self.engine.scheduler.kv.take_retained(out.request_id))
                out.finished, out.finish_reason = False, None
            else:
                self._drop(out.request_id)
        return outputs

    def start(self, msg: HandoffStart) -> HandoffDone | None:
        """Send a parked request's KV from block ``first_block`` on; an answer now when
        there is nothing to send (unknown request, no destination), else at ``poll``."""
        prompt, addrs = self._parked.pop(msg.request_id, ([], []))
        if msg.dst_instance < 0 or not addrs:
            if addrs:
                self.engine.mempool.free_mem(addrs)
            return None if msg.dst_instance < 0 else HandoffDone(msg.request_id, msg.ticket, 0,
                                                                  error="no KV kept for this request")
        skip = min(msg.first_block, len(addrs) - 1)
        if skip:
            self.engine.mempool.free_mem(addrs[:skip])  # the receiver holds these already
        send = addrs[skip:]
        block_size = self.engine.cfg.block_size
        tokens = prompt[: len(prompt) // block_size * block_size] if msg.insert else None
        nbytes = len(send) * self.engine.mempool.mover.block_nbytes  # type: ignore[union-attr]
        frame_nbytes = self._frame_nbytes()
        frames = nbytes // frame_nbytes if frame_nbytes else len(contiguous_runs([addr_block(a) for a in send]))
        try:
            future = self.endpoint.send_async(msg.dst_instance, send, None, 0, None, msg.ticket, tokens, skip,
                                              frame_nbytes)
        except Exception as exc:  # noqa: BLE001 - reported to the gateway like a failed send
            future = Future()
            future.set_exception(exc)
        self.counts["blocks_skipped"] += skip
        self._sending.append(_Sending(msg, send, future, self.clock(), nbytes, frames))
        return None

    def _frame_nbytes(self) -> int | None:
        """by-request-agg: None (a frame per run of blocks, each block holding every
        layer's K and V); by-request: one layer's K or V of one block per frame."""
        if self.engine.cfg.transfer_mode == "by-request-agg":
            return None
        layers = self.engine.runner.model_config.num_layers  # type: ignore[attr-defined]
        return self.engine.mempool.mover.block_nbytes // (2 * layers)  # type: ignore[union-attr]

    def poll(self) -> list[HandoffDone]:
        """Sends that ended: free their blocks, report them."""
        done, pending = [], []
        for s in self._sending:
            if not s.future.done():
                pending.append(s)
                continue
            self.engine.mempool.free_mem(s.addrs)
            seconds = self.clock() - s.started
            error = s.future.exception()
            if error is None:
                self.counts["handoffs"] += 1
                self.counts["blocks_sent"] += len(s.addrs)
                self.counts["bytes_sent"] += s.num_bytes
                self.counts["messages"] += s.num_messages
                self.counts["transfer_s"] += seconds
                done.append(HandoffDone(s.start.request_id, s.start.ticket, len(s.addrs), s.num_bytes,
                                        s.num_messages, seconds))
            else:
                log.warning("handoff of %s to instance %d failed: %s", s.start.request_id, s.start.dst_instance,
                            error)
                self.counts["failed"] += 1
                done.append(HandoffDone(s.start.request_id, s.start.ticket, 0, error=str(error)))
        self._sending = pending
        return done

    def abort(self, request_id: str) -> None:
        """The request was aborted: free its kept KV (a send in flight frees at ``poll``)."""
        self._drop(request_id)
        _, addrs = self._parked.pop(request_id, ([], []))
        if addrs:
            self.engine.mempool.free_mem(addrs)

    def _drop(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        addrs = self.engine.scheduler.kv.take_retained(request_id)
        if addrs:
            self.engine.mempool.free_mem(addrs)

    def stats(self) -> dict:
        return {**self.counts, "parked": len(self._parked), "sending": len(self._sending)}
