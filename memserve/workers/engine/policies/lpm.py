"""Longest prefix match: SGLang's cache-aware admission order."""

from __future__ import annotations

from collections import deque

from memserve.workers.engine.kv_manager import KVCacheManager, KVGate
from memserve.workers.engine.policies.fcfs import FCFS
from memserve.workers.engine.sequence import Sequence

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
