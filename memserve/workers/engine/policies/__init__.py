"""Scheduling policies: the order in which waiting requests are admitted, which running
request is preempted when KV blocks run out and how (swap or recompute), and optionally
how many KV blocks each request may hold (a ``KVGate``). The scheduler keeps the
mechanics (budgets, blocks, chunking) and calls these hooks, so policies can be swapped
by a flag (``--schedule-policy``, ``--schedule-policy-options``) and compared in the
simulator on the same engine. ``cacheopt`` (CacheOpt §3.3-3.5) is the ``cacheopt`` subpackage."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from memserve.workers.engine.kv_manager import KVCacheManager, KVGate
from memserve.workers.engine.sequence import Sequence

if TYPE_CHECKING:
    from memserve.costmodel.model import CostModel


class PreemptKind(enum.Enum):
    """What happens to a preempted request's KV. RECOMPUTE: its blocks are freed (full
    ones stay in the prefix cache as any finished request's would, and a later hit may
    spare part of the recompute). SWAP: its full blocks are copied to the host tier now
    and indexed there, so readmission loads them back instead of recomputing."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


class SchedulePolicy(Protocol):
    name: str
    # True when ``make_room`` and ``begin_step`` never act while nothing waits (no
    # preemption, no reordering, the whole budget, no state of their own): the
    # scheduler may then skip them for plain decode steps (``Scheduler.plain_decodes``).
    plain_decodes: bool

    def push(self, seq: Sequence) -> None:
        """A new request waits."""
        ...

    def push_preempted(self, seq: Sequence) -> None:
        """A request that left the queue waits again, ahead of new arrivals: preempted, or
        passed over by this step's admission (``Scheduler._admit``)."""
        ...

    def peek(self) -> Sequence | None:
        """The next request to admit, or None."""
        ...

    def pop(self) -> Sequence:
        ...

    def remove(self, seq: Sequence) -> None:
        ...

    def victim(self, running: list[Sequence], needy: Sequence) -> Sequence:
        """Which running request gives up its blocks when ``needy`` cannot get its own."""
        ...

    def preempt_kind(self, victim: Sequence) -> PreemptKind:
        ...

    def make_room(self, running: list[Sequence], now: float, budget: int) -> list[Sequence]:
        """Called once per ``schedule()`` before ``begin_step``: running requests to
        preempt now so that waiting ones can be admitted this step (preemptions made
        here do not stop admission, as a running request's own need does)."""
        ...

    def begin_step(self, running: list[Sequence], now: float, budget: int) -> int:
        """Called once per ``schedule()`` before running requests get their slots; may
        reorder ``running`` in place (the order they are served in). Returns the step's
        token budget (at most ``budget``, the configured one)."""
        ...

    def attach(self, kv: KVCacheManager) -> KVGate | None:
        """The policy's KV gate over ``kv``, or None to let requests grow freely."""
        ...

    def stats(self) -> dict[str, Any]:
        """Policy counters for ``Scheduler.stats()`` (and so the gateway's /metrics)."""
        ...

    def __len__(self) -> int:
        ...

    def __iter__(self) -> Iterator[Sequence]:
        ...


class FCFS:
    """vLLM's baseline: admit in arrival order, preempted requests first; preempt the
    newest running request."""

    name = "fcfs"
    plain_decodes = True

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def push_preempted(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def victim(self, running: list[Sequence], needy: Sequence) -> Sequence:
        return running[-1]

    def preempt_kind(self, victim: Sequence) -> PreemptKind:
        return PreemptKind.RECOMPUTE

    def make_room(self, running: list[Sequence], now: float, budget: int) -> list[Sequence]:
        return []

    def begin_step(self, running: list[Sequence], now: float, budget: int) -> int:
        return budget

    def attach(self, kv: KVCacheManager) -> KVGate | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


LPM_MAX_QUEUE = 128  # above this many waiting requests, lpm admits in arrival order (as SGLang's)


class LongestPrefixMatch(FCFS):
    """SGLang's ``lpm``: admit the waiting request whose prompt has the longest cached
    prefix (in any tier) first, ties in arrival order; requests that left the queue
    (preempted, passed over) keep the head. A conversation that comes back finds most of
    its prompt cached and needs a short prefill, so it no longer waits behind new long
    prompts: mean time to first token falls, as shortest-job-first's does. The order is
    computed once per step (one index lookup per waiting request), and not at all above
    ``LPM_MAX_QUEUE`` waiting requests."""

    name = "lpm"

    def __init__(self) -> None:
        super().__init__()
        self._kv: KVCacheManager | None = None
        self._head: set[str] = set()  # requests pushed back: they stay first, in their order

    def attach(self, kv: KVCacheManager) -> KVGate | None:
        self._kv = kv
        return None

    def push_preempted(self, seq: Sequence) -> None:
        super().push_preempted(seq)
        self._head.add(seq.request_id)

    def pop(self) -> Sequence:
        seq = super().pop()
        self._head.discard(seq.request_id)
        return seq

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self._head.discard(seq.request_id)

    def begin_step(self, running: list[Sequence], now: float, budget: int) -> int:
        kv, queue = self._kv, self._queue
        if kv is not None and 1 < len(queue) <= LPM_MAX_QUEUE:
            known = kv.mempool.index.known_prefix
            head = [s for s in queue if s.request_id in self._head]
            rest = sorted((s for s in queue if s.request_id not in self._head),
                          key=lambda s: -known(kv.prefix_names(s)))  # stable: arrival order among equals
            self._queue = deque(head + rest)
        return budget


def _fcfs(options: str, cost: CostModel | None) -> SchedulePolicy:
    if options:
        raise ValueError("the fcfs schedule policy takes no options")
    return FCFS()


def _cacheopt(options: str, cost: CostModel | None) -> SchedulePolicy:
    from memserve.workers.engine.policies.cacheopt.options import CacheOptOptions
    from memserve.workers.engine.policies.cacheopt.policy import (
        CacheOpt,  # here: it imports this module
    )

    return CacheOpt(CacheOptOptions.parse(options), cost)


def _lpm(options: str, cost: CostModel | None) -> SchedulePolicy:
    if options:
        raise ValueError("the lpm schedule policy takes no options")
    return LongestPrefixMatch()


SCHEDULE_POLICIES: dict[str, Callable[[str, CostModel | None], SchedulePolicy]] = {
    "fcfs": _fcfs, "lpm": _lpm, "cacheopt": _cacheopt}


def make_schedule_policy(name: str, options: str = "", cost: CostModel | None = None) -> SchedulePolicy:
    """Policy ``name`` with its ``options`` string and, for policies that weigh swap
    against recompute, the instance's ``CostModel`` (None: none known)."""
    if name not in SCHEDULE_POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; expected one of {sorted(SCHEDULE_POLICIES)}")
    return SCHEDULE_POLICIES[name](options, cost)
