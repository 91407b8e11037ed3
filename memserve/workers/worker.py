"""Worker process: connects to the gateway over ZeroMQ and drives its engine.

The loop alternates between draining the socket (new requests, aborts, heartbeats) and
one engine step; every step's token deltas go back at once, so streaming clients see
each token as soon as it is sampled. Heartbeats to the gateway go out from a thread of
their own (``heartbeat.py``), on time even during a long step, and peers' KV transfers
are answered between the step's layers too (``step_serving.py``). The worker exits when told
to, on SIGTERM, when its parent dies, or when the gateway's heartbeats stop.

Run as ``python -m memserve.workers.worker [--spare] '<WorkerConfig as JSON>'``. A spare
worker loads the model and warms up ahead of time, then waits to replace a worker that
died: taking over costs a socket and an engine over the ready model, not a cold start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from memserve.config import WorkerConfig
from memserve.ipc.channel import WorkerChannel
from memserve.ipc.kv_transfer import KVTransferEndpoint
from memserve.ipc.messages import (
    AbortRequest,
    AddRequest,
    ExpectTransfer,
    HandoffStart,
    Heartbeat,
    PDStats,
    PeerAddresses,
    RequestOutput,
    Shutdown,
    StepOutputs,
    TransferDone,
    TransferPrefix,
    WorkerError,
    WorkerReady,
    WorkerStats,
)
from memserve.ipc.adapters import AdapterSet, SetAdapter
from memserve.ipc.probe import ProbeDone, ProbeTransfer
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.events import KVEvents
from memserve.kvcache.mempool import KVFlags
from memserve.model_files.generation import eos_token_ids
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.cpu_threads import pin_compute_threads, rank_cpus, rank_threads
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.pd_receiver import KVReceiver
from memserve.workers.engine.pd_sender import HandoffSender
from memserve.workers.heartbeat import HeartbeatThread
from memserve.workers.kv_event_publisher import KVEventPublisher, KVEventsConfig
from memserve.workers.kv_share import shared_pools
from memserve.workers.parent_death import die_with_parent
from memserve.workers.step_serving import ServeBetweenLayers
from memserve.workers.warmup import warm_up

if TYPE_CHECKING:
    from memserve.workers.model_runner import ModelRunner  # imported by ``prepare``: torch and the model

log = logging.getLogger("memserve.worker")

# Missed gateway heartbeats after which a worker decides it has been orphaned.
GATEWAY_SILENCE_HEARTBEATS = 15
# How often an idle loop looks at prefix transfers in flight.
PUSH_POLL_MS = 5


class Worker:
    """The process around its instance: the model is prepared and the gateway connected in
    either order (a spare prepares before it knows its id), then ``serve`` runs the
    instance on both."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.id = cfg.instance_id
        self.channel: WorkerChannel | None = None
        self.stopping = False
        self.parent = os.getppid()
        self.runner: ModelRunner | None = None
        self.eos_token_ids: set[int] = set()
        self.instance: Instance | None = None

    def prepare(self, spare: bool = False) -> None:
        """The heavy part of starting, which needs no identity: the model, its KV pool and
        the warm-up (on a throwaway engine). A spare worker does it ahead of time (its
        tensor-parallel ranks, if any, then share every CPU it may run on)."""
        from memserve.workers.real_engine import build_runner  # heavy: torch and the model

        model_dir = ensure_model_dir(self.cfg.engine.model)
        self.runner = build_runner(self.cfg.engine, model_dir, None if spare else self.id)
        self.eos_token_ids = eos_token_ids(model_dir)
        started = time.monotonic()
        steps = warm_up(Engine(self.cfg.engine, self.runner, self.eos_token_ids, -1))
        log.info("warmed up in %.1f s (%d steps)", time.monotonic() - started, steps)

    def connect(self) -> WorkerChannel:
        self.channel = WorkerChannel(self.cfg.gateway_addr, self.id)
        return self.channel

    def serve(self) -> None:
        """Become instance ``self.id`` on the prepared model and serve until told to stop."""
        assert self.runner is not None and self.channel is not None, "prepare() and connect() come first"
        self.instance = Instance(self.cfg, self.runner, self.eos_token_ids, self.channel, self.parent)
        self.instance.stopping = self.stopping  # a SIGTERM while it started
        self.instance.run()

    def stop(self) -> None:
        """Ask the loop to end (SIGTERM), before the instance starts or while it runs."""
        self.stopping = True
        if self.instance is not None:
            self.instance.stopping = True

    def close(self) -> None:
        if self.instance is not None:
            self.instance.close()
        if self.channel is not None:
            self.channel.close()


class Instance:
    """Instance ``cfg.instance_id`` on a prepared model. Its engine, the KV endpoint peers
    reach it on and both sides of the PD handoff exist from the start, which reports
    ready; ``run`` drives them until told to stop."""

    def __init__(self, cfg: WorkerConfig, runner: ModelRunner, eos_token_ids: set[int], channel: WorkerChannel,
                 parent: int) -> None:
        self.cfg = cfg
        self.id = cfg.instance_id
        self.channel = channel
        self.parent = parent  # the gateway's pid: the loop exits once it is another
        self.runner = runner
        self.stopping = False
        self.heartbeat: HeartbeatThread | None = None  # started by ``run``
        # Prefix pushes and link probes in flight: what asked for each, its held blocks, its send.
        self._pushes: list[tuple[TransferPrefix | ProbeTransfer, list[int], Future]] = []
        self.engine = e = Engine(cfg.engine, runner, eos_token_ids, self.id)
        # On one machine, the KV socket is a file in the gateway's private (0700) runtime
        # directory: no other user can reach it, and it listens on no port.
        bind = f"ipc://{cfg.runtime_dir}/kv-{self.id}" if cfg.runtime_dir else f"tcp://{cfg.internal_host}:*"
        # Same-host peers map this worker's pools and copy blocks out of them (kv_share.py);
        # a tensor-parallel worker's blocks are split over its ranks' pools: they go as frames.
        transport = cfg.engine.kv_same_host_transport if cfg.engine.tensor_parallel_size == 1 else "zmq"
        self.endpoint = KVTransferEndpoint(e.mempool, bind, shared=shared_pools(runner.pools, transport))
        if cfg.engine.tensor_parallel_size == 1:
            # Peers' transfers answered between a step's layers. Not with several ranks: a
            # transfer is a call to every rank, and the others are inside the step then.
            e.kv_connector.add_step_hooks(ServeBetweenLayers(self.endpoint.serve).for_step)
        # Disaggregated prefill/decode, both sides.
        self.sender, self.receiver = HandoffSender(e, self.endpoint), KVReceiver(e, self.endpoint)
        channel.watch(self.endpoint.socket)
        self.kv_publisher = self._start_kv_publisher()  # --kv-events-config: vLLM-format KV events
        channel.send(WorkerReady(self.id, cfg.role, runner.num_blocks, cfg.engine.block_size,
                                 e.max_model_len, self._stats(), self.endpoint.address))

    def run(self) -> None:
        hb = self.cfg.heartbeat_s
        last_published = last_heard = time.monotonic()
        self.heartbeat = heartbeat = HeartbeatThread(self.cfg.gateway_addr, self.id, hb)
        heartbeat.publish(self._stats())
        heartbeat.start()
        while not self.stopping:
            heartbeat.tick()
            timeout_ms = (0 if self.engine.has_work else PUSH_POLL_MS if self._pushes or self.sender.busy
                          else int(hb * 1000))
            outputs: list[RequestOutput] = []
            messages = self.channel.poll(timeout_ms)
            polled = time.monotonic()
            for msg, _bulk in messages:
                if isinstance(msg, Heartbeat):
                    last_heard = polled
                else:
                    outputs += self._handle(msg)
            # Judge silence at poll time: a long engine step must not look like silence.
            if polled - last_heard > GATEWAY_SILENCE_HEARTBEATS * hb or os.getppid() != self.parent:
                log.warning("worker %d: gateway is gone, exiting", self.id)
                break
            self.endpoint.serve(0)
            for arrived in self.receiver.on_received(self.endpoint.drain_received()):
                self.channel.send(arrived)
            self.receiver.reclaim()
            self._finish_pushes()
            for done in self.sender.poll():
                self.channel.send(done)
            if self.engine.has_work:
                outputs += self._step()
            else:
                self.engine.sweep_expired()  # cached conversations expire while idle too
            outputs = self.sender.filter(outputs)
            if outputs:
                self.channel.send(StepOutputs(self.id, outputs))
            events = self.engine.drain_kv_events()
            if events:
                if self.kv_publisher is not None:
                    self.kv_publisher.publish(events)
                self.channel.send(KVEvents(self.id, events))
            now = time.monotonic()
            if now - last_published >= hb / 2:
                heartbeat.publish(self._stats())
                last_published = now

    def _handle(self, msg: object) -> list[RequestOutput]:
        if isinstance(msg, AddRequest) and msg.handoff:
            out = self.sender.add(msg)
            return [out] if out else []
        if isinstance(msg, AddRequest) and msg.output_token_ids:
            out = self.receiver.resume(msg)
            return [out] if out else []
        if isinstance(msg, AddRequest):
            # The gateway stamps arrival on its wall clock; the engine keeps its own clock.
            waited = max(0.0, time.time() - msg.arrival_time) if msg.arrival_time else 0.0
            out = self.engine.add_request(msg, self.engine.clock() - waited)
            return [out] if out else []
        if isinstance(msg, AbortRequest):
            out = self.engine.abort(msg.request_id)
            self.sender.abort(msg.request_id)
            self.receiver.abort(msg.request_id)
            return [out] if out else []
        if isinstance(msg, Shutdown):
            self.stopping = True
            return []
        if isinstance(msg, PeerAddresses):
            for instance, addr in msg.addrs.items():
                if int(instance) != self.id:
                    self.endpoint.connect(int(instance), addr)
            return []
        if isinstance(msg, ExpectTransfer):
            self.channel.send(self.receiver.expect(msg))
            return []
        if isinstance(msg, HandoffStart):
            done = self.sender.start(msg)
            if done is not None:
                self.channel.send(done)
            return []
        if isinstance(msg, TransferPrefix):
            self._push_prefix(msg)
            return []
        if isinstance(msg, ProbeTransfer):
            self._probe_link(msg)
            return []
        if isinstance(msg, SetAdapter):
            self.channel.send(self._set_adapter(msg))
            return []
        log.warning("worker %d: unexpected message %r", self.id, msg)
        return []

    def _set_adapter(self, msg: SetAdapter) -> AdapterSet:
        """Serve (or stop serving) a LoRA adapter between steps; a refusal is the answer."""
        try:
            self.runner.set_adapter(msg.name, msg.path, msg.digest)
        except (ValueError, RuntimeError) as exc:  # lora.AdapterError is a ValueError; RuntimeError: another rank's
            return AdapterSet(msg.transfer_id, str(exc))
        log.info("worker %d: LoRA adapter %r %s", self.id, msg.name,
                 f"served from {msg.path}" if msg.path else "no longer served")
        return AdapterSet(msg.transfer_id)

    def _push_prefix(self, msg: TransferPrefix) -> None:
        """Start sending the cached prefix of ``msg.token_ids`` to another instance, which
        indexes it as its own historical KV; the engine keeps stepping while it goes."""
        kv = self.engine.kv_connector
        addrs = kv.hold_prefix(msg.token_ids, msg.cache_salt)
        skip = min(msg.first_block, len(addrs))  # the receiver holds these already
        if skip:
            kv.free(addrs[:skip])
            addrs = addrs[skip:]
        if not addrs:
            self.channel.send(TransferDone(msg.transfer_id, 0))
            return
        tokens = msg.token_ids[: (skip + len(addrs)) * self.cfg.engine.block_size]
        self._push(msg, addrs, lambda: self.endpoint.send_async(
            msg.dst_instance, addrs, None, KVFlags.RELEASE, None, msg.ticket, tokens, skip, cache_salt=msg.cache_salt))

    def _probe_link(self, msg: ProbeTransfer) -> None:
        """Send ``msg.num_blocks`` blocks of the pool, whatever they hold, to another
        instance, which frees them: the gateway times it to price prefix pulls over that
        link (``gateway/link_probe.py``)."""
        try:
            addrs = self.engine.kv_connector.alloc(msg.num_blocks)
        except MemPoolError as exc:  # no room: the link stays unmeasured
            self.channel.send(ProbeDone(msg.transfer_id, 0, str(exc)))
            return
        self._push(msg, addrs, lambda: self.endpoint.send_async(
            msg.dst_instance, addrs, None, KVFlags.RELEASE, None, msg.ticket))

    def _push(self, msg: TransferPrefix | ProbeTransfer, addrs: list[int], send: Callable[[], Future]) -> None:
        """Start sending held blocks ``addrs``; ``_finish_pushes`` answers ``msg`` when the
        send ends, and frees them."""
        try:
            sent = send()
        except Exception as exc:
            sent = Future()
            sent.set_exception(exc)
        self._pushes.append((msg, addrs, sent))

    def _finish_pushes(self) -> None:
        """Report the prefix transfers and link probes that ended and drop their references."""
        pending = []
        for msg, addrs, sent in self._pushes:
            if not sent.done():
                pending.append((msg, addrs, sent))
                continue
            self.engine.kv_connector.free(addrs)
            error = sent.exception()
            if error is not None:
                log.warning("worker %d: transfer to %d failed: %s", self.id, msg.dst_instance, error)
            reason = str(error) if error else None
            if isinstance(msg, ProbeTransfer):
                sent_bytes = 0 if error else len(addrs) * self.engine.kv_connector.block_nbytes
                self.channel.send(ProbeDone(msg.transfer_id, sent_bytes, reason))
            else:
                self.channel.send(TransferDone(msg.transfer_id, 0 if error else len(addrs), reason))
        self._pushes = pending

    def _start_kv_publisher(self) -> KVEventPublisher | None:
        """With ``--kv-events-config``: publish the MemPool's tier changes in vLLM's format
        on this instance's endpoints, with the tokens of the blocks stored."""
        if not self.cfg.kv_events_config:
            return None
        cfg = KVEventsConfig.from_dict(self.cfg.kv_events_config)
        if not cfg.enabled:
            return None
        try:
            publisher = KVEventPublisher(cfg.for_instance(self.id), self.cfg.engine.block_size, {},
                                         data_parallel_rank=self.id)
        except Exception as exc:  # a port in use: serve anyway, without the outside stream
            log.error("worker %d: cannot publish KV events (%r); serving without them", self.id, exc)
            return None
        self.engine.mempool.event_tokens = publisher.translator.event_tokens
        self.engine.mempool.event_adapters = publisher.translator.event_adapters
        return publisher

    def _stats(self) -> WorkerStats:
        """The engine's statistics and the KV handoffs' (both sides, and how many went in place)."""
        pd = PDStats(**self.sender.stats(), **self.receiver.stats(), **self.endpoint.stats())
        stats = WorkerStats.from_report(self.engine.stats(), pd)
        loras = self.runner.loras
        return dataclasses.replace(stats, tensor_parallel_comm_s=self.runner.tp.comm_seconds,
                                   lora_adapters=loras.ready() if loras else [],
                                   lora_load_s=loras.mean_load_s if loras else 0.0,
                                   kv_cache_dtype=str(self.runner.pools.dtype).removeprefix("torch."))

    def _step(self) -> list[RequestOutput]:
        """One engine step; a failure fails the requests in flight, not the worker."""
        try:
            return self.engine.step()
        except Exception:
            log.error("worker %d: engine step failed:\n%s", self.id, traceback.format_exc())
            failed = []
            for request_id in self.engine.scheduler.request_ids():
                out = self.engine.abort(request_id)
                if out is None:  # a choice, aborted already with its request
                    continue
                out.finish_reason, out.error = "error", "internal error in the engine step"
                failed.append(out)
            return failed

    def close(self) -> None:
        self.engine.close()  # saves in flight finish: their block files are whole
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        self.endpoint.close()


def main(argv: list[str] | None = None) -> None:
    """``worker.py CONFIG`` starts instance ``CONFIG.instance_id``; ``worker.py --spare
    CONFIG`` prepares, then waits for the instance id to become on its stdin (a line; end
    of file means: not needed, exit)."""
    argv = sys.argv[1:] if argv is None else argv
    spare = argv[0] == "--spare"
    cfg = WorkerConfig.from_dict(json.loads(argv[-1]))
    _configure_logging("spare" if spare else cfg.instance_id)
    if cfg.engine.device == "cpu":  # before torch loads (prepare imports it)
        ranks = cfg.engine.tensor_parallel_size
        cpus = rank_cpus(cfg.engine.cpu_threads_bind, None if spare else cfg.instance_id, 0, ranks)
        pin_compute_threads(cpus, rank_threads(cfg.engine.cpu_threads, cpus, ranks))
    die_with_parent()  # SIGTERM when the gateway dies
    # Ctrl-C reaches the whole process group; the gateway shuts workers down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = Worker(cfg)

    def on_term(*_: object) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, on_term)
    try:
        if spare:
            worker.prepare(spare=True)
            print("ready", flush=True)  # the gateway reads this on the spare's stdout
            line = sys.stdin.readline().strip()
            if not line or worker.stopping:
                return
            # Nobody reads the pipe on stdout any more: a full pipe must never block a write.
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
            worker.id = cfg.instance_id = int(line)
            _configure_logging(worker.id)
            worker.connect()
            log.info("spare worker takes over as worker %d", worker.id)
        else:
            channel = worker.connect()
            try:
                worker.prepare()
            except Exception as exc:
                channel.send(WorkerError(worker.id, f"worker {worker.id} failed to start: {exc!r}"))
                raise
        worker.serve()
    finally:
        worker.close()


def _configure_logging(name: int | str) -> None:
    logging.basicConfig(level=os.environ.get("MEMSERVE_LOG_LEVEL", "INFO"), force=True,
                        format=f"%(asctime)s worker{name} %(levelname)s %(message)s")


if __name__ == "__main__":
    main()
