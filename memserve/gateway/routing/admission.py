"""SLO admission control at the gateway (``--admission``): refuse early what would miss
its TTFT SLO anyway, instead of letting it queue in a worker and time out later.

A request with a TTFT SLO is judged on the numbers the router routes by: on each
instance p that may take it, predicted TTFT = queue there + exec(x, y_p) for its own
prompt given p's cached prefix, where the queue is the longer of the queued work (the
ledger priced by the cost model) and the wait until p has KV room for the prompt
(``QueuedWork.kv_wait_s``: the requests there growing for the TTFT SLO's length, the
decoding ones finishing by their expected lengths). It is
admitted when some instance meets the SLO; otherwise

- ``reject`` (the default): 429 at once. ``Retry-After`` says when a fresh copy would fit:
  the best instance's excess ``min_p TTFT_p - SLO``, since queued work drains at one
  second per second (at least one second: the header counts whole seconds);
- ``queue``: the request is held in the gateway and judged again whenever queued work
  leaves the ledger (a request finished or got its first token), until it fits, or
  until even its own prefill no longer fits in what is left of its SLO (429
  ``deadline``). At most ``max_held`` requests are held; one more is 429 ``queue_full``,
  so memory stays bounded under any overload;
- ``off``: nothing is judged.

A request whose prefill alone exceeds its SLO on every instance is refused at once
(``infeasible``, without ``Retry-After``: waiting cannot help). Requests without a TTFT
SLO are admitted unjudged. The pull of a prefix from another worker (MemServe eq. 2)
is not counted, so a prediction errs on the slow side.

Pure Python on an injected clock."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from memserve.costmodel.model import CostModel
from memserve.gateway.engine_protocol import RequestRejected
from memserve.gateway.routing.policies import exec_s
from memserve.gateway.routing.queued_work import QueuedWork
from memserve.gateway.routing.route_types import Candidate, RouteRequest

OFF, REJECT, QUEUE = "off", "reject", "queue"
MODES = (OFF, REJECT, QUEUE)

# Why a request was refused (the ``reason`` label of the rejection counter).
SLO_UNATTAINABLE = "slo_unattainable"  # the queues make every instance miss it now
INFEASIBLE = "infeasible"  # its prefill alone is longer than its SLO everywhere
QUEUE_FULL = "queue_full"  # it would have been held, but max_held are held already
DEADLINE = "deadline"  # held until its own prefill no longer fit in its SLO
REASONS = (SLO_UNATTAINABLE, INFEASIBLE, QUEUE_FULL, DEADLINE)

DEFAULT_MAX_HELD = 256
MIN_RETRY_AFTER_S = 1.0
# Less slack than this before a held request's own prefill no longer fits is none: judged
# again at that moment, it would be held for a float's rounding error over and over.
HOPELESS_SLACK_S = 1e-6


@dataclass(frozen=True)
class Prediction:
    """One instance's predicted TTFT for the request: its queue, then the prefill."""

    instance: int
    queued_s: float
    exec_s: float

    @property
    def ttft_s(self) -> float:
        return self.queued_s + self.exec_s


def predict(candidates: list[Candidate], cost: CostModel, request: RouteRequest, block_size: int,
            ledger: QueuedWork | None = None) -> list[Prediction]:
    """The router's scored candidates as TTFT predictions for ``request``. With the
    router's ``ledger``, a candidate's queue is the longer of its queued work and its wait
    for KV room for the request's uncached prompt (``QueuedWork.kv_wait_s``, the requests
    there growing for the request's TTFT SLO, in decode steps): when KV binds, requests
    decoding there must finish first."""
    prompt_tokens = len(request.prompt_token_ids)
    slo_ms = request.slo.get("ttft_ms")
    out = []
    for c in candidates:
        queued = c.queued_s
        if ledger is not None and c.free_blocks is not None:
            blocks = math.ceil((max(prompt_tokens - c.cached_blocks * block_size, 0) + 1) / block_size)
            step_s = c.decode_s or cost.decode_step_s(1, prompt_tokens)
            horizon = None if slo_ms is None or step_s <= 0 else math.ceil(slo_ms / 1000.0 / step_s)
            queued = max(queued, ledger.kv_wait_s(c.instance_id, blocks, c.free_blocks, block_size, horizon))
        out.append(Prediction(c.instance_id, queued, exec_s(cost, prompt_tokens, c.cached_blocks, block_size)))
    return out


@dataclass(frozen=True)
class Verdict:
    admit: bool
    reason: str | None = None  # one of REASONS when refused
    retry_after_s: float | None = None  # when a fresh copy of the request would fit; None: never
    predicted_ttft_s: float = 0.0  # the best instance's

    def rejection(self, slo_s: float) -> RequestRejected:
        message = {
            SLO_UNATTAINABLE: "the server is too busy to meet this request's TTFT SLO",
            INFEASIBLE: "this request's TTFT SLO is shorter than its prefill takes on an idle instance",
            QUEUE_FULL: "the server is too busy to meet this request's TTFT SLO and its admission queue is full",
            DEADLINE: "this request waited for admission until its TTFT SLO could no longer be met",
        }[self.reason or SLO_UNATTAINABLE]
        return RequestRejected(f"{message} (predicted TTFT {self.predicted_ttft_s * 1000:.0f} ms, "
                               f"SLO {slo_s * 1000:.0f} ms)", self.retry_after_s)


def judge(slo_s: float, waited_s: float, predictions: list[Prediction]) -> Verdict:
    """Whether a request with TTFT SLO ``slo_s`` that has waited ``waited_s`` for admission
    fits on the best of ``predictions`` (never empty)."""
    best = min(p.ttft_s for p in predictions)
    fastest_exec = min(p.exec_s for p in predictions)
    if fastest_exec > slo_s:
        return Verdict(False, INFEASIBLE, None, best)
    if best <= slo_s - waited_s:
        return Verdict(True, predicted_ttft_s=best)
    retry_after = max(best - slo_s, MIN_RETRY_AFTER_S)
    reason = DEADLINE if fastest_exec > slo_s - waited_s else SLO_UNATTAINABLE
    return Verdict(False, reason, retry_after, best)


class Admission:
    """Judges requests (``admit``) and holds the ones ``queue`` mode may still serve."""

    def __init__(self, mode: str = REJECT, max_held: int = DEFAULT_MAX_HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown admission mode {mode!r}; choose from {', '.join(MODES)}")
        if max_held < 0:
            raise ValueError("max_held must be >= 0")
        self.mode = mode
        self.max_held = max_held
        self.clock = clock
        self.held = 0
        self.rejected: Counter[str] = Counter()  # by reason
        self.admitted: Counter[str] = Counter()  # "direct" or "held"
        self._wake = asyncio.Event()

    async def admit(self, slo_ttft_s: float | None, predictions: Callable[[], list[Prediction]]) -> None:
        """Return once the request may be routed; raise ``RequestRejected`` otherwise. An
        admitted request is judged without yielding to the event loop, so the caller can
        route it (and the ledger count it) before any other request is judged."""
        if self.mode == OFF or slo_ttft_s is None:
            return
        start = self.clock()
        held = False
        try:
            while True:
                outcome = self.look(slo_ttft_s, self.clock() - start, predictions(), held)
                if isinstance(outcome, Verdict):
                    if outcome.admit:
                        return
                    raise outcome.rejection(slo_ttft_s)
                if not held:
                    held = True
                    self.held += 1
                await self._changed(outcome)
        finally:
            if held:
                self.held -= 1

    def look(self, slo_s: float, waited_s: float, predictions: list[Prediction], held: bool) -> Verdict | float:
        """One judgement of a request that has waited ``waited_s`` (``held``: in the queue
        already): a ``Verdict`` that admits or refuses it (counted), or, in ``queue`` mode,
        the seconds it may be held before it must be judged again (the caller counts it in
        ``held``). The gateway's event loop and the simulator's virtual clock share it."""
        verdict = judge(slo_s, waited_s, predictions)
        if verdict.admit:
            self.admitted["held" if held else "direct"] += 1
            return verdict
        if verdict.reason != SLO_UNATTAINABLE or self.mode == REJECT:
            return self._refused(verdict)
        if not held and self.held >= self.max_held:
            return self._refused(Verdict(False, QUEUE_FULL, verdict.retry_after_s, verdict.predicted_ttft_s))
        # Past this the request could not make it even on an idle instance.
        hopeless_in = slo_s - waited_s - min(p.exec_s for p in predictions)
        if hopeless_in <= HOPELESS_SLACK_S:
            return self._refused(Verdict(False, DEADLINE, verdict.retry_after_s, verdict.predicted_ttft_s))
        return hopeless_in

    def notify(self) -> None:
        """Queued work left the ledger: held requests are judged again."""
        if self.held:
            self._wake.set()
            self._wake = asyncio.Event()

    async def _changed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _refused(self, verdict: Verdict) -> Verdict:
        self.rejected[verdict.reason or SLO_UNATTAINABLE] += 1
        return verdict

    def stats(self) -> dict:
        return {"mode": self.mode, "held": self.held, "max_held": self.max_held,
                "rejected": dict(self.rejected), "admitted": dict(self.admitted)}
