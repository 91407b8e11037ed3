"""The disk tier: one file per cached KV block, named by the block's chained hash.

``<dir>/<fingerprint>/i<instance>/<hash>.kv`` holds a header (magic, fingerprint, block hash, parent
hash, payload size, xxh3 checksum of all of it) and the block's bytes. The fingerprint
names the model, dtype, KV cache dtype and KV layout, so a directory shared by several
models or KV dtypes (or kept across an upgrade that changes them) never serves one's KV
to another: each fingerprint has a directory of its own, and a file is checked against it. File names
come from block hashes only, never from user input. A file is written to a temporary
name and renamed, so a reader (or a restart after a crash mid-save) sees a whole file or
none; a missing, short or corrupt file reads as a miss (``read`` returns None and records
the slot in ``failed``), never as wrong bytes.

A tensor-parallel worker keeps one store per rank, each holding its heads' part of every
block (``i<instance>r<rank>``, ``part``): rank 0's MemPool names the slots and the others
follow its names (``workers/tensor_parallel_disk.py``).

The MemPool sees the disk as a tier of ``num_blocks`` slots (``--disk-cache-gb``): it
``name``s a slot before a save writes it; each slot keeps at most one file, so the
directory stays within its budget. ``scan`` re-indexes the directory an earlier run of
the same instance left: checksums verified, chains whose parent is missing dropped.

Threads: ``name``, ``failed``, ``scan`` (``verified`` and ``adopt``) run on the MemPool's thread; ``write`` on
the saver thread only; ``read`` on the loading thread (or the saver, disk -> host).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

import xxhash

from memserve.kvcache.mover import Buffer

MAGIC = b"MSKVBLK1"
_FIELDS = struct.Struct("<8sQQQQQ")  # magic, fingerprint, hash, parent, has_parent, nbytes
_CHECKSUM = struct.Struct("<Q")
HEADER_NBYTES = _FIELDS.size + _CHECKSUM.size
SUFFIX = ".kv"


def fingerprint(*parts: bytes | str) -> int:
    """A 64-bit name for what makes KV bytes reusable (model, dtype, KV dtype, layout, block size)."""
    h = xxhash.xxh3_64()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.intdigest()


class DiskStore:
    def __init__(self, root: str | Path, capacity_bytes: int, block_nbytes: int, fingerprint: int,
                 part: str = "") -> None:
        self.block_nbytes = block_nbytes
        self.fingerprint = fingerprint
        self.part = part  # names the rank's directory of a tensor-parallel worker ("" alone)
        self.root = Path(root) / f"{fingerprint:016x}"
        self.dir = self.root  # set by ``scan``: one directory per instance
        self.num_blocks = capacity_bytes // (HEADER_NBYTES + block_nbytes)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._names: list[tuple[int, int | None] | None] = [None] * self.num_blocks  # slot -> (hash, parent)
        self._file_of: list[int | None] = [None] * self.num_blocks  # slot -> hash of the file it wrote (saver)
        self._slot_of_file: dict[int, int] = {}  # hash -> the slot whose file it is (saver)
        self._failed: set[int] = set()
        self._dir_made = False

    # ------------------------------------------------------------- MemPool side
    def name(self, slot: int, block_hash: int, parent: int | None) -> None:
        """The block the next ``write`` of ``slot`` holds (a new name clears a failure)."""
        self._names[slot] = (block_hash, parent)
        with self._lock:
            self._failed.discard(slot)

    def names(self, slots: Iterable[int]) -> list[tuple[int, int | None] | None]:
        """What each of ``slots`` is named (for another rank's store to follow)."""
        return [self._names[slot] for slot in slots]

    def failed(self, slots: Iterable[int]) -> set[int]:
        """Those of ``slots`` whose file a read found missing or bad. A slot stays failed
        until it is named again: every load that read it skipped it."""
        with self._lock:
            return self._failed.intersection(slots)

    def mark_failed(self, slots: Iterable[int]) -> None:
        """Record ``slots`` as failed reads (another rank's part of them was missing or bad)."""
        with self._lock:
            self._failed.update(slots)

    def scan(self, instance_id: int) -> list[tuple[int, int | None]]:
        """Use instance ``instance_id``'s directory: verify the files an earlier run left
        there and adopt the valid ones whose parent chain reaches a prompt's start,
        parents first, up to ``num_blocks``: entry i becomes slot i. Every other file
        (temporary ones of a save cut short included) is deleted."""
        return self.adopt(self.verified(instance_id))

    def verified(self, instance_id: int) -> dict[int, int | None]:
        """Use instance ``instance_id``'s directory; its valid block files, hash -> parent
        hash (every other file is deleted)."""
        self._reset()
        self.dir = self.root / f"i{instance_id}{self.part}"
        found: dict[int, int | None] = {}
        for path in self.dir.iterdir() if self.dir.is_dir() else ():
            block_hash = _hash_of(path.name)
            loaded = self._load(path, block_hash) if block_hash is not None else None
            if block_hash is None or loaded is None:
                _unlink(path)
            else:
                found[block_hash] = loaded[0]
        return found

    def adopt(self, found: dict[int, int | None]) -> list[tuple[int, int | None]]:
        """Of the ``verified`` files ``found``, those whose parent chain reaches a prompt's
        start, parents first, up to ``num_blocks``: entry i becomes slot i (``adopt_order``)."""
        children: dict[int | None, list[int]] = {}
        for h, parent in found.items():
            children.setdefault(parent, []).append(h)
        order: list[tuple[int, int | None]] = []
        stack = sorted(children.get(None, []), reverse=True)
        parents: dict[int, int | None] = {h: None for h in stack}
        while stack and len(order) < self.num_blocks:  # depth first: one chain's blocks stay together
            h = stack.pop()
            order.append((h, parents[h]))
            for child in sorted(children.get(h, []), reverse=True):
                parents[child] = h
                stack.append(child)
        self.adopt_order(order)
        return order

    def adopt_order(self, order: list[tuple[int, int | None]]) -> None:
        """Entry i of ``order`` (hash, parent) becomes slot i; every other block file in
        the directory is deleted."""
        kept = {h for h, _ in order}
        for path in self.dir.iterdir() if self.dir.is_dir() else ():
            if _hash_of(path.name) not in kept:
                _unlink(path)
        for slot, (h, parent) in enumerate(order):
            self._names[slot] = (h, parent)
            self._file_of[slot] = h
            self._slot_of_file[h] = slot

    def forget(self, block_hash: int) -> None:
        """Delete the block's file now, wherever it is (an expired conversation must not
        come back at the next restart). Only for a block no save is writing."""
        with self._lock:
            slot = self._slot_of_file.pop(block_hash, None)
            if slot is None:
                return
            if self._file_of[slot] == block_hash:
                self._file_of[slot] = None
            _unlink(self._path(block_hash))

    # ------------------------------------------------------------- data side
    def write(self, slot: int, data: Buffer) -> None:
        """Store ``data`` as the block named for ``slot``: temp file, then rename."""
        named = self._names[slot]
        assert named is not None  # the MemPool names a slot before it saves to it
        block_hash, parent = named
        view = memoryview(data).cast("B")
        if len(view) != self.block_nbytes:
            raise ValueError(f"disk block: {len(view)} bytes, expected {self.block_nbytes}")
        fields = _FIELDS.pack(MAGIC, self.fingerprint, block_hash, parent or 0, parent is not None, len(view))
        checksum = xxhash.xxh3_64(fields)
        checksum.update(view)
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        if not self._dir_made:  # made by the first save, so an unused instance leaves no trace
            self.dir.mkdir(parents=True, exist_ok=True)
            self._dir_made = True
        with open(tmp, "wb") as f:
            f.write(fields)
            f.write(_CHECKSUM.pack(checksum.intdigest()))
            f.write(view)
        os.replace(tmp, path)
        with self._lock:  # ``forget`` may drop the old file meanwhile
            old = self._file_of[slot]
            if old is not None and old != block_hash and self._slot_of_file.get(old) == slot:
                del self._slot_of_file[old]
                _unlink(self._path(old))
            self._file_of[slot] = block_hash
            self._slot_of_file[block_hash] = slot

    def read(self, slot: int) -> memoryview | None:
        """The block's bytes, or None (recorded for ``failed``) when its file is
        missing, short or fails its checksum; a bad file is deleted."""
        name = self._names[slot]
        loaded = None
        if name is not None:
            path = self._path(name[0])
            loaded = self._load(path, name[0])
            if loaded is None or loaded[0] != name[1]:
                loaded = None
                _unlink(path)
        if loaded is None:
            with self._lock:
                self._failed.add(slot)
            return None
        return loaded[1]

    def _load(self, path: Path, block_hash: int) -> tuple[int | None, memoryview] | None:
        """``(parent hash, payload)`` of a block file, checked; None when anything is off."""
        buf = bytearray(HEADER_NBYTES + self.block_nbytes)
        try:
            with open(path, "rb") as f:
                n = f.readinto(buf)
                extra = f.read(1)
        except OSError:
            return None
        if n != len(buf) or extra:
            return None
        magic, fp, h, par, has_parent, nbytes = _FIELDS.unpack_from(buf)
        (checksum,) = _CHECKSUM.unpack_from(buf, _FIELDS.size)
        if magic != MAGIC or fp != self.fingerprint or h != block_hash or nbytes != self.block_nbytes:
            return None
        digest = xxhash.xxh3_64(memoryview(buf)[: _FIELDS.size])
        digest.update(memoryview(buf)[HEADER_NBYTES:])
        if digest.intdigest() != checksum:
            return None
        return (par if has_parent else None), memoryview(buf)[HEADER_NBYTES:]

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"


def _hash_of(filename: str) -> int | None:
    stem, dot, ext = filename.partition(".")
    if dot + ext != SUFFIX or len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
