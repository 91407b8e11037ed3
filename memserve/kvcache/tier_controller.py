"""The byte side of a MemPool's tiers, after SGLang's ``HiCacheController``: the index
side (``tiering.py``) decides which blocks move where and what a finished copy means for
the index; a ``TierController`` owns everything that moves the bytes: the ``BlockMover``,
the ``Saver`` with its queue and thread, the count of blocks in flight per tier and the
bytes read from and written to each tier.

Invariants (the interface's promise, kept by ``BlockMoverController``):

- ``saving(t)`` counts the blocks of the saves started and not yet returned by
  ``finished_saves`` whose source tier is ``t``; ``incoming(t)`` the same by destination
  tier. After ``wait`` and ``finished_saves`` both are 0.
- Every started save is returned by ``finished_saves`` exactly once, in start order. Its
  blocks count as read from its source tier and written to its destination only when its
  copy succeeded (``job.error`` is None); a load counts when the index commits it
  (``count_load``), since only then is it known which blocks arrived.
- A controller never reads or changes the index or the block pools.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import MemPoolError, contiguous_runs
from memserve.kvcache.mover import BlockMover, Buffer, recut
from memserve.kvcache.saver import Saver, SaveJob

# (tier, blocks) runs of one tier each, as ``BlockTable.runs_by_tier`` gives them.
Runs = Sequence[tuple[Tier, list[int]]]


class TierController(ABC):
    """What a MemPool calls to move bytes between its tiers and to and from the network."""

    mover: BlockMover | None  # None: no tier moves, no transfers
    saver: Saver

    @property
    @abstractmethod
    def inline(self) -> bool:
        """True when a save's copy is done by the time ``start_save`` returns."""

    @property
    @abstractmethod
    def block_nbytes(self) -> int:
        """Bytes of one block in every tier (0 without a mover)."""

    @abstractmethod
    def need_mover(self, op: str) -> BlockMover:
        """The mover; raises, naming ``op``, when there is none."""

    @abstractmethod
    def start_save(self, job: SaveJob) -> None:
        """Start copying ``job``'s blocks (the caller has reserved and pinned them)."""

    @abstractmethod
    def finished_saves(self) -> list[SaveJob]:
        """Saves whose copy finished since the last call, in start order. Never blocks."""

    @abstractmethod
    def pending(self) -> int:
        """Saves started and not yet returned by ``finished_saves``."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every started save's copy has finished."""

    @abstractmethod
    def saving(self, tier: int) -> int:
        """Blocks being saved out of ``tier``."""

    @abstractmethod
    def incoming(self, tier: int) -> int:
        """Blocks of ``tier`` reserved for saves into it."""

    @abstractmethod
    def io_bytes(self, tier: int) -> tuple[int, int]:
        """Bytes read from ``tier`` and written to it so far."""

    @abstractmethod
    def load(self, copies: Sequence[tuple[Tier, list[int], list[int]]]) -> None:
        """Copy each run ``(source tier, source blocks, device blocks)`` to the device,
        waiting for the copies."""

    @abstractmethod
    def count_load(self, tiers: Sequence[Tier]) -> None:
        """Count a committed load: one block read from each of ``tiers``, as many written
        to the device."""

    @abstractmethod
    def read(self, runs: Runs) -> list[Buffer]:
        """The bytes of ``runs``, as the mover's per-run buffers, in order."""

    @abstractmethod
    def write(self, runs: Runs, buffers: Sequence[Buffer]) -> None:
        """Store bytes given back to back across ``buffers`` into ``runs``."""

    @abstractmethod
    def close(self) -> None:
        """Finish the queued saves and stop the saver."""


class BlockMoverController(TierController):
    """A ``TierController`` over the runner's ``BlockMover`` and a ``Saver``."""

    def __init__(self, mover: BlockMover | None, saver: Saver) -> None:
        self.mover = mover
        self.saver = saver
        self._saving = [0] * len(Tier)
        self._incoming = [0] * len(Tier)
        self._io_bytes = [[0, 0] for _ in Tier]  # per tier: bytes read from it, written to it

    @property
    def inline(self) -> bool:
        return self.saver.inline

    @property
    def block_nbytes(self) -> int:
        return self.mover.block_nbytes if self.mover is not None else 0

    def need_mover(self, op: str) -> BlockMover:
        if self.mover is None:
            raise MemPoolError(f"{op} needs a BlockMover")
        return self.mover

    def start_save(self, job: SaveJob) -> None:
        n = len(job.src_blocks)
        self._saving[job.src_tier] += n
        self._incoming[job.dst_tier] += n
        self.saver.submit(job)

    def finished_saves(self) -> list[SaveJob]:
        jobs = self.saver.completed()
        for job in jobs:
            n = len(job.src_blocks)
            self._saving[job.src_tier] -= n
            self._incoming[job.dst_tier] -= n
            if job.error is None:
                nbytes = n * self.need_mover("save").block_nbytes
                self._io_bytes[job.src_tier][0] += nbytes
                self._io_bytes[job.dst_tier][1] += nbytes
        return jobs

    def pending(self) -> int:
        return self.saver.pending()

    def wait(self) -> None:
        self.saver.wait()

    def saving(self, tier: int) -> int:
        return self._saving[tier]

    def incoming(self, tier: int) -> int:
        return self._incoming[tier]

    def io_bytes(self, tier: int) -> tuple[int, int]:
        read, written = self._io_bytes[tier]
        return read, written

    def load(self, copies: Sequence[tuple[Tier, list[int], list[int]]]) -> None:
        mover = self.need_mover("swap_in")
        for tier, src, dst in copies:
            mover.copy_blocks(tier, src, Tier.DEVICE, dst)

    def count_load(self, tiers: Sequence[Tier]) -> None:
        nbytes = self.need_mover("swap_in").block_nbytes
        for tier in tiers:
            self._io_bytes[tier][0] += nbytes
        self._io_bytes[Tier.DEVICE][1] += len(tiers) * nbytes

    def read(self, runs: Runs) -> list[Buffer]:
        mover = self.need_mover("read_blocks")
        buffers: list[Buffer] = []
        for tier, blocks in runs:
            buffers.extend(mover.read_blocks(tier, blocks))
        return buffers

    def write(self, runs: Runs, buffers: Sequence[Buffer]) -> None:
        mover = self.need_mover("write_blocks")
        sizes = [n * mover.block_nbytes for _, blocks in runs for _, n in contiguous_runs(blocks)]
        pieces = iter(recut(buffers, sizes))
        for tier, blocks in runs:
            mover.write_blocks(tier, blocks, [next(pieces) for _ in contiguous_runs(blocks)])

    def close(self) -> None:
        self.saver.close()
