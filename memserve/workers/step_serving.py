"""Answering peers' KV transfers between the layers of a long step.

A worker serves its transfer endpoint between engine steps, and a transfer needs two
answers from the receiver: one to allocate blocks, one to write them. A prefill step can
take seconds on a CPU, so a transfer *into* a busy instance (a decode instance returning
a conversation's decode-phase KV in pd-caching-3, an eq. 2 pull) waited up to two whole
steps, the sender's one transfer thread queued others behind it, and their grants
expired under load (a third of pd-caching-3's returns on ShareGPT at 0.5 sessions/s).

These hooks serve the endpoint after a layer whenever ``interval_s`` has passed since it
was last served, so a receiver answers within about one layer's compute. That is safe
where the engine's own step is concerned: the blocks the step reads and writes belong
to its requests (referenced), so an allocation here can only take free or evictable
blocks, and what it writes or indexes is what a step boundary would have written or
indexed; the loop hands the received KV to the engine after the step, as before."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memserve.workers.engine.step_plan import StepPlan

SERVE_INTERVAL_S = 0.02  # when nothing waits, serving costs one poll of the socket (microseconds)


class ServeBetweenLayers:
    """Per-step layer hooks (``ModelRunner.add_step_hooks(hooks.for_step)``) calling
    ``serve`` after a layer once ``interval_s`` has passed since the step began or
    ``serve`` last ran."""

    def __init__(self, serve: Callable[[], object], interval_s: float = SERVE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.serve = serve
        self.interval_s = interval_s
        self.clock = clock
        self._last = clock()

    def for_step(self, plan: StepPlan) -> ServeBetweenLayers:
        self._last = self.clock()  # the loop served the endpoint just before the step
        return self

    def before_layer(self, layer: int) -> None:
        pass

    def after_layer(self, layer: int) -> None:
        if self.clock() - self._last >= self.interval_s:
            self.serve()
            self._last = self.clock()
