"""What a scheduling policy is: the hooks the scheduler calls (``SchedulePolicy``) and
what a preemption does to a request's KV (``PreemptKind``). Policies implement it in
modules of their own; ``policies/__init__.py`` registers them by name."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any, Protocol

from memserve.workers.engine.kv_manager import KVCacheManager, KVGate
from memserve.workers.engine.sequence import Sequence


class PreemptKind(enum.Enum):
    """What happens to a preempted request's KV. RECOMPUTE: its blocks are freed (full
    ones stay in the prefix cache as any finished request's would, and a later hit may
    spare part of the recompute). SWAP: its full blocks are copied to the host tier now
    and indexed there, so readmission loads them back instead of recomputing."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


class SchedulePolicy(Protocol):
    name: str

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
