"""Measurements that a pause of the whole process does not spoil.

The gateway pauses its background profile (SIGSTOP to the profile's process group)
while it serves a request and continues it (SIGCONT) when it is idle again, so that
the profile does not slow the replies down. A run timed across such a pause measures
the pause, not the engine. SIGCONT can be caught, and its handler runs once the process
is continued: ``ResumeGuard`` counts the resumes and runs again what one disturbed."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any, Callable, TypeVar

T = TypeVar("T")
MAX_RETRIES = 5  # runs after the first, of one measurement; then the last is kept


class ResumeGuard:
    """Counts the resumes of this process while entered (``with``; main thread only) and
    ``run`` repeats a measurement that one fell into."""

    def __init__(self, retries: int = MAX_RETRIES) -> None:
        self.retries = retries
        self.resumes = 0  # SIGCONTs seen while entered
        self.repeats = 0  # runs made again because a resume fell into them
        self._previous: Any = None

    def __enter__(self) -> "ResumeGuard":
        self._previous = signal.signal(signal.SIGCONT, self._count)
        signal.siginterrupt(signal.SIGCONT, False)  # restart the system calls it interrupts, where they can be
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGCONT, self._previous)

    def _count(self, signum: int, frame: FrameType | None) -> None:
        self.resumes += 1

    def run(self, measure: Callable[[], T]) -> T:
        """``measure()``, again while a resume fell into it, at most ``retries`` more times
        (a profile paused that often keeps its last run rather than never ending)."""
        retried = 0
        while True:
            before = self.resumes
            result = measure()
            if self.resumes == before or retried == self.retries:
                return result
            retried += 1
            self.repeats += 1
