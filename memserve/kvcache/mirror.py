"""The gateway's copy of one worker's prompt tree, kept exact by the worker's KV events.

The gateway keeps one mirror per instance and asks each how much of a prompt it has
cached; hashing a prompt once and asking every mirror with ``match_hashes`` keeps that
to one pass over the tokens. A mirror never locks or evicts anything (its index keeps no
eviction order): it only replays what its worker did, so an event that does not fit
(unknown block, removal of a node that still has children) means the stream was broken
and raises ``ValueError``; the gateway should then ``reset`` the mirror (e.g. when the
worker restarts).
"""

from __future__ import annotations

from collections.abc import Sequence

from memserve.kvcache.address import addr_tier
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.events import MOVED, REMOVED, STORED, KVEvent, KVEvents
from memserve.kvcache.radix import RadixIndex


class PromptTreeMirror:
    def __init__(self, instance_id: int, block_size: int) -> None:
        self.instance_id = instance_id
        self.block_size = block_size
        self.index = RadixIndex(block_size, evicts=False)
        # Counters over the mirror's life (a reset keeps them): blocks that left the
        # worker's index (eviction, expiry, delete) and blocks moved to a slower tier.
        self.removed_blocks = 0
        self.demoted_blocks = 0

    def reset(self) -> None:
        self.index = RadixIndex(self.block_size, evicts=False)

    def apply(self, batch: KVEvents) -> None:
        if batch.instance_id != self.instance_id:
            raise ValueError(f"events of instance {batch.instance_id} sent to the mirror of {self.instance_id}")
        for event in batch.events:
            self.apply_event(event)

    def apply_event(self, event: KVEvent) -> None:
        index = self.index
        try:
            if event.type == STORED:
                index.add_chain(event.parent, event.hashes, event.addrs)
            elif event.type == REMOVED:
                for h in event.hashes:
                    index.remove(self._node(h))
                    self.removed_blocks += 1
            elif event.type == MOVED:
                for h, addr in zip(event.hashes, event.addrs, strict=True):
                    node = self._node(h)
                    if addr_tier(addr) > addr_tier(node.addr):
                        self.demoted_blocks += 1
                    index.move(node, addr)
            else:
                raise ValueError(f"unknown KV event type {event.type!r}")
        except MemPoolError as e:
            raise ValueError(f"KV event {event.type} does not fit the mirror of instance {self.instance_id}: {e}") from e

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Addresses of the instance's longest cached prefix of ``tokens``."""
        return [node.addr for node in self.index.match(tokens)]

    def match_hashes(self, hashes: Sequence[int]) -> list[int]:
        """Like ``match`` for a prompt already named with ``hashing.block_hashes``."""
        return [node.addr for node in self.index.match_hashes(hashes)]

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the instance has cached (any tier)."""
        return len(self.index.match(tokens)) * self.block_size

    def entries(self) -> set[tuple[int, int | None, int]]:
        return self.index.entries()

    def _node(self, block_hash: int):
        node = self.index.get(block_hash)
        if node is None:
            raise ValueError(f"block {block_hash:#x} is not in the mirror of instance {self.instance_id}")
        return node
