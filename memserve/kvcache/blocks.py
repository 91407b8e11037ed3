"""One tier's pool of fixed-size KV blocks: a free list and reference counts.

Plain Python lists, no object per block: allocating and freeing a batch of 256 blocks is
a slice, one loop over ints and an extend, so it stays far below the ~800 ns a block that
MemServe measured for its memory APIs.

A block is in one of three states, kept in one int per block:

- free (``FREE``): on the free list;
- held (count >= 1): referenced by that many owners (running requests);
- parked (0): allocated but referenced by nobody here because another structure owns
  it. The MemPool parks blocks that its radix index holds; the index then counts the
  references, and the block returns to the free list only when the index lets it go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from memserve.kvcache.address import MAX_BLOCKS

FREE = -1
_INVALID = -2


class MemPoolError(Exception):
    """Misuse of the memory pool (double free, unknown address, ...)."""


class OutOfBlocks(MemPoolError):
    """Not enough free (or evictable) blocks; nothing was allocated."""


def contiguous_runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """``(first_block, count)`` for each run of consecutive ids, in order: one copy or one
    network frame per run instead of one per block."""
    runs: list[tuple[int, int]] = []
    if not blocks:
        return runs
    start = prev = blocks[0]
    for b in blocks[1:]:
        if b != prev + 1:
            runs.append((start, prev - start + 1))
            start = b
        prev = b
    runs.append((start, prev - start + 1))
    return runs


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_first, dst_first, count)`` for each run over which ``src[i]`` and ``dst[i]``
    both go up by one: one copy per run of a block-to-block copy."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class BlockPool:
    """Free list plus reference counts for ``num_blocks`` blocks with ids ``0..n-1``.

    Fresh allocations come out in ascending, mostly contiguous runs (the free list is a
    stack whose top holds the lowest ids), which keeps copies and transfers in few runs.
    Every method either succeeds or raises ``MemPoolError`` leaving the pool unchanged.
    """

    def __init__(self, num_blocks: int) -> None:
        if not 0 <= num_blocks <= MAX_BLOCKS:
            raise ValueError(f"num_blocks must be in [0, {MAX_BLOCKS}], got {num_blocks}")
        self.num_blocks = num_blocks
        # The second half is padding no block uses: an id in [n, 2n) reads as invalid and a
        # larger one raises IndexError, so the hot loops need only a check for negative ids.
        self._refs = [FREE] * num_blocks + [_INVALID] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        """References held on ``block``: ``FREE`` (-1), 0 when parked, else >= 1."""
        return self._ref(block)

    def alloc(self, n: int) -> list[int]:
        """``n`` free blocks, each with one reference."""
        free = self._free
        if n > len(free):
            raise OutOfBlocks(f"need {n} blocks, {len(free)} free of {self.num_blocks}")
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate {n} blocks")
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        refs = self._refs
        for b in ids:
            refs[b] = 1
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks left with none become free."""
        refs = self._refs
        k = 0
        try:
            if ids and min(ids) >= 0:
                # Fast path: every block held exactly once (a request releasing its blocks).
                for k, b in enumerate(ids):  # noqa: B007 - k is read below
                    if refs[b] != 1:
                        break
                    refs[b] = FREE
                else:
                    self._free.extend(reversed(ids))
                    return
        except (IndexError, TypeError):
            pass
        for b in ids[:k]:
            refs[b] = 1
        self._free_general(ids)

    def _free_general(self, ids: Sequence[int]) -> None:
        """Shared blocks, repeated ids or misuse: validate everything, then apply."""
        drops = Counter(ids)
        for b, n in drops.items():
            r = self._ref(b)
            if r < n:
                if r >= 1:
                    raise MemPoolError(f"free: block {b} is held {r} times but freed {n} times in one call")
                raise MemPoolError(self._misuse("free", b, r))
        refs = self._refs
        self._set_counts(drops.keys(), [refs[b] - n for b, n in drops.items()])

    def incref(self, ids: Sequence[int]) -> None:
        """Add one reference to each held block."""
        self._require(ids, "incref", lambda r: r >= 1)
        refs = self._refs
        for b in ids:
            refs[b] += 1

    def park(self, ids: Sequence[int]) -> list[int]:
        """Hand held blocks to another owner: returns their reference counts and parks them."""
        refs = self._refs
        counts: list[int] = []
        append = counts.append
        k = 0
        try:
            if not ids or min(ids) >= 0:
                for k, b in enumerate(ids):  # noqa: B007 - k is read below
                    r = refs[b]
                    if r < 1:  # also a repeated id: parked a moment ago
                        break
                    append(r)
                    refs[b] = 0
                else:
                    return counts
        except (IndexError, TypeError):
            pass
        for b, c in zip(ids[:k], counts):
            refs[b] = c
        self._require(ids, "park", lambda r: r >= 1)
        raise AssertionError("unreachable: _require raises")

    def unpark(self, ids: Sequence[int], counts: Sequence[int]) -> None:
        """Give parked blocks back their references; a count of 0 frees the block."""
        self._require(ids, "unpark", lambda r: r == 0)
        self._set_counts(ids, counts)

    def _set_counts(self, ids: Iterable[int], counts: Sequence[int]) -> None:
        """Give each block its new reference count; blocks at 0 return to the free list
        (reversed, so the lowest ids come off the stack first again)."""
        refs = self._refs
        released = []
        for b, c in zip(ids, counts):
            if c > 0:
                refs[b] = c
            else:
                refs[b] = FREE
                released.append(b)
        released.reverse()
        self._free.extend(released)

    def release(self, ids: Sequence[int]) -> None:
        """Return parked blocks to the free list."""
        self.unpark(ids, [0] * len(ids))

    def _ref(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise MemPoolError(f"block id {block} out of range [0, {self.num_blocks})")
        return self._refs[block]

    def _require(self, ids: Sequence[int], op: str, ok: Callable[[int], bool]) -> None:
        if len(set(ids)) != len(ids):
            raise MemPoolError(f"{op}: repeated block ids in {list(ids)}")
        for b in ids:
            r = self._ref(b)
            if not ok(r):
                raise MemPoolError(self._misuse(op, b, r))

    @staticmethod
    def _misuse(op: str, block: int, ref: int) -> str:
        if ref == FREE:
            state = "free (never allocated, or already freed)"
        elif ref == 0:
            state = "parked (owned by the index)"
        else:
            state = f"held {ref} times"
        return f"{op}: block {block} is {state}"
