"""Reusing a truncated conversation's cached KV at its new positions (AttentionStore §3.4).

When the gateway drops whole blocks of a conversation's oldest turns (``text/
truncation.py``), the turns it kept sit that many positions earlier: their blocks get new
chained names, so an ordinary lookup misses them, and their cached keys carry the old
positions. Before the request is queued, ``reuse_truncated`` finds the untruncated
conversation's cached device blocks beyond the dropped range, has the runner copy them
with their keys rotated back by the dropped length (``model/kv_shift.py``), and indexes
the copies under the truncated prompt's names: the scheduler then sees an ordinary hit.

A conversation truncated at an earlier turn was cached under that turn's truncation, which
dropped fewer blocks at the same place; so every smaller drop is a candidate source (the
untruncated conversation, nothing dropped, included) and the one that covers the most
blocks wins. Only device blocks are shifted: the copy runs on the device pool. Pure
Python: the tensors move in the runner."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mempool import MemPool

# (source block ids, destination block ids, positions to move the keys by)
ShiftBlocks = Callable[[list[int], list[int], int], None]


@dataclass(frozen=True)
class _Plan:
    hashes: list[int]  # the truncated prompt's block names, through the last block to fill
    indexed: list[int]  # addresses of its blocks already cached (a prefix of ``hashes``)
    sources: list[int]  # device block ids to shift into the blocks after ``indexed``
    delta: int  # positions their keys move by (negative)


def reuse_truncated(mempool: MemPool, prompt: Sequence[int], dropped_at: int, dropped: Sequence[int],
                    shift: ShiftBlocks, salt: str | None = None) -> int:
    """Cache the truncated ``prompt``'s blocks after its kept head from shifted copies of
    the conversation's earlier KV; ``dropped`` are the tokens the gateway removed at token
    offset ``dropped_at`` (both block-aligned). Returns how many blocks were indexed.
    ``salt``: the request's ``cache_salt`` (only the same salt's earlier KV is reused)."""
    bs = mempool.block_size
    if not (mempool.enable_caching and dropped and dropped_at % bs == 0 and len(dropped) % bs == 0):
        return 0
    plan = _plan(mempool, prompt, dropped_at, dropped, salt)
    if plan is None or not mempool.can_alloc(len(plan.sources)):
        return 0
    dst = mempool.alloc_mem(len(plan.sources))
    plan = _plan(mempool, prompt, dropped_at, dropped, salt)  # the allocation may have evicted cached blocks
    n = min(len(plan.sources), len(dst)) if plan is not None else 0
    newly = 0
    if plan is not None and n:
        shift(plan.sources[:n], [addr_block(a) for a in dst[:n]], plan.delta)
        newly = mempool.insert((), plan.indexed + dst[:n], hashes=plan.hashes[: len(plan.indexed) + n])
    mempool.free_mem(dst)  # indexed copies stay cached; the others go back to the free list
    return newly


def _plan(mempool: MemPool, prompt: Sequence[int], dropped_at: int, dropped: Sequence[int],
          salt: str | None = None) -> _Plan | None:
    """The candidate source covering the most of the truncated prompt's uncached blocks
    (peeking only: nothing is held); None when there is nothing to shift."""
    bs = mempool.block_size
    head, num_dropped = dropped_at // bs, len(dropped) // bs
    num_target = (len(prompt) - 1) // bs  # its last token is always computed: no block past it is read
    hashes = block_hashes(prompt[: num_target * bs], bs, salt=salt)
    indexed = mempool.match((), take_ref=False, hashes=hashes)
    if len(indexed) < head or len(indexed) >= num_target:
        return None  # the head is not cached (nothing to chain to), or nothing is missing
    original = [*prompt[:dropped_at], *dropped, *prompt[dropped_at:]]
    parent = hashes[head - 1] if head else None
    best: _Plan | None = None
    for earlier in range(num_dropped):  # blocks an earlier truncation dropped here (0: none)
        gap = num_dropped - earlier  # the candidate's block j holds the target's block j - gap
        start = dropped_at + earlier * bs
        first = block_hashes(original[start : start + bs], bs, parent, salt)
        if not mempool.match((), take_ref=False, hashes=hashes[:head] + first):
            continue  # cheap test: the candidate's first block after the head is not cached
        end = start + (num_target + gap - head) * bs
        chain = mempool.match((), take_ref=False,
                              hashes=hashes[:head] + block_hashes(original[start:end], bs, parent, salt))
        sources: list[int] = []
        for a in chain[len(indexed) + gap :]:
            if addr_tier(a) != Tier.DEVICE:
                break
            sources.append(addr_block(a))
        if sources and (best is None or len(sources) > len(best.sources)):
            best = _Plan(hashes, indexed, sources, -gap * bs)
    return best
