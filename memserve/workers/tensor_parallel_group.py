"""A tensor-parallel worker as the gateway sees it: one instance, N rank processes.

Rank 0 is the worker process: it runs the engine (scheduler, KV manager, MemPool index,
KV connector) and starts ranks 1..N-1 (``tensor_parallel_rank.py``), which hold the other
shards of every layer and the other heads' share of every KV block. Block ids are the
same on every rank: the MemPool on rank 0 hands them out for all.

Two ``torch.distributed`` groups join the ranks (gloo on the CPU, NCCL for the compute
group on CUDA): the *compute* group carries the forward pass's all-reduces and gathers;
the *control* group (always gloo: plain objects) carries rank 0's calls, in the order rank
0 makes them. Everything that touches the model or the KV bytes is such a call, so every
rank does it to its own shard:

- ``execute(plan)``: the step, whose plan (plain data) is broadcast first; every rank runs
  the same forward pass over its heads and joins the collectives. Loads from slower tiers
  start inside it, so each rank copies its own share (and waits for its own copy before
  a layer reads it).
- the ``BlockMover`` calls of the MemPool (tier saves and loads, transfers) through
  ``GroupMover``, the disk tier's bookkeeping (``tensor_parallel_disk.py``), and
  ``shift_blocks``: each waits until every rank has done it, since
  the caller may reuse the source next. On the wire a block is every rank's part of it,
  rank by rank, block by block, so a peer of the same tensor-parallel size cuts it back
  the same way however its runs of block ids fall.

Faults: a rank that dies takes the group down. Rank 0 watches the others and exits when
one does (the gateway then treats the worker as dead: its requests are resent, resumed
or re-run, and it is restarted with new ranks); the others die with rank 0 (Linux's
parent-death signal).
"""

from __future__ import annotations

import json
from dataclasses import asdict
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import MemPoolError, contiguous_runs
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.mover import BlockMover, Buffer, recut
from memserve.workers.model.tensor_parallel import TensorParallel
from memserve.workers.tensor_parallel_disk import GroupDiskStore

log = logging.getLogger("memserve.worker")

# How long a collective may wait for a rank before it fails (a dead rank is found sooner
# by the watcher; this bounds a hung one).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
WATCH_INTERVAL_S = 0.2
RANK_DIED_EXIT = 70


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(rank: int, size: int, port: int, device: torch.device) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Join the ranks' process groups: (the compute group as ``TensorParallel``, the control group)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    assert control is not None
    return TensorParallel(rank, size, dist.group.WORLD), control


class Followers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them its calls, watches them."""

    def __init__(self, cfg: EngineConfig, model_dir: Path, instance: int | None = None) -> None:
        self.size = cfg.tensor_parallel_size
        port = free_port()
        self.procs = [subprocess.Popen([sys.executable, "-m", "memserve.workers.tensor_parallel_rank",
                                        str(rank), str(port), str(model_dir), json.dumps(asdict(cfg)),
                                        str(-1 if instance is None else instance)])
                      for rank in range(1, self.size)]
        self.tp, self.control = join_group(0, self.size, port, torch.device(cfg.rank_device(0)))
        self._lock = threading.Lock()  # one call on the control group at a time, in rank 0's order
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while True:
            self._exit_if_dead()
            time.sleep(WATCH_INTERVAL_S)

    def _exit_if_dead(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                log.error("tensor-parallel rank %d exited with code %s: the worker goes down with it", rank, code)
                os._exit(RANK_DIED_EXIT)

    def exit_if_one_died(self, grace_s: float = 1.0) -> None:
        """After a step failed: exit, as the watcher would, if a rank is gone (or goes within
        ``grace_s``: a collective fails as soon as its peer's socket closes, before the
        process is reaped), so the requests move as a dead worker's rather than fail."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._exit_if_dead()
            time.sleep(0.02)

    @contextmanager
    def _call(self, method: str, *args: Any) -> Iterator[None]:
        """One call on the control group, in rank 0's order; a failure caused by a rank
        that died takes the worker down (``exit_if_one_died``)."""
        with self._lock:
            try:
                dist.broadcast_object_list([(method, args)], src=0, group=self.control)
                yield
            except Exception:
                self.exit_if_one_died()
                raise

    def send(self, method: str, *args: Any) -> None:
        """Have every other rank start ``method(*args)`` (it joins rank 0's collectives)."""
        with self._call(method, *args):
            pass

    def run(self, method: str, *args: Any, mine: Any) -> None:
        """``method(*args)`` on every rank, rank 0's own part being ``mine()``; returns
        when every rank has done it, raising if one failed."""
        with self._call(method, *args):
            self._check(_attempt(mine))

    def gather(self, method: str, *args: Any) -> list[Any]:
        """Every other rank's answer to ``method(*args)``, rank by rank; raises if one failed."""
        replies: list[Any] = [None] * self.size
        with self._call(method, *args):
            dist.gather_object((None, None), replies, dst=0, group=self.control)
        failed = [f"rank {r}: {error}" for r, (_, error) in enumerate(replies[1:], start=1) if error]
        if failed:
            raise RuntimeError("; ".join(failed))
        return [answer for answer, _ in replies[1:]]

    def scatter(self, method: str, *args: Any, pieces: list[Any], mine: Any) -> None:
        """``method(*args, pieces[rank - 1])`` on every other rank, ``mine()`` here;
        returns when every rank has done it, raising if one failed."""
        with self._call(method, *args):
            out: list[Any] = [None]
            dist.scatter_object_list(out, [None, *pieces], src=0, group=self.control)
            self._check(_attempt(mine))

    def _check(self, error: str | None) -> None:
        errors: list[Any] = [None] * self.size
        dist.gather_object(error, errors, dst=0, group=self.control)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise RuntimeError("; ".join(failed))


def _attempt(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        return repr(exc)
    return None


class GroupMover:
    """The MemPool's ``BlockMover`` over every rank's pools: a block is every rank's part.
    With a disk tier (``disk``, rank 0's store) the other ranks' stores follow its names
    and their failed reads count as its own (``tensor_parallel_disk.py``)."""

    def __init__(self, local: BlockMover, followers: Followers, disk: DiskStore | None = None) -> None:
        self.local, self.followers = local, followers
        self.disk = disk if isinstance(disk, GroupDiskStore) else None
        self.rank_nbytes = local.block_nbytes
        self.block_nbytes = local.block_nbytes * followers.size

    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        if dst_tier == Tier.DISK and self.disk is not None:
            self.disk.name_followers(dst_blocks)
        self.followers.run("copy_blocks", src_tier, src_blocks, dst_tier, dst_blocks,
                           mine=lambda: self.local.copy_blocks(src_tier, src_blocks, dst_tier, dst_blocks))
        if src_tier == Tier.DISK and self.disk is not None:
            self.disk.merge_failed(src_blocks)

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[Buffer]:
        """Per run of blocks, each block as every rank's part of it, rank by rank: the cut
        by blocks does not depend on how the runs fall (a peer's runs may fall otherwise)."""
        mine = self.local.read_blocks(tier, blocks)
        try:
            theirs = self.followers.gather("read_blocks", tier, blocks)
        except RuntimeError as exc:  # a rank's disk file was missing or bad
            if tier == Tier.DISK and self.disk is not None:
                self.disk.merge_failed(blocks)
            raise MemPoolError(str(exc)) from exc
        ranks = [[memoryview(run).cast("B") for run in mine], *([memoryview(run) for run in rank] for rank in theirs)]
        step = self.rank_nbytes
        return [b"".join(rank[i][b * step : (b + 1) * step] for b in range(len(run) // step) for rank in ranks)
                for i, run in enumerate(ranks[0])]

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[Buffer]) -> None:
        if tier == Tier.DISK and self.disk is not None:
            self.disk.name_followers(blocks)
        size, step = self.followers.size, self.rank_nbytes
        parts = recut(buffers, [step] * (len(blocks) * size))  # block by block, rank by rank
        by_rank: list[list[Buffer]] = [[] for _ in range(size)]
        first = 0
        for _, length in contiguous_runs(blocks):
            for r in range(size):
                by_rank[r].append(b"".join(parts[(first + b) * size + r] for b in range(length)))
            first += length
        self.followers.scatter("write_blocks", tier, blocks, pieces=[[bytes(p) for p in rank] for rank in by_rank[1:]],
                               mine=lambda: self.local.write_blocks(tier, blocks, by_rank[0]))

    def write_layer(self, tier: Tier, blocks: list[int], layer: int, buf: Buffer) -> None:
        """Store one layer of a by-layer transfer: every rank's part, rank by rank (as the
        sender's ``read_layer`` gathers them)."""
        view = memoryview(buf).cast("B")
        size = self.followers.size
        if len(view) % size:
            raise ValueError(f"one layer came as {len(view)} B, not a multiple of {size} ranks' parts")
        step = len(view) // size
        parts = [view[r * step : (r + 1) * step] for r in range(size)]
        local = self.local
        assert hasattr(local, "write_layer")  # the rank's pools (or its tiers over them)
        self.followers.scatter("write_layer", tier, blocks, layer, pieces=[bytes(p) for p in parts[1:]],
                               mine=lambda: local.write_layer(tier, blocks, layer, parts[0]))


class LayerReads:
    """A rank's layer hooks for the layers rank 0 reads in a step (``plan.layer_reads``):
    after each layer, join each read's gather (``ModelRunner.join_layer_read``), in rank 0's order."""

    def __init__(self, join_read: Callable[[list[int], int], None], reads: list[list[int]]) -> None:
        self.join_read, self.reads = join_read, reads

    def before_layer(self, layer: int) -> None:
        pass

    def after_layer(self, layer: int) -> None:
        for blocks in self.reads:
            self.join_read(blocks, layer)
