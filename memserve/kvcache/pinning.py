"""Per-request retention: blocks a request pinned with ``cache_control`` (the shape hosted
chat APIs use: ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` on a message) stay cached
for the TTL, on whichever tier holds them.

A pin names blocks by hash, so it follows a block as it moves between tiers and covers
it again if it is ever recomputed. Pinned blocks are the last to go: the eviction
policy is wrapped (``PinnedLast``) so that every tier gives up its unpinned idle blocks
first, and a tier that must give up a pinned one demotes it to the next slower tier
when that tier has room (``tiering.TierMoves._evict``). Pins never hold a block in use
and never stop a running request from getting blocks: they only reorder eviction.

The caps. At most ``fraction`` of the smallest tier's blocks are pinned at once (so the
pins fit within that share of every tier), and at most ``fraction_per_key`` of them by
one owner (an API key's id), so that one tenant's hour-long pins cannot take every
other tenant's share. A pin that would pass either is refused whole, with the reason;
pins are best effort, as hosted prompt caches are: the request is served unpinned and
the gateway says so. A pin counts from the moment it is taken (before its blocks are
computed) until it expires; a request that pins blocks already pinned renews them and
costs nothing against the total cap, nor against its owner's when the owner pinned
them before.

Expiry runs on the injected clock: ``sweep`` unpins what expired, when an expiry is
due, and lists those blocks in the eviction heap again under their unpinned priority.
The eviction policy is wrapped only at the first pin, so a pool nobody pins evicts
exactly as before."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from memserve.kvcache.address import Tier
from memserve.kvcache.eviction import CachedBlock, EvictionPolicy, Priority
from memserve.kvcache.radix import RadixIndex

DEFAULT_MAX_PINNED_FRACTION = 0.25


class PinnedLast:
    """An eviction policy with pinned blocks after every unpinned one (same order within each)."""

    def __init__(self, inner: EvictionPolicy, pins: Pins) -> None:
        self.inner = inner
        self.pins = pins
        self.name = inner.name

    def priority(self, node: CachedBlock) -> tuple[bool, Priority]:
        return node.hash in self.pins, self.inner.priority(node)


class Pins:
    """The pinned blocks of one MemPool, by hash, with their expiry times."""

    def __init__(self, index: RadixIndex, tier_blocks: Iterable[int], fraction: float,
                 clock: Callable[[], float], fraction_per_key: float | None = None) -> None:
        per_key = fraction if fraction_per_key is None else fraction_per_key
        for f in (fraction, per_key):
            if not 0 <= f <= 1:
                raise ValueError(f"a pinned fraction must be in [0, 1], got {f}")
        self.index = index
        self.fraction = fraction
        self.fraction_per_key = min(per_key, fraction)
        smallest = min(tier_blocks)
        self.cap = math.floor(fraction * smallest)
        self.key_cap = math.floor(self.fraction_per_key * smallest)
        self.clock = clock
        self._until: dict[int, float] = {}  # block hash -> when its pin expires
        self._owners: dict[int, set[str]] = {}  # block hash -> the owners who pinned it
        self._owned: Counter[str] = Counter()  # owner -> blocks it pinned
        self._next_expiry = math.inf
        self._wrapped = False

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._until

    def __len__(self) -> int:
        return len(self._until)

    def new_blocks(self, hashes: Iterable[int]) -> int:
        """How many of these blocks a pin would add (the others are pinned already)."""
        until = self._until
        return len({h for h in hashes if h not in until})

    def owned(self, owner: str) -> int:
        """Blocks ``owner`` has pinned now."""
        return self._owned[owner]

    def pin(self, hashes: list[int], ttl_s: float, owner: str = "") -> str | None:
        """Pin these blocks for ``owner`` until ``ttl_s`` from now (renewing pins they
        have); all or nothing: the reason, and nothing pinned, when a cap would be passed."""
        self.sweep()
        unique = set(hashes)
        new = self.new_blocks(unique)
        if len(self._until) + new > self.cap:
            return (f"cache_control would pin {new} more KV blocks; {len(self._until)} of the cap of {self.cap} "
                    f"are pinned (--max-pinned-fraction {self.fraction} of the smallest KV tier)")
        mine = [h for h in unique if owner not in self._owners.get(h, ())]
        if self._owned[owner] + len(mine) > self.key_cap:
            return (f"cache_control would pin {len(mine)} more KV blocks for this API key; it has "
                    f"{self._owned[owner]} of its cap of {self.key_cap} (--max-pinned-fraction-per-key "
                    f"{self.fraction_per_key} of the smallest KV tier)")
        if not self._wrapped:
            self.index.set_eviction(PinnedLast(self.index.eviction, self))
            self._wrapped = True
        until = self.clock() + ttl_s
        added = [h for h in unique if h not in self._until]
        for h in unique:
            self._until[h] = max(self._until.get(h, until), until)
        for h in mine:
            self._owners.setdefault(h, set()).add(owner)
        self._owned[owner] += len(mine)
        self._next_expiry = min(self._next_expiry, until)
        self._requeue(added)
        return None

    def sweep(self) -> int:
        """Unpin the blocks whose TTL ran out, when one is due; returns how many."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        expired = [h for h, t in self._until.items() if t <= now]
        for h in expired:
            del self._until[h]
            for owner in self._owners.pop(h, ()):
                self._owned[owner] -= 1
        self._next_expiry = min(self._until.values(), default=math.inf)
        self._requeue(expired)
        return len(expired)

    def per_tier(self) -> dict[Tier, int]:
        """Pinned blocks cached in each tier (pins of blocks not cached now are not counted)."""
        counts = {tier: 0 for tier in Tier}
        for h in self._until:
            node = self.index.get(h)
            if node is not None:
                counts[node.tier] += 1
        return counts

    def _requeue(self, hashes: list[int]) -> None:
        """Their priority changed: the index lists them again (stale entries are skipped)."""
        nodes = [n for n in map(self.index.get, hashes) if n is not None]
        self.index.requeue(nodes)

