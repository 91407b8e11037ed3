"""Layer-wise preloading of a cached prefix from a slower tier (AttentionStore §3.2.1).

A ``KVLoad`` is copied layer by layer on one background thread: every block's layer 0,
then every block's layer 1, ... The request may be scheduled while its load is still in
flight ("streamable"); its forward pass then waits in ``before_layer(i)`` for layer i's
copy only, so copying layer i+1 overlaps computing layer i. Disk blocks are read whole
first (a block file holds every layer under one checksum, so no byte of it may be used
before the whole file is verified): that read overlaps other requests' steps, and a load
that lost a block is never streamed: it finishes as a whole and the scheduler recomputes
from the first missing block, as without preloading.

Read buffer: the copier may run ``ahead`` layers beyond what the compute needs next:
before the request's first step it copies layers ``0..ahead-1``; while the step computes
layer c it may copy up to layer ``c + 1 + ahead``. ``ahead = 0`` is "pre-loading without
buffer" (the copy starts with the step, one layer ahead); the default sizes it per load by
§3.2's formula from the copy and compute rates measured on earlier loads and steps, plus
the layers of compute that the copy thread's measured wake-up latency lasts.

Asynchronous copies (CUDA, ``copy_stream.py``): a layer's copy may return a ``CopyDone``
instead of completing. ``before_layer(i)`` then waits on the host until layer i's copy is
issued, and makes the compute wait for it on the device (``CopyDone.wait``), not for the
whole load; the load is reported finished once its last copy is complete. The copy and
compute rates are then those of issuing the work, which is what the read buffer bounds.

Thread safety: one condition variable guards every load's progress; the copier thread
and the step's thread only meet there."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue
from threading import Condition, Thread
from typing import Protocol

from memserve.kvcache.address import Tier
from memserve.workers.engine.step_plan import KVLoad, StepPlan

AUTO = -1  # ``--preload-buffer-layers auto``: §3.2's formula, per load
# Waking a throttled copy thread stalls the step a little (a thread hand-off: the GIL, a
# shared core). The automatic buffer is deep enough that these stalls stay under this
# share of the load time (the buffer is the request's own reserved blocks: depth is free).
HANDOFF_SHARE = 0.1


def buffer_layers(num_layers: int, load_s_per_layer: float, compute_s_per_layer: float) -> int:
    """AttentionStore §3.2: S_buf = B (T_load L_hist - T_pref L_new), the bytes loaded in the
    time the loading outlasts the compute. Per layer, one buffered layer holds what loads
    in ``load_s_per_layer``, so the buffer is ``L (t_load - t_compute) / t_load`` layers
    (rounded up): 0 when the compute of a layer covers the load of the next."""
    gap = load_s_per_layer - compute_s_per_layer
    if gap <= 0 or load_s_per_layer <= 0:
        return 0
    return min(num_layers, math.ceil(num_layers * gap / load_s_per_layer))


@dataclass
class _Rates:
    """Measured costs (exponential moving averages) that size the automatic buffer."""

    copy_s_per_block_layer: float | None = None
    compute_s_per_token_layer: float | None = None
    wake_s: float | None = None  # a throttled copier's start, after the step let it go on
    handoff_s: float | None = None  # the step's stall in a ``before_layer`` that woke the copier

    @staticmethod
    def _ewma(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new


class CopyDone(Protocol):
    """The end of a copy issued asynchronously (a CUDA event)."""

    def wait(self) -> None:
        """Make the compute issued after this call wait for the copy (the caller goes on)."""

    def synchronize(self) -> None:
        """Return once the copy is complete."""


class LoadFailed(RuntimeError):
    """A load's copy raised: the request computing on it fails (the engine isolates it)."""


@dataclass
class _Load:
    request_id: str
    disk: list[tuple[list[int], list[int]]]  # (disk slots, device blocks): read whole first
    streamed: list[tuple[Tier, list[int], list[int]]]  # copied layer by layer
    ahead: int
    num_layers: int
    layerwise: bool  # False: copied whole, like a load before preloading
    loaded: int = 0  # layers of ``streamed`` copied (issued, where copies are asynchronous)
    copied: list[CopyDone | None] = field(default_factory=list)  # per layer issued: what marks its copy's end
    computing: int | None = None  # the layer its step computes; None before its first step
    wake_at: int | None = None  # the copier waits until ``limit()`` reaches this (None: not waiting)
    woken_at: float = 0.0  # when the step let it go on (its wake-up latency is timed from it)
    released: bool = False  # no step will wait for it: copy the rest unthrottled
    streamable: bool = False  # the disk part is in, intact: the request may run now
    reported: bool = False  # streamable was handed to the scheduler
    done: bool = False
    error: BaseException | None = None

    def limit(self) -> int:
        """Layers the copier may have copied by now (the read buffer's bound)."""
        if self.released:
            return self.num_layers
        if self.computing is None:
            return self.ahead
        return self.computing + 2 + self.ahead


@dataclass
class PreloadStats:
    loads: int = 0
    streamed: int = 0  # loads whose request ran while they were still copying
    wait_s: float = 0.0  # time steps spent waiting for a layer: the load time left exposed
    copy_s: float = 0.0  # time the copier spent copying
    ahead: list[int] = field(default_factory=list)  # the buffer each load got (most recent last)


class LayerwisePreloader:
    """Copies ``KVLoad``s on one thread, layer by layer when ``layerwise``; is the forward
    pass's ``LayerHooks`` for the loads of the step in progress."""

    def __init__(self, num_layers: int, copy_layer: Callable[[Tier, list[int], list[int], int], CopyDone | None],
                 copy_whole: Callable[[Tier, list[int], list[int]], None], disk_misses: Callable[[list[int]], bool],
                 layerwise: bool = True, ahead: int = AUTO, clock: Callable[[], float] = time.perf_counter,
                 stream_disk: bool = True) -> None:
        self.num_layers = num_layers
        self._copy_layer = copy_layer  # (source tier, source blocks, device blocks, layer); None: copied
        self._copy_whole = copy_whole  # every layer of the blocks, into the device tier
        self._disk_misses = disk_misses  # whether reading these disk slots lost a block
        self.layerwise = layerwise
        # False: a load that reads disk files is never streamed (a tensor-parallel worker's
        # ranks must all have read theirs whole before any step uses them).
        self.stream_disk = stream_disk
        self.ahead = ahead
        self.clock = clock
        self.rates = _Rates()
        self.stats = PreloadStats()
        self._cond = Condition()
        self._loads: dict[str, _Load] = {}
        self._active: list[_Load] = []  # loads the step in progress computes on
        self._step_tokens = 0
        self._compute_start: float | None = None
        self._step_wait = 0.0
        # A daemon thread, not an executor: a load throttled for a step that never comes
        # (the process is exiting) must not hold up the exit. Loads copy in order. The
        # thread holds the preloader only while it copies, so a preloader nobody uses any
        # more (with the runner and KV pools it copies with) is freed, and the thread ends.
        self._queue: SimpleQueue[_Load | None] = SimpleQueue()
        Thread(target=_copier, args=(weakref.ref(self), self._queue), name="kv-load", daemon=True).start()
        weakref.finalize(self, self._queue.put, None)

    # ------------------------------------------------------------- scheduler side
    def start(self, load: KVLoad) -> None:
        disk = [(src, dst) for tier, src, dst in load.copies if tier == Tier.DISK]
        streamed = [(Tier(tier), src, dst) for tier, src, dst in load.copies if tier != Tier.DISK]
        ld = _Load(load.request_id, disk, streamed, self._ahead_for(load), self.num_layers, self.layerwise,
                   released=not self.layerwise)
        with self._cond:
            self._loads[load.request_id] = ld
            self.stats.loads += 1
            self.stats.ahead.append(ld.ahead)
            del self.stats.ahead[:-64]
        self._queue.put(ld)

    def _ahead_for(self, load: KVLoad) -> int:
        if self.ahead != AUTO:
            return self.ahead
        r = self.rates
        if r.copy_s_per_block_layer is None or r.compute_s_per_token_layer is None:
            return self.num_layers  # nothing measured yet: never throttle
        blocks = sum(len(src) for _, src, _ in load.copies)
        compute = max(1, load.num_new_tokens) * r.compute_s_per_token_layer
        ahead = buffer_layers(self.num_layers, blocks * r.copy_s_per_block_layer, compute)
        # The copy thread starts a layer only after the step lets it, and waking it takes
        # time (a busy CPU may not run it at once): a latency, covered by as many layers
        # of compute as it lasts.
        if r.wake_s is not None:
            ahead += math.ceil(r.wake_s / max(compute, 1e-9))
        load_s = blocks * r.copy_s_per_block_layer
        if r.handoff_s is not None and load_s > 0:
            every = math.ceil(r.handoff_s / (HANDOFF_SHARE * load_s))  # layers between wake-ups
            ahead = max(ahead, 2 * every - 2)  # a copier wakes every (ahead + 2) // 2 layers
        return min(self.num_layers, ahead)

    def streamable(self) -> list[str]:
        """Requests that may run from now on while the rest of their load streams in
        (each reported once; never with ``layerwise`` off)."""
        with self._cond:
            ready = [ld for ld in self._loads.values() if ld.streamable and not ld.reported and not ld.done]
            for ld in ready:
                ld.reported = True
            self.stats.streamed += len(ready)
        return [ld.request_id for ld in ready]

    def finished(self) -> tuple[list[str], dict[str, BaseException]]:
        """Loads completed since the last call: the copied ones, and the failed ones
        with their errors (their device blocks hold garbage: never to be used)."""
        with self._cond:
            done = [ld for ld in self._loads.values() if ld.done]
            for ld in done:
                del self._loads[ld.request_id]
        return ([ld.request_id for ld in done if ld.error is None],
                {ld.request_id: ld.error for ld in done if ld.error is not None})

    def done(self, request_ids: list[str]) -> list[str]:
        """Those of ``request_ids`` whose loads are done (copied or failed; a load already
        reported by ``finished`` is done)."""
        with self._cond:
            return [rid for rid in request_ids if (ld := self._loads.get(rid)) is None or ld.done]

    def release(self, request_ids: list[str]) -> None:
        """These requests left or were preempted: no step waits for their loads now."""
        if not request_ids:
            return
        with self._cond:
            for rid in request_ids:
                ld = self._loads.get(rid)
                if ld is not None:
                    ld.released = True
            self._cond.notify_all()

    # -------------------------------------------------------------- copy thread
    def _run(self, ld: _Load) -> None:
        try:
            for src, dst in ld.disk:
                self._copy_whole(Tier.DISK, src, dst)
            intact = not any(self._disk_misses(src) for src, _ in ld.disk)
            with self._cond:
                ld.streamable = intact and ld.layerwise and (self.stream_disk or not ld.disk)
                if not ld.streamable:
                    ld.released = True  # it runs only once copied whole
                self._cond.notify_all()
            if not ld.layerwise:
                for tier, src, dst in ld.streamed:
                    self._copy_whole(tier, src, dst)
            else:
                self._stream(ld)
        except BaseException as exc:  # noqa: BLE001 - handed to the engine, which fails the request
            with self._cond:
                ld.error = exc
        with self._cond:
            ld.loaded = self.num_layers if ld.error is None else ld.loaded
            ld.done = True
            self._cond.notify_all()

    def _stream(self, ld: _Load) -> None:
        blocks = sum(len(src) for _, src, _ in ld.streamed)
        for layer in range(self.num_layers):
            with self._cond:
                if layer >= ld.limit():
                    # Throttled: wait for half the buffer's room, not one layer, so that the
                    # step wakes this thread (a hand-off that costs it) once per that many
                    # layers while keeping the other half copied ahead.
                    ld.wake_at = min(layer + (ld.ahead + 2) // 2, self.num_layers)
                    while ld.limit() < ld.wake_at:
                        self._cond.wait()
                    ld.wake_at = None
                    if not ld.released:
                        self.rates.wake_s = _Rates._ewma(self.rates.wake_s, self.clock() - ld.woken_at)
            start = self.clock()
            done = None
            for tier, src, dst in ld.streamed:
                done = self._copy_layer(tier, src, dst, layer)  # the last one's end is the layer's: one stream
            took = self.clock() - start
            with self._cond:
                ld.copied.append(done)
                ld.loaded = layer + 1
                self.stats.copy_s += took
                if blocks:
                    self.rates.copy_s_per_block_layer = _Rates._ewma(self.rates.copy_s_per_block_layer, took / blocks)
                self._cond.notify_all()
        last = ld.copied[-1] if ld.copied else None
        if last is not None:
            last.synchronize()  # finished means copied: a step may read the blocks without waiting

    # ------------------------------------------------------------------ the step
    def hooks_for(self, plan: StepPlan) -> LayerwisePreloader | None:
        """The layer hooks of a step whose chunks compute on loads in flight (None for the
        others: they wait for nothing)."""
        with self._cond:
            self._active = [self._loads[c.request_id] for c in plan.chunks if c.request_id in self._loads]
        if not self._active:
            return None
        self._step_tokens = sum(len(c.token_ids) for c in plan.chunks)
        self._compute_start = None
        self._step_wait = 0.0
        return self

    def before_layer(self, layer: int) -> None:
        if self._active:
            start = self.clock()
            with self._cond:
                wake = False
                for ld in self._active:
                    ld.computing = layer if ld.computing is None else max(ld.computing, layer)
                    if ld.wake_at is not None and ld.limit() >= ld.wake_at:
                        ld.woken_at, wake = start, True
                if wake:  # (a wake-up costs this thread a hand-off: only when it lets the copy on)
                    self._cond.notify_all()
                for ld in self._active:
                    while ld.loaded <= layer and ld.error is None:
                        self._cond.wait()
                    if ld.error is not None:
                        raise LoadFailed(f"loading the cached KV of {ld.request_id} failed: {ld.error!r}")
                    done = ld.copied[layer] if layer < len(ld.copied) else None
                    if done is not None:
                        done.wait()
            if wake:
                self.rates.handoff_s = _Rates._ewma(self.rates.handoff_s, self.clock() - start)
            waited = self.clock() - start
            self.stats.wait_s += waited
            if layer == 0:
                self._compute_start, self._step_wait = self.clock(), 0.0
            else:
                self._step_wait += waited

    def after_layer(self, layer: int) -> None:
        """At the last layer of a step over loads: measure the compute per token and layer
        (the waits excluded), for the automatic buffer."""
        if layer != self.num_layers - 1:
            return
        if self._compute_start is not None:
            compute = self.clock() - self._compute_start - self._step_wait
            per = max(compute, 0.0) / (self.num_layers * self._step_tokens)
            self.rates.compute_s_per_token_layer = _Rates._ewma(self.rates.compute_s_per_token_layer, per)
        with self._cond:  # every layer was waited for: nothing left to throttle
            for ld in self._active:
                ld.released = True
            self._active = []
            self._cond.notify_all()


def _copier(ref: weakref.ref[LayerwisePreloader], queue: SimpleQueue[_Load | None]) -> None:
    """The copy thread: runs queued loads in order until its preloader is gone."""
    while (ld := queue.get()) is not None:
        preloader = ref()
        if preloader is None:
            return
        preloader._run(ld)
        del preloader
