"""Prefixes the router has sent to an instance whose KV events have not arrived yet.

The mirrors only learn of a block once its instance has computed it and the KV event
crossed the socket, which for a long prompt is seconds after routing. Without this
record, a second copy of a prompt arriving during the first one's prefill sees no
cached prefix anywhere: prompt-tree sends it to the least loaded instance and the cost
router prices it as uncached, so two instances prefill the same blocks and each holds
a copy. Here a routed prompt's block names (``hashing.block_hashes``, the names the
mirrors and events use) count as held by its instance from the moment it is routed
until the instance's events cover them (``settle``), the request ends (``discard``) or
``ttl_s`` passes on the injected clock (a safety net; every request ends). While its
request is in flight the instance holds its prompt blocks, so nothing it claims can
have been evicted.

Memory is bounded: at most ``max_blocks`` names are held, the oldest requests' names
dropped first. Pure Python on an injected clock: the simulator routes with it too."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memserve.kvcache.mirror import PromptTreeMirror

# A safety net only (every routed request is released when it ends): long enough for a
# long prompt to queue and prefill on a loaded CPU worker.
PENDING_TTL_S = 120.0
# Block names held at most (about 100 bytes each); 4M tokens of in-flight prompts at 16 a block.
MAX_PENDING_BLOCKS = 1 << 18


@dataclass
class _Pending:
    instance: int
    hashes: list[int]
    at: float


class PendingPrefixes:
    def __init__(self, clock: Callable[[], float], ttl_s: float = PENDING_TTL_S,
                 max_blocks: int = MAX_PENDING_BLOCKS) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._requests: OrderedDict[str, _Pending] = OrderedDict()  # oldest first
        self._requests_on: dict[int, set[str]] = {}  # instance -> its claims (settle reads only these)
        self._on: dict[int, Counter[int]] = {}  # instance -> block name -> requests claiming it
        self._blocks = 0

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_blocks(self) -> int:
        return self._blocks

    def add(self, request_id: str, instance: int, hashes: Sequence[int]) -> None:
        """``request_id``'s prompt, named by ``hashes``, was routed to ``instance`` (again,
        when re-routed: the old claim goes)."""
        self.discard(request_id)
        if not hashes:
            return
        hashes = list(hashes[: self.max_blocks])  # a longer prompt claims its beginning only
        self._requests[request_id] = _Pending(instance, hashes, self.clock())
        self._requests_on.setdefault(instance, set()).add(request_id)
        self._on.setdefault(instance, Counter()).update(hashes)
        self._blocks += len(hashes)
        while self._blocks > self.max_blocks:
            self.discard(next(iter(self._requests)))

    def discard(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        self._requests_on[entry.instance].discard(request_id)
        names = self._on[entry.instance]
        for h in entry.hashes:
            left = names[h] - 1
            if left:
                names[h] = left
            else:
                del names[h]
        self._blocks -= len(entry.hashes)

    def settle(self, mirror: PromptTreeMirror) -> None:
        """``mirror``'s instance sent KV events: claims it now holds are the mirror's. A
        chained name implies its whole prefix, and a radix index removes leaves first,
        so a claim is covered when its last block is in the index."""
        covered = [rid for rid in self._requests_on.get(mirror.instance_id, ())
                   if mirror.index.get(self._requests[rid].hashes[-1]) is not None]
        for rid in covered:
            self.discard(rid)

    def match(self, instance: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt named ``hashes`` are claimed on ``instance``."""
        self._expire()
        names = self._on.get(instance)
        if not names:
            return 0
        n = 0
        for h in hashes:
            if h not in names:
                break
            n += 1
        return n

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl_s
        while self._requests:
            rid, entry = next(iter(self._requests.items()))
            if entry.at > horizon:
                return
            self.discard(rid)
