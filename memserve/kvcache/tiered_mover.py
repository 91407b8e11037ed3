"""A ``BlockMover`` over the runner's memory tiers plus the disk tier.

Copies that touch no disk go to the runner's mover unchanged. A save to disk reads the
source blocks through the runner's mover (zero-copy views of host memory) and writes one
file per block; a load from disk reads the files and writes the bytes into the
destination tier. A block whose file is missing or corrupt is skipped, its destination
left untouched: the disk store records the miss and the MemPool treats the block as not
loaded (``commit_swap_in``), so bad bytes are never used."""

from __future__ import annotations

from collections.abc import Sequence

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import MemPoolError, contiguous_runs
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.mover import BlockMover, Buffer, recut


class TieredMover:
    def __init__(self, base: BlockMover, disk: DiskStore) -> None:
        if base.block_nbytes != disk.block_nbytes:
            raise ValueError(f"disk blocks of {disk.block_nbytes} bytes for a pool of {base.block_nbytes}")
        self.base = base
        self.disk = disk
        self.block_nbytes = base.block_nbytes

    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        if src_tier != Tier.DISK and dst_tier != Tier.DISK:
            self.base.copy_blocks(src_tier, src_blocks, dst_tier, dst_blocks)
        elif dst_tier == Tier.DISK:
            self._write_disk(dst_blocks, self.base.read_blocks(src_tier, src_blocks))
        else:
            for slot, dst in zip(src_blocks, dst_blocks, strict=True):
                data = self.disk.read(slot)
                if data is not None:
                    self.base.write_blocks(dst_tier, [dst], [data])

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[Buffer]:
        if tier != Tier.DISK:
            return self.base.read_blocks(tier, blocks)
        out: list[Buffer] = []
        for start, n in contiguous_runs(blocks):
            parts = [self.disk.read(slot) for slot in range(start, start + n)]
            present = [p for p in parts if p is not None]
            if len(present) < n:
                raise MemPoolError(f"disk blocks {start}..{start + n - 1}: a file is missing or corrupt")
            out.append(b"".join(present))
        return out

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[Buffer]) -> None:
        if tier != Tier.DISK:
            self.base.write_blocks(tier, blocks, buffers)
        else:
            self._write_disk(blocks, buffers)

    def write_layer(self, tier: Tier, blocks: list[int], layer: int, buf: Buffer) -> None:
        """By-layer transfers land in memory tiers only: the runner's mover stores them."""
        base = self.base
        assert hasattr(base, "write_layer")  # the runner's mover (KVPools): BlockMover has no layers
        base.write_layer(tier, blocks, layer, buf)

    def _write_disk(self, slots: list[int], buffers: Sequence[Buffer]) -> None:
        for slot, piece in zip(slots, recut(buffers, [self.block_nbytes] * len(slots)), strict=True):
            self.disk.write(slot, piece)
