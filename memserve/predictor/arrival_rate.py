"""Arrival rate λ for the padding's confidence: requests per second over a sliding window,
on an injected clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class ArrivalRate:
    """Arrivals in the last ``window_s`` seconds divided by the window. The window keeps
    at most ``max_events`` timestamps (memory stays bounded under any load); when it is
    full, the rate is measured over the span the kept ones cover instead."""

    def __init__(self, clock: Callable[[], float], window_s: float = 10.0, max_events: int = 4096) -> None:
        self.clock = clock
        self.window_s = window_s
        self._times: deque[float] = deque(maxlen=max_events)

    def arrive(self) -> None:
        self._times.append(self.clock())

    def rate(self) -> float:
        now = self.clock()
        times = self._times
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) == times.maxlen and now > times[0]:
            return len(times) / (now - times[0])
        return len(times) / self.window_s
