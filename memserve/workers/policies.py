"""Scheduling policies: the order in which waiting requests are admitted and which
running request is preempted when KV blocks run out. The scheduler keeps the mechanics
(budgets, blocks, chunking); a policy only orders, so policies can be swapped by a flag
(``--schedule-policy``) and compared in the simulator on the same engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from memserve.registry import make
from memserve.workers.sequence import Sequence


class SchedulePolicy(Protocol):
    name: str

    def push(self, seq: Sequence) -> None:
        """A new request waits."""
        ...

    def push_preempted(self, seq: Sequence) -> None:
        """A preempted request waits again."""
        ...

    def peek(self) -> Sequence | None:
        """The next request to admit, or None."""
        ...

    def pop(self) -> Sequence:
        ...

    def remove(self, seq: Sequence) -> None:
        ...

    def victim(self, running: list[Sequence]) -> Sequence:
        """Which running request gives up its blocks when the pool runs out."""
        ...

    def __len__(self) -> int:
        ...

    def __iter__(self) -> Iterator[Sequence]:
        ...


class FCFS:
    """vLLM's baseline: admit in arrival order, preempted requests first; preempt the
    newest running request."""

    name = "fcfs"

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

    def victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


SCHEDULE_POLICIES: dict[str, type] = {"fcfs": FCFS}


def make_schedule_policy(name: str) -> SchedulePolicy:
    return make(SCHEDULE_POLICIES, name, "schedule policy")
