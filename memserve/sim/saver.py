"""The background saver on the virtual clock: a ``Saver`` (``kvcache/saver.py``) whose
copies take time, so that the MemPool's asynchronous saving (``kvcache/tiering.py``: saves
kicked ahead to a watermark, evictions that find saves in flight wait for them) runs as
it does with the worker's ``ThreadSaver``, and a slow saver shows what it costs.

One copy at a time, in submission order, as the worker's one save thread runs them: a
job starts when the one before it is done and takes ``seconds(job)`` (its bytes over the
bandwidth of the tiers it moves between). ``completed`` returns the jobs done by now.
``wait`` (the MemPool blocks on the saves in flight) cannot advance the clock in the
middle of a step, so it marks every job done and owes the wait, from now to the last
job's end, to the step that called it: the runner adds it to that step's time
(``take_stall``), or to the instance's next step when no step was running (a prefix
pull's allocation). No bytes move."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from memserve.kvcache.saver import SaveJob


class TimedSaver:
    inline = False

    def __init__(self, clock: Callable[[], float], seconds: Callable[[SaveJob], float]) -> None:
        self.clock = clock
        self.seconds = seconds
        self._queue: deque[tuple[float, SaveJob]] = deque()  # (when its copy is done, job), in order
        self._free_at = 0.0  # when the save channel finishes the last job submitted
        self._owed_s = 0.0  # waits not yet added to a step
        self.waits = 0  # calls of ``wait`` that found a copy unfinished
        self.stall_s = 0.0  # seconds they waited in all
        self.jobs = 0
        self.busy_s = 0.0  # seconds of copying

    def submit(self, job: SaveJob) -> None:
        seconds = self.seconds(job)
        self._free_at = max(self.clock(), self._free_at) + seconds
        self._queue.append((self._free_at, job))
        self.jobs += 1
        self.busy_s += seconds

    def completed(self) -> list[SaveJob]:
        now, queue = self.clock(), self._queue
        done = []
        while queue and queue[0][0] <= now:
            done.append(queue.popleft()[1])
        return done

    def pending(self) -> int:
        return len(self._queue)

    def next_done(self) -> float | None:
        """When the oldest job in flight is done (None: nothing in flight)."""
        return self._queue[0][0] if self._queue else None

    def wait(self) -> None:
        now = self.clock()
        if self._queue and self._free_at > now:
            self.waits += 1
            self.stall_s += self._free_at - now
            self._owed_s += self._free_at - now
        self._queue = deque((min(at, now), job) for at, job in self._queue)

    def take_stall(self) -> float:
        """The waits owed since the last call (seconds the caller's step is longer)."""
        owed, self._owed_s = self._owed_s, 0.0
        return owed

    def close(self) -> None:
        self.wait()
