"""Online learning from finished requests, in bounded memory.

Labelled feature vectors go into a fixed-size ring buffer that starts with the bootstrap
table; once ``refit_every`` new labels arrived, a fresh ``LengthModel`` is fitted on the
buffer (off the event loop) and swapped in whole. New labels overwrite the oldest rows, so
the model follows the traffic actually served and memory never grows.

A fit takes seconds of CPU, and the gateway shares the machine's cores with the workers: a
refit in serving runs in a thread of its own at the lowest CPU priority, on one BLAS
thread, so that it takes only idle cycles. (At the default priority a refit slowed the
worker's steps several-fold for 3 s, and one 247-token prefill took 2 s.)"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from memserve.predictor.length_model import MIN_EXAMPLES, LengthModel


class OnlineLearner:
    def __init__(self, dim: int, make_model: Callable[[], LengthModel], capacity: int = 2048,
                 refit_every: int = 64) -> None:
        self._make_model = make_model  # an unfitted LengthModel each call
        self._X = np.zeros((capacity, dim), dtype=np.float32)
        self._y = np.zeros(capacity, dtype=np.float32)
        self._size = 0
        self._next = 0  # the row the next label overwrites
        self.refit_every = refit_every
        self._since_refit = 0
        self._refitting = False
        self._lock = threading.Lock()
        self.model: LengthModel | None = None
        self.num_refits = 0

    @property
    def size(self) -> int:
        return self._size

    def add(self, x: np.ndarray, length: float) -> bool:
        """Store one label; True when a refit is due (the caller then runs ``refit``,
        preferably in a thread) and none is under way."""
        with self._lock:
            self._X[self._next] = x
            self._y[self._next] = length
            self._next = (self._next + 1) % len(self._y)
            self._size = min(self._size + 1, len(self._y))
            self._since_refit += 1
            if self._refitting or self._since_refit < self.refit_every or self._size < MIN_EXAMPLES:
                return False
            self._refitting = True
            self._since_refit = 0
            return True

    def refit(self) -> None:
        """Fit on a snapshot of the buffer and swap the model in (the old one serves meanwhile)."""
        with self._lock:
            X, y = self._X[:self._size].copy(), self._y[:self._size].copy()
            self._refitting = True
            self._since_refit = 0  # the labels added before this fit (the bootstrap's) are in it
        try:
            self.model = self._make_model().fit(X, y)
            self.num_refits += 1
        finally:
            with self._lock:
                self._refitting = False

    def refit_in_background(self) -> threading.Thread:
        """Start ``refit`` in a daemon thread that yields the CPU to everything else."""
        thread = threading.Thread(target=self._refit_idle, name="predictor-refit", daemon=True)
        thread.start()
        return thread

    def _refit_idle(self) -> None:
        if sys.platform == "linux":  # Linux nice values are per thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        with threadpool_limits(limits=1):
            self.refit()
