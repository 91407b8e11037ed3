"""What the parts of a MemPool share: its state and the helpers one part calls on another.

``MemPool`` is assembled by concern from mixins: memory, index and state in
``mempool.py``, tier moves in ``tiering.py``, the transfer API in ``transfer_api.py``.
They all work on the same block pools, index, mover and saver. ``PoolState``, their common
base, declares those attributes (``MemPool.__init__`` sets them) and the helpers the mixins
call across files (``MemPool`` defines them), so that each part is type-checked against
the others. Declarations only: nothing here exists at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import BlockPool
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.events import KVEvent
from memserve.kvcache.mover import BlockMover, TransferEndpoint
from memserve.kvcache.pinning import Pins
from memserve.kvcache.radix import RadixIndex, RadixNode
from memserve.kvcache.saver import Saver


class Held(NamedTuple):
    """A held local block, decoded (``MemPool._held``)."""

    addr: int
    tier: int
    block: int
    node: RadixNode | None  # None: a private block


class PoolState:
    instance_id: int
    block_size: int
    enable_caching: bool
    mover: BlockMover | None  # None: no tier moves, no transfers
    tiers: list[Tier]  # the tiers this pool has blocks in, fastest first
    index: RadixIndex
    saver: Saver
    disk: DiskStore | None  # the DISK tier's files, when there is one
    pins: Pins | None  # blocks requests pinned (cache_control); None: pinning is off
    _clock: Callable[[], float]
    _pools: list[BlockPool | None]  # per tier (indexed by Tier); None: no such tier here
    _node_of: list[list[RadixNode | None]]  # per tier and block: the node indexing it
    _events: list[KVEvent]
    _transfer: TransferEndpoint | None
    _hit_tokens: int
    _query_tokens: int
    _watermark: list[int]  # per tier: blocks kick_saves keeps free or being saved
    _saving: list[int]  # per tier: cached blocks being saved out of it (pinned)
    _incoming: list[int]  # per tier: blocks reserved for saves into it
    _io_bytes: list[list[int]]  # per tier: [bytes read from it, bytes written to it]
    _hits: list[int]  # per tier: blocks matched there
    _dropped_unsaved: list[int]  # per tier: blocks dropped though a slower tier exists
    _corrupt: list[RadixNode]  # disk blocks found bad, forgotten once idle
    _prefetched: set[int]  # names of blocks a prefetch started moving up, not read since
    _prefetch_blocks: int
    _prefetch_hits: int

    if TYPE_CHECKING:
        # Defined by MemPool (mempool.py), called by the other parts.

        def alloc_mem(self, size: int, type: Tier = Tier.DEVICE, instance: int | None = None,  # noqa: A002
                      ticket: str = "") -> list[int]: ...

        def free_mem(self, addrs: Sequence[int]) -> None: ...

        def _forget(self, removed: list[RadixNode]) -> None: ...

        def _addr(self, tier: int, block: int) -> int: ...

        def _runs_by_tier(self, addrs: Sequence[int], op: str) -> list[tuple[Tier, list[int]]]: ...

        def _held(self, addrs: Sequence[int], op: str) -> list[Held]: ...

        def _pool(self, tier: int, op: str) -> BlockPool: ...

        def _need_mover(self, op: str) -> BlockMover: ...
