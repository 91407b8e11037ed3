"""Where the bytes of a demotion (a cached block saved to a slower tier) are copied.

The MemPool decides what to save and keeps the bookkeeping; a ``Saver`` runs the copies
through the ``BlockMover`` and reports which are done. ``InlineSaver`` copies inside
``submit`` (synchronous saving: the copy sits on the caller's critical path, as in
AttentionStore Fig. 8a); ``ThreadSaver`` copies on one background thread, so a step never
waits for a save (Fig. 8b). On a GPU the thread is where a CUDA stream plugs in: the
mover's device->host copy must be complete when ``copy_blocks`` returns, because a save
is reported done (and its source block freed) right after.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.mover import BlockMover

if TYPE_CHECKING:
    from memserve.kvcache.radix import RadixNode


@dataclass(eq=False)
class SaveJob:
    """Copy ``src_blocks`` of ``src_tier`` to ``dst_blocks`` of ``dst_tier``. ``owner`` is
    the MemPool's record of the save (per block: its node, the address it was saved from
    and its last access then); ``error`` is set when the copy failed."""

    src_tier: Tier
    src_blocks: list[int]
    dst_tier: Tier
    dst_blocks: list[int]
    owner: list[tuple[RadixNode, int, float]] = field(default_factory=list)
    error: BaseException | None = field(default=None, repr=False)


class Saver(Protocol):
    #: True when ``submit`` returns with the copy done (then eviction may demote in place).
    inline: bool

    def submit(self, job: SaveJob) -> None:
        """Start the copy; it completes in submission order relative to other jobs."""

    def completed(self) -> list[SaveJob]:
        """Jobs finished since the last call, in submission order. Never blocks."""

    def pending(self) -> int:
        """Jobs submitted and not yet returned by ``completed``."""

    def wait(self) -> None:
        """Block until every submitted job has finished (shutdown, tests, ``swap_out``)."""

    def close(self) -> None:
        """Finish the queued jobs and stop."""


def _run(mover: BlockMover | None, job: SaveJob) -> None:
    try:
        if mover is None:
            raise MemPoolError("a save needs a BlockMover")
        mover.copy_blocks(job.src_tier, job.src_blocks, job.dst_tier, job.dst_blocks)
    except Exception as exc:  # noqa: BLE001 - reported to the MemPool, which abandons the save
        job.error = exc


class InlineSaver:
    """Copies in ``submit``: synchronous saving, and deterministic for the simulator.
    Without a mover (a MemPool that has none never saves) every job fails."""

    inline = True

    def __init__(self, mover: BlockMover | None) -> None:
        self.mover = mover
        self._done: list[SaveJob] = []

    def submit(self, job: SaveJob) -> None:
        _run(self.mover, job)
        self._done.append(job)

    def completed(self) -> list[SaveJob]:
        done, self._done = self._done, []
        return done

    def pending(self) -> int:
        return len(self._done)

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadSaver:
    """Copies on one background thread, in submission order (torch and file I/O release
    the GIL, so the copies overlap the engine's steps)."""

    inline = False

    def __init__(self, mover: BlockMover) -> None:
        self.mover = mover
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._done: list[SaveJob] = []
        self._lock = threading.Lock()
        self._submitted = 0
        self._returned = 0
        # The thread holds the queue, the mover and the results, not the saver: a saver
        # nobody uses any more is freed, which stops the thread (and frees the mover).
        self._thread = threading.Thread(target=_save_loop, args=(self._queue, mover, self._done, self._lock),
                                        name="kv-save", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def submit(self, job: SaveJob) -> None:
        self._submitted += 1
        self._queue.put(job)

    def completed(self) -> list[SaveJob]:
        with self._lock:
            done = self._done[:]
            self._done.clear()
        self._returned += len(done)
        return done

    def pending(self) -> int:
        return self._submitted - self._returned

    def wait(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _save_loop(jobs: queue.Queue[SaveJob | None], mover: BlockMover, done: list[SaveJob],
               lock: threading.Lock) -> None:
    """The save thread: runs jobs in submission order until it is told to stop."""
    while True:
        job = jobs.get()
        if job is None:
            jobs.task_done()
            return
        _run(mover, job)
        with lock:
            done.append(job)
        jobs.task_done()
