"""KV events: what a worker's index did, shipped to the gateway's prompt-tree mirrors.

Every change to a MemPool's index becomes one event, in order: a chain of blocks stored
by ``insert``, blocks removed by eviction or ``delete``, blocks moved between tiers by
swapping. Applying them in order to a ``PromptTreeMirror`` reproduces the index exactly,
so the router knows what each worker has cached instead of guessing (the names are the
chained block hashes both sides compute). They travel in msgpack as ``KVEvents``; the
ipc side registers them with its codec (kvcache knows no wire format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from memserve.kvcache.address import Tier, addr_instance, addr_tier

STORED = "stored"
REMOVED = "removed"
MOVED = "moved"


@dataclass
class KVEvent:
    """One index change.

    - ``stored``: ``hashes`` form a chain whose first block hangs below ``parent``
      (None: the prompt's start); ``addrs[i]`` is where block ``hashes[i]`` lives.
    - ``removed``: ``hashes`` left the index, deepest first (each was a leaf when removed).
    - ``moved``: block ``hashes[i]`` now lives at ``addrs[i]`` (another tier).

    An address encodes instance, tier and block (``address.py``).
    """

    type: str
    hashes: list[int]
    parent: int | None = None
    addrs: list[int] = field(default_factory=list)

    @property
    def tiers(self) -> list[Tier]:
        return [addr_tier(a) for a in self.addrs]

    @property
    def instances(self) -> list[int]:
        return [addr_instance(a) for a in self.addrs]


@dataclass
class KVEvents:
    """A worker's batch of events, in the order they happened."""

    kind: ClassVar[str] = "kv_events"
    instance_id: int
    events: list[KVEvent]

