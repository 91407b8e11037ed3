"""First come, first served: vLLM's baseline schedule policy."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from memserve.workers.engine.kv_manager import KVCacheManager, KVGate
from memserve.workers.engine.policies.base import PreemptKind
from memserve.workers.engine.sequence import Sequence


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
