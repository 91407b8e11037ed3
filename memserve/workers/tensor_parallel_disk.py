"""The disk tier of a tensor-parallel worker: one ``DiskStore`` per rank, each holding its
heads' part of every block in a directory of its own (``i<instance>r<rank>``).

One file per rank, not one file holding every rank's part: every rank writes and reads
its part on its own threads, at once, and no block's bytes cross between ranks; a load
inside a step (``layer_preload.py``) runs on every rank from its own files, as its
copies from the host tier do. The price is agreement, which rank 0 keeps:

- Names: rank 0's MemPool names the slots of its store; before a save to disk the other
  ranks are given the same names (``name_followers``), so each writes its part under them.
- Start: a block is adopted only where every rank holds a valid file of it with the same
  parent, in rank 0's order (``scan``); every other file is deleted on every rank.
- Misses: a read that found a rank's file missing or bad is a miss of rank 0's store
  (``mark_failed``) before the MemPool looks: after a copy from disk (``merge_failed``),
  and before a load inside a step is reported done (``HeldLoads``: rank 0 asks at each
  poll, never waits, since another rank's copier may wait for a step). At N > 1 such loads
  are never streamed, so no step reads a block before every rank has read its whole file,
  and a block any rank lost is recomputed, as a lost block always is.
- Expiry: ``forget`` deletes every rank's file.

Rank 0 calls the others through ``RankCalls`` (``Followers``, on the control group);
``follow`` is what a rank does with each call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from memserve.kvcache.address import Tier
from memserve.kvcache.disk_store import DiskStore
from memserve.workers.engine.step_plan import KVLoad

if TYPE_CHECKING:
    from memserve.workers.layer_preload import LayerwisePreloader


class RankCalls(Protocol):
    """Rank 0's calls to the other ranks, in its order."""

    def run(self, method: str, *args: Any, mine: Any) -> None:
        """``method(*args)`` on every rank (rank 0's part: ``mine()``), raising if one failed."""

    def gather(self, method: str, *args: Any) -> list[Any]:
        """Every other rank's answer to ``method(*args)``, raising if one failed."""


class GroupDiskStore(DiskStore):
    """Rank 0's store: its own part, and the other ranks' kept in step with it."""

    def __init__(self, followers: RankCalls, root: str | Path, capacity_bytes: int, block_nbytes: int,
                 fingerprint: int, part: str) -> None:
        super().__init__(root, capacity_bytes, block_nbytes, fingerprint, part)
        self.followers = followers

    def scan(self, instance_id: int) -> list[tuple[int, int | None]]:
        mine = self.verified(instance_id)
        theirs: list[dict[int, int | None]] = self.followers.gather("disk_verified", instance_id)
        common = {h: parent for h, parent in mine.items() if all(h in t and t[h] == parent for t in theirs)}
        order = self.adopt(common)
        self.followers.run("disk_adopt", order, mine=lambda: None)
        return order

    def forget(self, block_hash: int) -> None:
        self.followers.run("disk_forget", block_hash, mine=lambda: super(GroupDiskStore, self).forget(block_hash))

    def name_followers(self, slots: list[int]) -> None:
        """Give the other ranks the names of ``slots`` (before a save writes them)."""
        self.followers.run("disk_name", slots, self.names(slots), mine=lambda: None)

    def merge_failed(self, slots: list[int]) -> None:
        """Record the reads of ``slots`` that failed on another rank as failed here."""
        for failed in self.followers.gather("disk_failed", slots):
            self.mark_failed(failed)

    def settle_loads(self, slots_by_request: dict[str, list[int]]) -> set[str]:
        """Those of these requests whose in-step loads every other rank has done; the disk
        slots any rank failed to read for them are recorded as failed here."""
        settled = set(slots_by_request)
        for done, failed in self.followers.gather("disk_settle", slots_by_request):
            settled.intersection_update(done)
            self.mark_failed(failed)
        return settled


class HeldLoads:
    """Rank 0's in-step loads that read disk files, reported done (or failed) only once
    every rank has done its part: until then the other ranks may still write the request's
    device blocks, and their misses are not known yet."""

    def __init__(self, disk: GroupDiskStore) -> None:
        self.disk = disk
        self._slots: dict[str, list[int]] = {}  # request -> the disk slots its load reads
        self._held: dict[str, BaseException | None] = {}  # done here: None, or the load's error

    def started(self, load: KVLoad) -> None:
        slots = [slot for tier, src, _ in load.copies if tier == Tier.DISK for slot in src]
        if slots:
            self._slots[load.request_id] = slots

    def settle(self, done: list[str], failed: dict[str, BaseException]) -> tuple[list[str], dict[str, BaseException]]:
        """Rank 0's finished loads (``LayerwisePreloader.finished``) less those still held."""
        self._held.update({rid: None for rid in done if rid in self._slots})
        self._held.update({rid: error for rid, error in failed.items() if rid in self._slots})
        if not self._held:
            return done, failed
        settled = self.disk.settle_loads({rid: self._slots[rid] for rid in self._held})
        done = [rid for rid in done if rid not in self._held]
        failed = {rid: error for rid, error in failed.items() if rid not in self._held}
        for rid in settled:
            del self._slots[rid]
            error = self._held.pop(rid)
            if error is None:
                done.append(rid)
            else:
                failed[rid] = error
        return done, failed


ANSWERED = frozenset({"disk_verified", "disk_failed", "disk_settle"})  # rank 0 gathers the result
REPORTED = frozenset({"disk_adopt", "disk_name", "disk_forget"})  # rank 0 gathers only errors


def follow(disk: DiskStore | None, preloader: LayerwisePreloader, method: str, args: tuple) -> Any:
    """What rank 1..N-1 does with rank 0's disk call ``method(*args)``."""
    if disk is None:
        raise RuntimeError("this rank has no disk tier")
    if method == "disk_verified":
        return disk.verified(*args)
    if method == "disk_adopt":
        return disk.adopt_order(*args)
    if method == "disk_name":
        for slot, name in zip(*args, strict=True):
            disk.name(slot, *name)
        return None
    if method == "disk_failed":
        return disk.failed(*args)
    if method == "disk_settle":
        (slots_by_request,) = args
        done = preloader.done(list(slots_by_request))
        return done, disk.failed(slot for rid in done for slot in slots_by_request[rid])
    if method == "disk_forget":
        return disk.forget(*args)
    raise ValueError(f"unknown disk call {method!r} from rank 0")
