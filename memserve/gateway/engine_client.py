"""The gateway's side of the workers: sends requests over ZeroMQ, fans token deltas back
out to per-request streams, exchanges heartbeats, keeps each worker's KV mirror, and
moves the requests of a worker that died to live ones (``request_retry.py``; then
restarts it). Outputs reach a request's stream only from its current worker, and none
from a worker once its process has exited, so a request that moved never sees a token of
its old run after the ones its move accounted for."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections import Counter
from typing import TYPE_CHECKING, AsyncIterator

from memserve.gateway.cluster import Cluster, WorkerHandle
from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.link_probe import measure_links
from memserve.gateway.lora_adapters import AdapterRegistry, WorkerAdapters
from memserve.gateway.pd_flow import HANDOFF_TIMEOUT_S, PDFlow
from memserve.gateway.request_retry import Move, RequestProgress
from memserve.gateway.request_stream import RETRY, RequestStream
from memserve.gateway.routing.admission import OFF, Admission, predict
from memserve.gateway.routing.pd_topology import is_disaggregated
from memserve.gateway.routing.router import (
    RESTART_RETRY_AFTER_S,
    LeastLoad,
    RouteDecision,
    Router,
    RouteRequest,
    WorkerView,
)
from memserve.ipc.channel import GatewayChannel, WorkerUnreachable
from memserve.ipc.messages import (
    AbortRequest,
    AddRequest,
    ExpectTransfer,
    HandoffDone,
    Heartbeat,
    PeerAddresses,
    RequestOutput,
    SamplingParams,
    Shutdown,
    StepOutputs,
    TransferDone,
    TransferExpected,
    TransferPrefix,
    WorkerError,
    WorkerReady,
    WorkerStats,
    choice_request_id,
)
from memserve.ipc.adapters import AdapterSet, SetAdapter
from memserve.ipc.probe import ProbeDone, ProbeTransfer
from memserve.kvcache.events import KVEvents
from memserve.kvcache.mirror import PromptTreeMirror

if TYPE_CHECKING:  # scikit-learn: imported only when the predictor is on
    from memserve.predictor.predictor import Predictor

log = logging.getLogger("memserve.gateway")

# Seconds a prefix pull may take before the request is sent on to recompute instead.
PULL_TIMEOUT_S = 10.0


def worker_entry(stats: WorkerStats) -> dict:
    """The figures of a worker's latest heartbeat as its entry in ``stats()["workers"]``
    shows them (and so /health, /metrics and /v1/stats)."""
    tiers = stats.mempool.tiers
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_preemptions": stats.num_preemptions,
        "num_held_admissions": stats.num_held_admissions,
        "preemptions": stats.preemptions,  # by kind: swap, recompute
        # The schedule policy's KV allocation (cacheopt): reserve and padding in use.
        "kv_allocation": {} if stats.kv_allocation is None else dataclasses.asdict(stats.kv_allocation),
        # Allocatable blocks per tier: free plus cached-but-evictable.
        "free_blocks": {t: v.free + v.evictable for t, v in tiers.items()},
        # Blocks the worker's index holds per tier (what its KV events describe).
        "cached_blocks": {t: v.cached for t, v in tiers.items()},
        # Blocks pinned by requests' cache_control per tier (kvcache/pinning.py).
        "pinned_blocks": {t: v.pinned for t, v in tiers.items()},
        # Per tier: bytes used, blocks matched, bytes read and written, blocks being saved down.
        "kv_tiers": {t: {k: v for k, v in dataclasses.asdict(io).items() if v is not None}
                     for t, io in stats.mempool.tier_io.items()},
        "kv_save_queue": stats.mempool.save_queue,
        "cache_hit_rate": stats.cache_hit_rate,
        "cached_tokens_total": stats.cached_tokens_total,
        "prompt_tokens_total": stats.prompt_tokens_total,
        # Per tier: pool size, allocatable (as free_blocks) and blocks in the index.
        "kv_blocks": {t: {"total": v.total, "free": v.free + v.evictable, "cached": v.cached}
                      for t, v in tiers.items()},
        "pd": dataclasses.asdict(stats.pd),  # KV handoffs sent (prefill) and received (decode)
        # N-gram speculative decoding (--speculative-config): drafts proposed and accepted.
        "spec_decode": {"draft_tokens": stats.spec_draft_tokens_total,
                        "accepted_tokens": stats.spec_accepted_tokens_total},
        "tensor_parallel_comm_s": stats.tensor_parallel_comm_s,  # rank 0's time in collectives
        "kv_cache_dtype": stats.kv_cache_dtype,  # the KV pools' element type (--kv-cache-dtype)
        "num_steps": stats.num_steps,
    }


class WorkerStartError(RuntimeError):
    pass


class ZmqEngineClient:
    """Implements ``gateway.engine_protocol.EngineClient`` over real worker processes."""

    def __init__(self, channel: GatewayChannel, cluster: Cluster, block_size: int, heartbeat_s: float = 1.0,
                 router: Router | None = None, admission: Admission | None = None, pd_mode: str = "pd-caching-3",
                 handoff_timeout_s: float = HANDOFF_TIMEOUT_S, adapters: AdapterRegistry | None = None) -> None:
        self.channel = channel
        self.cluster = cluster
        self.router = router if router is not None else Router(LeastLoad())
        self.admission = admission if admission is not None else Admission(OFF)
        self.heartbeat_s = heartbeat_s
        self.block_size = block_size
        self.max_model_len = 0
        self.mirrors = {i: PromptTreeMirror(i, block_size) for i in cluster.workers}
        self.streams: dict[str, RequestStream] = {}
        self.moves: Counter[str] = Counter()  # requests moved off a dead worker, by kind (request_retry.Move)
        self._tasks: list[asyncio.Task] = []
        self._start_error: str | None = None
        self._transfers: dict[int, asyncio.Future[TransferDone | TransferExpected | ProbeDone | AdapterSet]] = {}
        self.transfer_ids = itertools.count(1)
        roles = [h.config.role for h in cluster.workers.values()]
        self.pd = PDFlow(self, pd_mode, handoff_timeout_s) if is_disaggregated(roles) else None
        self.predictor: Predictor | None = None  # set by the server once bootstrapped (--predictor on)
        self.adapters = WorkerAdapters(self, adapters if adapters is not None else AdapterRegistry())

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        """Spawn the workers and wait until every one reports ready."""
        self.cluster.spawn_all()
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_loop())]
        deadline = time.monotonic() + timeout_s
        while not all(h.ready for h in self.cluster.workers.values()):
            if self._start_error:
                raise WorkerStartError(self._start_error)
            exited = self.cluster.exited_before_ready()
            if exited:
                process = exited[0].process
                raise WorkerStartError(f"worker {exited[0].instance_id} exited with code "
                                       f"{process.returncode if process else None} before it was ready")
            if time.monotonic() > deadline:
                raise WorkerStartError(f"workers not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        self.max_model_len = min(h.max_model_len for h in self.cluster.workers.values())
        await self._announce_peers()
        await self.measure_links(list(self.cluster.workers))

    async def _announce_peers(self) -> None:
        """Tell every worker where the others' KV transfer endpoints are."""
        peers = PeerAddresses(self.cluster.transfer_addrs())
        for h in self.cluster.workers.values():
            if h.alive:
                await self.channel.send(h.instance_id, peers)

    async def _rejoin(self, instance: int) -> None:
        """A restarted worker is ready: everyone learns its new KV endpoint, then its links
        are measured (it may run on another node now)."""
        await self._announce_peers()
        await self.adapters.rejoin(instance)
        await self.measure_links([instance])

    async def measure_links(self, instances: list[int]) -> None:
        """When the live workers span nodes, measure the KV link between each of
        ``instances`` and every other live worker, and have the router price pulls over
        them by it (``link_probe.py``); on one node the cost model's transfer(), profiled
        on one machine, stands for every pair. The worker of ``instances`` sends: a
        restarted one has nothing cached that the probe's blocks could evict."""
        live = {i: h for i, h in self.cluster.workers.items() if h.alive}
        if len({h.node_id for h in live.values()}) < 2:
            return
        pairs: list[tuple[int, int]] = []
        for a in (i for i in instances if i in live):
            pairs += [(a, b) for b in live if b != a and (b, a) not in pairs]
        self.router.use_links(await measure_links(
            self, [(a, b, min(live[a].num_blocks, live[b].num_blocks)) for a, b in pairs]))

    async def close(self) -> None:
        for h in self.cluster.workers.values():
            if h.alive:
                try:
                    await self.channel.send(h.instance_id, Shutdown())
                except Exception:
                    pass
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.cluster.stop_all)
        self.channel.close()

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None, slo: dict | None = None, streaming: bool = True, *,
                       instance: int | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's token deltas; ``instance`` pins it to one worker. A request
        whose worker dies moves to a live worker (``request_retry.py``): ``streaming``
        says whether the caller passes the deltas on as they come (it resumes after them)
        or collects the answer (it is re-run). When it cannot move it ends with an error
        output, or raises ``EngineUnavailable`` while nothing was produced and no live
        worker is left. With ``params.n > 1`` the outputs of all choices come here, each
        with its ``index``, until every choice finished (or one failed)."""
        if request_id in self.streams:
            raise ValueError(f"duplicate request id {request_id}")
        if self.pd is not None and instance is None and self.pd.applies(params, len(prompt_token_ids)):
            async for out in self.pd.generate(request_id, prompt_token_ids, params, session_id, slo):
                yield out
            return
        route = RouteRequest(request_id, prompt_token_ids, session_id, slo or {}, params.max_tokens, params.n,
                             params.kv_salt, params.lora_name)
        if instance is None:
            await self.admit(route)
        decision = self.pick_worker(route) if instance is None else None
        worker = decision.instance if decision is not None else instance
        assert worker is not None  # pinned to ``instance``, else routed
        stream = RequestStream(worker)
        self.streams[request_id] = stream
        progress = RequestProgress(request_id, params, streaming, pinned=instance is not None)
        finished = False
        unfinished = params.n
        try:
            add = self.add_request(request_id, prompt_token_ids, params, session_id, slo)
            await self._send(stream, add, decision)
            while not finished:
                item = await stream.queue.get()
                delta = (await self._move(stream, progress, add, route) if item is RETRY
                         else progress.pass_on(item, stream.worker))
                if delta is None:
                    continue
                if delta.finished:
                    unfinished -= 1
                    self.learn(request_id, len(progress.tokens[delta.index]), delta.finish_reason)
                finished = unfinished == 0 or delta.finish_reason == "error"
                yield delta
        finally:
            self.release(request_id)
            if not finished:
                await self.send_abort(stream.worker, request_id)

    async def _send(self, stream: RequestStream, add: AddRequest, decision: RouteDecision | None) -> None:
        """Send ``add`` to the stream's worker, after the prefix pull the router chose."""
        if decision is not None and decision.pull_from is not None:
            await self.pull_prefix(decision.pull_from, decision.instance, add.prompt_token_ids + add.output_token_ids,
                                   add.params.kv_salt)
        try:
            await self.channel.send(stream.worker, add)
        except WorkerUnreachable as exc:  # it died a moment ago; the watch loop restarts it
            raise EngineUnavailable(str(exc), RESTART_RETRY_AFTER_S) from exc

    async def _move(self, stream: RequestStream, progress: RequestProgress, add: AddRequest,
                    route: RouteRequest) -> RequestOutput | None:
        """Move a request whose worker died to a live one; the error output that ends it
        when it cannot move."""
        lost = stream.worker
        move = progress.choose()
        if move is Move.FAIL:
            return progress.failed(f"worker {lost} died")
        moved, moved_route = progress.move(move, add, route)
        try:
            decision = self.pick_worker(moved_route)
        except EngineUnavailable:
            if not progress.produced:
                raise  # nothing reached the caller: it answers 503 with Retry-After
            return progress.failed(f"worker {lost} died and no live worker is left")
        stream.worker = decision.instance
        self.moves[move.value] += 1
        log.warning("request %s: worker %d died; %s on worker %d (%d tokens given)", add.request_id, lost,
                    move.value, stream.worker, sum(map(len, progress.tokens)))
        try:
            await self._send(stream, moved, decision)
        except EngineUnavailable:
            if not progress.produced:
                raise
            return progress.failed(f"worker {lost} died and worker {stream.worker} is unreachable")
        return None

    async def abort(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            await self.send_abort(stream.worker, request_id)
            stream.queue.put_nowait(RequestOutput(request_id, [], True, "abort"))

    async def abort_choice(self, request_id: str, index: int) -> None:
        """Stop one choice of an n > 1 request; the request goes on with the others."""
        stream = self.streams.get(request_id)
        if stream is not None:
            await self.send_abort(stream.worker, choice_request_id(request_id, index))

    async def transfer_prefix(self, src: int, dst: int, token_ids: list[int], timeout_s: float = 60.0,
                              incremental: bool = False, cache_salt: str | None = None) -> int:
        """Have worker ``src`` push its cached prefix of ``token_ids`` to worker ``dst``;
        returns the number of blocks that arrived there. ``dst`` is told to expect the
        transfer under a fresh ticket before ``src`` starts it; ``incremental``: ``dst``
        pins what it caches of them and only the blocks after that are sent. ``cache_salt``:
        the request's, which names the prefix's blocks at both ends."""
        tid = next(self.transfer_ids)
        ticket = secrets.token_hex(16)
        name = f"transfer-{tid}"  # an abort under this name frees dst's pins if nothing arrives
        expected = await self.ask(dst, ExpectTransfer(tid, ticket, src, len(token_ids) // self.block_size,
                                                       list(token_ids) if incremental else None, name,
                                                       cache_salt=cache_salt), timeout_s)
        try:
            reply = await self.ask(src, TransferPrefix(tid, list(token_ids), dst, ticket, expected.cached_blocks,
                                                       cache_salt), timeout_s)
        finally:
            if incremental:
                await self.send_abort(dst, name)
        if reply.error:
            raise RuntimeError(f"prefix transfer {src} -> {dst} failed: {reply.error}")
        return reply.num_blocks

    async def ask(self, worker: int, msg: ExpectTransfer | TransferPrefix | ProbeTransfer | SetAdapter,
                  timeout_s: float):
        """Send a message and wait for the worker's answer to it (by its ``transfer_id``)."""
        answer = self._transfers[msg.transfer_id] = asyncio.get_running_loop().create_future()
        try:
            await self.channel.send(worker, msg)
            return await asyncio.wait_for(answer, timeout_s)
        finally:
            self._transfers.pop(msg.transfer_id, None)

    async def send_abort(self, worker: int, request_id: str) -> None:
        try:
            await self.channel.send(worker, AbortRequest(request_id))
        except Exception:  # the worker is gone; its requests are failed by the watcher
            pass

    async def pull_prefix(self, src: int, dst: int, token_ids: list[int], cache_salt: str | None = None) -> None:
        """MemServe eq. 2: the router found it cheaper to move ``src``'s longer cached
        prefix to ``dst`` than to recompute it there. A failed pull only means recompute."""
        try:
            await self.transfer_prefix(src, dst, token_ids, PULL_TIMEOUT_S, cache_salt=cache_salt)
            self.router.pull_done(True)
        except Exception as exc:  # the worker died, timed out or refused: compute instead
            log.warning("prefix pull %d -> %d failed (%s); the prompt is recomputed", src, dst, exc)
            self.router.pull_done(False)

    async def admit(self, request: RouteRequest) -> None:
        """Admission control on the request's TTFT SLO; needs the router's cost model."""
        ttft_ms = request.slo.get("ttft_ms")
        if ttft_ms is None or self.router.cost is None:
            return
        cost = self.router.cost
        await self.admission.admit(ttft_ms / 1000.0, lambda: predict(
            self.router.candidates(request, self.views()), cost, request, self.block_size, self.router.ledger))

    def views(self) -> list[WorkerView]:
        """The workers as they are now."""
        in_flight = Counter(stream.worker for stream in self.streams.values())
        states = self.cluster.states(self.router.ledger.work_s)
        return [WorkerView(i, states[i], in_flight[i], h.stats, self.mirrors[i], h.config.role)
                for i, h in self.cluster.workers.items()]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     session_id: str | None, slo: dict | None, handoff: bool = False) -> AddRequest:
        """The worker's message for a new request, colocated or disaggregated alike: its
        SLOs and the predictor's output length (None when the predictor is off or untrained)."""
        slo = slo or {}
        predicted = (None if self.predictor is None
                     else self.predictor.predict(request_id, prompt_token_ids, params.max_tokens))
        return AddRequest(request_id, list(prompt_token_ids), params, session_id, time.time(),
                          slo.get("priority", 0), slo.get("ttft_ms"), slo.get("tbt_ms"), predicted, handoff=handoff)

    def release(self, request_id: str) -> None:
        """A request is over, colocated or disaggregated: forget its stream, prediction and
        routing load, and let a queued admission look again."""
        if self.predictor is not None:
            self.predictor.forget(request_id)
        self.streams.pop(request_id, None)
        self.router.release(request_id)
        self.admission.notify()

    def learn(self, request_id: str, output_tokens: int, finish_reason: str | None) -> None:
        """Feed a finished choice back to the predictor; a due refit runs off the event loop,
        on idle CPU cycles only."""
        if self.predictor is not None and self.predictor.observe(request_id, output_tokens, finish_reason):
            self.predictor.refit_in_background()

    def pick_worker(self, request: RouteRequest) -> RouteDecision:
        """The router's choice among the workers as they are now."""
        return self.router.route(request, self.views())

    def stats(self) -> dict:
        workers = []
        states = self.cluster.states(self.router.ledger.work_s)
        for h in self.cluster.workers.values():
            mirror = self.mirrors[h.instance_id]
            workers.append({
                "instance_id": h.instance_id,
                "role": h.config.role,
                "device": h.config.engine.device,  # with tensor parallelism, every rank's: cuda:0,1
                "tensor_parallel_size": h.config.engine.tensor_parallel_size,
                "alive": h.alive,
                "state": states[h.instance_id],
                "pid": h.process.pid if h.process is not None else None,
                "node": h.node,  # where it runs: this machine's hostname, or its Ray node's IP
                "node_id": h.node_id,  # the hostname again, or the Ray node's ID (nodes may share an IP)
                "heartbeat_age_s": round(time.monotonic() - h.last_heartbeat, 3) if h.ready else None,
                "restarts": h.restarts,
                **worker_entry(h.stats),
                "mirror_blocks": len(mirror.entries()),
                # The mirror's counts of blocks evicted from the index and demoted a tier (stats page).
                "evicted_blocks": mirror.removed_blocks,
                "demoted_blocks": mirror.demoted_blocks,
            })
        return {"workers": workers, "spare_workers": self.cluster.spare_states(),
                "num_requests_in_flight": len(self.streams), "moved_requests": dict(self.moves),
                "router": self.router.stats(),
                "admission": self.admission.stats(), **({"pd": self.pd.stats()} if self.pd else {}),
                **({"predictor": self.predictor.stats()} if self.predictor else {})}

    # ------------------------------------------------------------------ loops
    async def _recv_loop(self) -> None:
        while True:
            try:
                instance_id, msg, _bulk = await self.channel.recv()
                self._dispatch(instance_id, msg)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("bad message from a worker")

    def _dispatch(self, instance_id: int, msg) -> None:
        if isinstance(msg, StepOutputs):
            if not self.cluster.workers[instance_id].alive:
                return  # a dead worker's last outputs: its requests move on without them
            for out in msg.outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None and stream.worker == instance_id:
                    self.router.observe(out.request_id, len(out.new_token_ids))
                    if out.new_token_ids and not stream.started:  # its prefill left the queued work
                        stream.started = True
                        self.admission.notify()
                    stream.queue.put_nowait(out)
        elif isinstance(msg, KVEvents):
            self.mirrors[instance_id].apply(msg)
            self.router.kv_events_applied(self.mirrors[instance_id])
        elif isinstance(msg, Heartbeat):
            self.cluster.heartbeat(instance_id, msg.stats)
        elif isinstance(msg, HandoffDone):  # from the prefill instance, or the decode one the KV reached
            stream = self.streams.get(msg.request_id)
            if stream is not None and instance_id in (stream.worker, stream.peer):
                stream.queue.put_nowait(msg)
        elif isinstance(msg, (TransferDone, TransferExpected, ProbeDone, AdapterSet)):
            future = self._transfers.get(msg.transfer_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, WorkerReady):
            self.cluster.mark_ready(instance_id, msg.num_blocks, msg.max_model_len, msg.stats, msg.transfer_addr)
            if self.max_model_len:  # a restarted worker
                self._tasks.append(asyncio.get_running_loop().create_task(self._rejoin(instance_id)))
            log.info("worker %d ready: %d KV blocks of %d tokens, context %d", instance_id, msg.num_blocks,
                     msg.block_size, msg.max_model_len)
        elif isinstance(msg, WorkerError):
            log.error("%s", msg.message)
            self._start_error = msg.message

    async def _watch_loop(self) -> None:
        """Heartbeats to the workers; fail and restart the ones that died."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.time()
            for h in self.cluster.workers.values():
                if h.alive:
                    try:
                        await self.channel.send(h.instance_id, Heartbeat(-1, now))
                    except Exception:
                        pass
            for h in self.cluster.find_dead():
                self._fail_worker(h)
            self.cluster.refill_spares()

    def _fail_worker(self, h: WorkerHandle) -> None:
        log.error("worker %d died (exit code %s); moving its requests and restarting it", h.instance_id,
                  h.process.poll() if h.process else None)
        for stream in self.streams.values():
            if h.instance_id in (stream.worker, stream.peer):
                stream.queue.put_nowait(RETRY)  # the request's own loop moves or fails it
        self.mirrors[h.instance_id].reset()
        self.router.forget_links(h.instance_id)
        self.cluster.restart(h)
