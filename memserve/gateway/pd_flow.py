"""A request's way through a disaggregated deployment (MemServe §5.1), as the gateway
drives it; the client sees one ordinary stream.

1. The router picks a prefill instance P among the prefill instances (its policy applies
   there: least-load, session, prompt-tree, cost). P prefills and samples the first
   token, which is streamed to the client at once, and keeps the request's KV.
2. While P prefills, a decode instance D (``pick_decode``: in pd-caching-2/3 the one
   holding the longest prefix of the prompt, else the least loaded) is told to expect
   the KV (``ExpectTransfer``); in pd-caching-2/3 it pins its cached prefix of the prompt
   and answers how many blocks it holds, so P sends only the rest (``HandoffStart``),
   inserted into D's index. P starts the send the moment its prefill step ends. (Naming
   D only after the first token would leave the ``HandoffStart`` unread until P's next
   step ended: on a busy prefill instance, another whole prefill.) If naming fails, D is
   named again after the first token.
3. When the KV is delivered (``HandoffDone``: from D as soon as it arrives, or from P),
   D gets the request as a resume: an ``AddRequest`` with the first token as output and
   the KV's ticket. It recomputes nothing that was sent, and decodes the rest, streaming
   it under the same id.
4. pd-caching-3: when D finishes, its decode-phase KV goes back to P (only the blocks P
   lacks), so the next turn's prefill at P reuses the answer too.

With ``--transfer-mode by-layer`` on P, step 2 comes before step 1: D is named and
pinned, and P told where to send, before P gets the request, so P sends each layer's KV
as its prefill computes it (``workers/engine/pd_layer_sender.py``); step 3 follows the first
token as usual. This costs a round trip to D ahead of the prefill; when it fails, the
request hands off after its first token as in the other modes.

Failures: a prefill instance that dies before the first token means a retry on another
one (nothing was streamed), or with none live, the request runs wholly on a decode
instance; once tokens were streamed, a handoff that fails, stalls (P or D dead or its
heartbeats late at a check every ``handoff_timeout_s``, or ``HANDOFF_MAX_S`` passed) or
loses P or D resumes the request on a live decode instance without the KV (it recomputes
the prompt and every token so far, from its own cache where it has them, and samples on),
or with none live, on a live prefill instance, which decodes the rest itself; when no
instance is left, the stream ends with an error. The client sees one stream either way.
Aborts reach both instances; each frees what it holds for the request
(``workers/engine/pd_sender.py``, ``workers/engine/pd_receiver.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from memserve.gateway.cluster import DEGRADED_AFTER_HEARTBEATS, Cluster
from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.request_stream import RETRY, RequestStream
from memserve.gateway.routing.decode_choice import pick_decode
from memserve.gateway.routing.pd_handoff import Handoff, Phase
from memserve.gateway.routing.pd_topology import role_caches
from memserve.gateway.routing.route_types import RouteDecision, RouteRequest, WorkerView
from memserve.ipc.channel import GatewayChannel
from memserve.ipc.messages import (
    AddRequest,
    ExpectTransfer,
    HandoffDone,
    HandoffStart,
    RequestOutput,
    SamplingParams,
    TransferPrefix,
)

log = logging.getLogger("memserve.gateway")

# Seconds between checks of a handoff in flight: past each, a handoff whose prefill or
# decode instance is no longer healthy (heartbeats late, a step stuck) is given up and
# the request resumes on a decode instance without the KV; a handoff between healthy but
# busy instances (a long step delays serving it) is waited for up to HANDOFF_MAX_S.
HANDOFF_TIMEOUT_S = 5.0
HANDOFF_MAX_S = 120.0
# How long D keeps a ticket named before the prefill: the request may wait in P's queue
# for long under load. The ticket holds no blocks but D's pinned prefix (pd-caching-2/3),
# and every end of the request cancels it; the limit only covers a lost abort.
EARLY_TICKET_TTL_S = 600.0
# Reasons a request ends on the decode instance with its answer whole (its KV is worth keeping).
COMPLETE = ("stop", "length")
class PDClient(Protocol):
    """What the disaggregated flow needs of the engine client that owns it
    (``engine_client.ZmqEngineClient``): its workers and channel, its routing and
    admission, and its bookkeeping of requests in flight."""

    channel: GatewayChannel
    cluster: Cluster
    block_size: int
    max_model_len: int
    streams: dict[str, RequestStream]

    @property
    def transfer_ids(self) -> Iterator[int]: ...

    def views(self) -> list[WorkerView]: ...

    def pick_worker(self, request: RouteRequest) -> RouteDecision: ...

    async def admit(self, request: RouteRequest) -> None: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    session_id: str | None, slo: dict | None, handoff: bool = False) -> AddRequest: ...

    async def ask(self, worker: int, msg: ExpectTransfer | TransferPrefix, timeout_s: float) -> Any: ...

    async def pull_prefix(self, src: int, dst: int, token_ids: list[int], cache_salt: str | None = None) -> None: ...

    async def transfer_prefix(self, src: int, dst: int, token_ids: list[int], timeout_s: float = 60.0,
                              incremental: bool = False, cache_salt: str | None = None) -> int: ...

    async def send_abort(self, worker: int, request_id: str) -> None: ...

    def release(self, request_id: str) -> None: ...

    def learn(self, request_id: str, output_tokens: int, finish_reason: str | None) -> None: ...


@dataclass
class _Request:
    """A disaggregated request in the gateway: its ``Handoff`` state and what the gateway
    adds to it (its stream, and the tasks and answers of naming D and handing off)."""

    state: Handoff
    stream: RequestStream
    route: RouteRequest
    finished: bool = False
    handoff: asyncio.Task | None = None  # P's send to D, after the first token
    handoff_since: float = 0.0
    early: bool = False  # D named (and P told where to send) before the first token
    naming: asyncio.Task | None = None  # other modes than by-layer: D being named while P prefills
    done_early: HandoffDone | None = None  # the KV arrived before the first token was seen here


class PDFlow:
    def __init__(self, client: PDClient, pd_mode: str, handoff_timeout_s: float = HANDOFF_TIMEOUT_S) -> None:
        self.client = client
        self.pd_mode = pd_mode
        self.handoff_timeout_s = handoff_timeout_s
        self.decode_caches = role_caches("decode", pd_mode)
        self.counts: Counter[str] = Counter()
        self._returns: set[asyncio.Task] = set()

    def applies(self, params: SamplingParams, num_prompt_tokens: int) -> bool:
        """Whether the request hands off: one sequence without a grammar (a grammar's
        state stays on P) that decodes past its first token. Others run wholly on P."""
        return (params.n == 1 and params.grammar is None and params.max_tokens > 1
                and num_prompt_tokens + 1 < self.client.max_model_len)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, session_id: str | None,
                       slo: dict | None) -> AsyncIterator[RequestOutput]:
        """Run one request through P and D (the module docstring), driving its ``Handoff``
        state by what arrives on its stream: P's and D's outputs, ``RETRY`` when one of
        them died, ``HandoffDone`` when the KV reached D or the handoff failed."""
        c = self.client
        slo = slo or {}
        route = RouteRequest(request_id, prompt, session_id, slo, params.max_tokens, params.n, params.kv_salt,
                             params.lora_name)
        await c.admit(route)
        decision = c.pick_worker(route)
        stream = RequestStream(decision.instance)
        c.streams[request_id] = stream
        add = c.add_request(request_id, prompt, params, session_id, slo, handoff=True)
        r = _Request(Handoff(add, decision.instance), stream, route)
        try:
            if decision.pull_from is not None:
                await c.pull_prefix(decision.pull_from, decision.instance, prompt, params.kv_salt)
            r.early, r.naming = await self._send_prefill(stream, add, r.state.prefill)
            while not r.finished:
                item = await self._next_item(r)
                phase = r.state.phase
                if item is RETRY and phase is Phase.PREFILL:
                    await self._retry_prefill(r)
                elif isinstance(item, HandoffDone) and phase is Phase.PREFILL and item.error is None:
                    r.done_early = item  # D has the KV already; P's first token is on its way
                elif isinstance(item, HandoffDone) and phase is not Phase.HANDOFF:
                    continue  # a late answer: the request resumed without that handoff
                elif item is RETRY or isinstance(item, HandoffDone):
                    failure = await self._resume_after(r, item)
                    if failure is not None:
                        yield failure
                else:
                    yield await self._output(r, item)
        finally:
            await self._end(r)

    async def _next_item(self, r: _Request) -> RequestOutput | HandoffDone:
        """The next item on the request's stream; during the handoff, a failed
        ``HandoffDone`` once P or D stops being healthy or ``HANDOFF_MAX_S`` passed."""
        while True:
            try:
                timeout = self.handoff_timeout_s if r.state.phase is Phase.HANDOFF else None
                return await asyncio.wait_for(r.stream.queue.get(), timeout)
            except asyncio.TimeoutError:
                if (self._healthy(r.state.prefill, r.stream.peer)
                        and time.monotonic() - r.handoff_since < HANDOFF_MAX_S):
                    continue  # both are alive, one is busy stepping: the handoff goes on
                return HandoffDone(r.state.request_id, "", 0, error="the handoff stalled: an instance is not healthy")

    async def _retry_prefill(self, r: _Request) -> None:
        """P died before the first token: run the prefill again on another prefill
        instance, or with none live, the whole request on a decode instance."""
        c, rid, add = self.client, r.state.request_id, r.state.add
        if r.naming is not None:
            r.naming.cancel()
        if r.early or r.naming is not None:  # P or D died: both drop the request, D is named anew
            await c.send_abort(r.state.prefill, rid)
            if r.stream.peer is not None:
                await c.send_abort(r.stream.peer, rid)
            r.stream.peer, r.done_early = None, None
        try:
            prefill = c.pick_worker(r.route).instance
        except EngineUnavailable:  # no prefill instance is live: a decode instance runs it all
            await self._resume(r.stream, add, r.state.tokens, "", fresh=True)
            log.warning("request %s: its prefill instance died; running it on decode instance %d", rid,
                        r.stream.worker)
            r.state.run_on_decode()
            return
        r.stream.worker = prefill
        r.state.retried(prefill)
        log.warning("request %s: its prefill instance died; retrying on instance %d", rid, prefill)
        r.early, r.naming = await self._send_prefill(r.stream, add, prefill)

    async def _resume_after(self, r: _Request, item: RequestOutput | HandoffDone) -> RequestOutput | None:
        """The handoff ended (with the KV at D: its ticket) or failed, or D died: resume
        the request on D with its KV, else elsewhere without it; the error output when
        it cannot go on."""
        c, rid = self.client, r.state.request_id
        if r.handoff is not None:
            r.handoff.cancel()
        ticket = item.ticket if isinstance(item, HandoffDone) and item.error is None else ""
        if not ticket:
            if r.state.phase is Phase.HANDOFF:
                await c.send_abort(r.state.prefill, rid)  # P drops the KV it kept (or is sending)
            self.counts["handoff_failed" if r.state.phase is Phase.HANDOFF else "decode_lost"] += 1
            log.warning("request %s: %s; resuming on a decode instance without its KV", rid,
                        item.error if isinstance(item, HandoffDone) else "an instance died")
        if not r.state.resume():
            r.finished = True
            return RequestOutput(rid, [], True, "error", error="the request lost its instances")
        try:
            await self._resume(r.stream, r.state.add, r.state.tokens, ticket, fresh=not ticket)
        except EngineUnavailable as exc:
            r.finished = True
            return RequestOutput(rid, [], True, "error", error=str(exc))
        return None

    async def _output(self, r: _Request, out: RequestOutput) -> RequestOutput:
        """An output of P or D, as the client gets it; P's first token starts the handoff
        (unless D was named early and told P where to send)."""
        c, state = self.client, r.state
        if out.error is not None or out.finished:
            r.finished = True
        if state.output(out):
            r.handoff_since = time.monotonic()
            if r.naming is not None:  # P was told where to send unless naming failed
                r.early, r.naming = await r.naming, None
            if not r.early:
                r.handoff = asyncio.create_task(self._handoff(r.stream, state.request_id, state.prefill,
                                                              state.add.prompt_token_ids,
                                                              salt=state.add.params.kv_salt))
            elif r.done_early is not None:
                r.stream.queue.put_nowait(r.done_early)
        if out.finished:
            c.learn(state.request_id, len(state.tokens), out.finish_reason)
        if (r.finished and state.phase is Phase.DECODE and out.finish_reason in COMPLETE
                and self.pd_mode == "pd-caching-3" and r.stream.worker != state.prefill
                and c.cluster.workers[state.prefill].alive):
            self._return_kv(r.stream.worker, state.prefill, state.add.prompt_token_ids + state.tokens,
                            state.add.params.kv_salt)
        return out

    async def _end(self, r: _Request) -> None:
        """The request left the flow (finished, failed, or its client went away): stop its
        tasks, and unless it finished where it should, have every instance it touched
        free what it holds for it."""
        rid = r.state.request_id
        self.client.release(rid)
        for task in (r.handoff, r.naming):
            if task is not None:
                task.cancel()
        if not r.finished or ((r.early or r.naming is not None) and r.state.phase is Phase.PREFILL):
            # (D holds what it pinned, or P sent, for a request that ended on P)
            for instance in {i for i in (r.state.prefill, r.stream.worker, r.stream.peer) if i is not None}:
                await self.client.send_abort(instance, rid)

    def _healthy(self, *instances: int | None) -> bool:
        """Alive and heartbeating (a long step alone does not count: the handoff is served
        after it)."""
        now = time.monotonic()
        workers = [self.client.cluster.workers[i] for i in instances if i is not None]
        return all(h.alive and now - h.last_heartbeat <= DEGRADED_AFTER_HEARTBEATS * h.config.heartbeat_s
                   for h in workers)

    def _pick_decode(self, prompt: list[int], exclude: int | None = None, salt: str | None = None) -> int:
        """``pick_decode`` among the decode instances as they are now; by prefix only where
        they cache."""
        return pick_decode(self.client.views(), exclude, prompt if self.decode_caches else None, cache_salt=salt)

    async def _send_prefill(self, stream: RequestStream, add: AddRequest, prefill: int) -> tuple[bool, asyncio.Task | None]:
        """Send the request to P with D named early: by-layer, before P gets it (whether
        that worked, no task); other modes, while P prefills (a task: the prefill is not
        held up by D's answer; its result is whether P was told)."""
        rid, prompt = add.request_id, add.prompt_token_ids
        if self._by_layer(prefill):
            early = await self._handoff(stream, rid, prefill, prompt, early=True, salt=add.params.kv_salt)
            await self.client.channel.send(prefill, add)
            return early, None
        await self.client.channel.send(prefill, add)
        return False, asyncio.get_running_loop().create_task(self._handoff(stream, rid, prefill, prompt, early=True,
                                                                           salt=add.params.kv_salt))

    def _pick_fresh(self, add: AddRequest, tokens: list[int], exclude: int | None) -> int:
        """Where a request goes on without its KV: a live decode instance, else a live
        prefill instance, which runs the rest of it itself (``EngineUnavailable`` when no
        instance is live)."""
        try:
            return self._pick_decode(add.prompt_token_ids, exclude=exclude, salt=add.params.kv_salt)
        except EngineUnavailable:
            route = RouteRequest(add.request_id, add.prompt_token_ids + tokens, add.session_id, {},
                                 add.params.max_tokens - len(tokens), 1, add.params.kv_salt)
            return self.client.pick_worker(route).instance

    def _by_layer(self, prefill: int) -> bool:
        return self.client.cluster.workers[prefill].config.engine.transfer_mode == "by-layer"

    async def _handoff(self, stream: RequestStream, request_id: str, prefill: int, prompt: list[int],
                       early: bool = False, salt: str | None = None) -> bool:
        """Name the decode instance, let it pin what it has, and start P's send (``early``:
        tell P where to send before its prefill ends); whether P was told. On a failure P
        drops the KV and the request resumes without it (``early``: it hands off after its
        first token instead)."""
        c = self.client
        try:
            stream.peer = decode = self._pick_decode(prompt, salt=salt)
            ticket = secrets.token_hex(16)
            num_blocks = math.ceil(len(prompt) / c.block_size)
            # At least the last block is sent: it holds the prompt's tail (a partial block).
            pin = prompt[: (num_blocks - 1) * c.block_size] if self.decode_caches else None
            expect = ExpectTransfer(next(c.transfer_ids), ticket, prefill, num_blocks, pin, request_id,
                                    EARLY_TICKET_TTL_S if early else None, cache_salt=salt)
            # Later, the request's loop watches D's health; before the prefill nothing does.
            reply = await c.ask(decode, expect, self.handoff_timeout_s if early else HANDOFF_MAX_S)
            self.counts["blocks_skipped"] += reply.cached_blocks
            await c.channel.send(prefill, HandoffStart(request_id, decode, ticket, reply.cached_blocks,
                                                       self.decode_caches))
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means: resume without the KV
            if early:
                log.warning("request %s: naming its decode instance before the prefill failed (%r); it hands off "
                            "after its first token", request_id, exc)
                if stream.peer is not None:
                    await c.send_abort(stream.peer, request_id)
                stream.peer = None
                return False
            await c.send_abort(prefill, request_id)  # frees the KV P kept
            stream.queue.put_nowait(HandoffDone(request_id, "", 0, error=f"handoff failed: {exc!r}"))
            return False

    async def _resume(self, stream: RequestStream, add: AddRequest, tokens: list[int], ticket: str, fresh: bool) -> None:
        """Continue the request on a decode instance: the one that has its KV (``ticket``),
        else (``fresh``) another live one (``_pick_fresh``), which recomputes it."""
        c = self.client
        old = stream.peer
        decode = old if not fresh and old is not None else self._pick_fresh(add, tokens, exclude=old)
        if fresh and old is not None:
            await c.send_abort(old, add.request_id)  # frees what it holds for the request
        stream.peer = stream.worker = decode
        self.counts["handoffs" if ticket else "resumed_without_kv"] += 1
        # P sent the prompt logprobs with the first token (none came without one).
        params = dataclasses.replace(add.params, prompt_logprobs=None) if tokens else add.params
        await c.channel.send(decode, dataclasses.replace(add, params=params, handoff=False,
                                                         output_token_ids=list(tokens), kv_ticket=ticket))

    def _return_kv(self, decode: int, prefill: int, tokens: list[int], salt: str | None = None) -> None:
        """pd-caching-3: D's decode-phase KV of the conversation goes back to P, in the
        background; only the blocks P lacks move."""
        async def run() -> None:
            try:
                blocks = await self.client.transfer_prefix(decode, prefill, tokens, incremental=True, cache_salt=salt)
                self.counts["returned_blocks"] += blocks
            except Exception as exc:  # noqa: BLE001 - a lost return only costs a recompute
                log.warning("returning decode KV %d -> %d failed: %s", decode, prefill, exc)
                self.counts["return_failed"] += 1

        task = asyncio.get_running_loop().create_task(run())
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)

    @property
    def pending_returns(self) -> int:
        """pd-caching-3's KV returns still in flight."""
        return len(self._returns)

    def stats(self) -> dict:
        return {"mode": self.pd_mode, **self.counts}
