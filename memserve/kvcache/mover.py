"""The data side of a MemPool: what moves the bytes behind block ids between tiers
(``BlockMover``, implemented by the model runner over its KV tensors) and between
instances (``TransferEndpoint``, implemented by ``ipc/kv_transfer.py`` over ZeroMQ). The
MemPool keeps the bookkeeping and calls these; it never touches bytes or sockets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Union

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import MemPoolError

Buffer = Union[bytes, bytearray, memoryview]


class BlockMover(Protocol):
    """What the model runner provides: the bytes behind block ids. Copies must take
    effect in call order relative to the runner's later reads and writes of the same
    blocks (a CUDA stream gives that)."""

    block_nbytes: int  # bytes of one block (all layers, K and V) in every tier

    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        """Copy block ``src_blocks[i]`` of ``src_tier`` to ``dst_blocks[i]`` of ``dst_tier``."""

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[Buffer]:
        """The blocks' bytes, one buffer per run of consecutive ids (zero-copy views
        where the tier is host memory). They must stay valid until the next call that
        writes those blocks."""

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[Buffer]) -> None:
        """Store the blocks' bytes: ``buffers[i]`` holds the i-th run of consecutive ids
        of ``blocks`` (the same cut as ``read_blocks``; see ``contiguous_runs``)."""


def recut(buffers: Sequence[Buffer], sizes: list[int]) -> list[Buffer]:
    """The bytes of ``buffers`` cut into pieces of ``sizes``: views where a piece lies in
    one buffer, a joined copy where it spans several."""
    views = [memoryview(b).cast("B") for b in buffers]
    if sum(len(v) for v in views) != sum(sizes):
        raise MemPoolError(f"write_blocks: {sum(sizes)} bytes expected, got {sum(len(v) for v in views)}")
    out: list[Buffer] = []
    i, offset = 0, 0
    for size in sizes:
        head = views[i]
        if len(head) - offset >= size:
            out.append(head[offset : offset + size])
            offset += size
        else:
            parts = []
            while size:
                head = views[i]
                take = min(size, len(head) - offset)
                parts.append(head[offset : offset + take])
                size -= take
                offset += take
                if offset == len(head) and size:
                    i, offset = i + 1, 0
            out.append(b"".join(parts))
        if i < len(views) and offset == len(views[i]):
            i, offset = i + 1, 0
    return out


class TransferEndpoint(Protocol):
    """One instance's end of the KV transfer network (MemServe §4.3)."""

    def allocate(self, instance: int, size: int, tier: Tier, ticket: str) -> list[int]:
        """``alloc_mem`` on another instance, for the transfer it expects under ``ticket``."""
        ...

    def send(self, instance: int, src: list[int], dst: Sequence[int] | None, flags: int, private: Any, ticket: str,
             tokens: list[int] | None = None, first_block: int = 0) -> list[int]:
        """Copy held blocks ``src`` to ``instance``; returns their addresses there."""
        ...
