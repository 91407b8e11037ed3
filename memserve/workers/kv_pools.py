"""The KV tensors of one worker, one pool per tier, and the block mover the MemPool uses
to copy blocks between tiers and to read/write them for transfers.

Aggregated layout (default): ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``
so a run of consecutive blocks is one contiguous buffer. Layer-major layout
``[num_layers, 2, num_blocks, ...]`` is kept for comparison (MemServe Figs. 11-12)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import contiguous_runs
from memserve.workers.model.attention import allocate_kv_cache, layer_kv


@dataclass
class KVPools:
    pools: dict[Tier, torch.Tensor]
    layout: str
    block_nbytes: int  # one block: every layer's K and V for block_size tokens
    num_device_blocks: int  # the device blocks the MemPool hands out: 0 .. num_device_blocks - 1
    scratch_block: int | None = None  # a device block past those, written by CUDA graphs' padding rows

    @classmethod
    def create(cls, model_config, cfg: EngineConfig, dtype: torch.dtype, device: torch.device,
               scratch_block: bool = False) -> "KVPools":
        shape = (model_config.num_layers, cfg.block_size, model_config.num_kv_heads, model_config.head_dim)
        block_bytes = 2 * shape[0] * shape[1] * shape[2] * shape[3] * torch.finfo(dtype).bits // 8
        num_blocks = cfg.num_blocks or max(1, int(cfg.kv_cache_gb * 2**30) // block_bytes)

        def pool(n: int, dev: torch.device) -> torch.Tensor:
            return allocate_kv_cache(n, shape[0], cfg.block_size, shape[2], shape[3], dtype, dev, cfg.kv_layout)

        pools = {Tier.DEVICE: pool(num_blocks + int(scratch_block), device)}
        if cfg.num_host_blocks:
            host = pool(cfg.num_host_blocks, torch.device("cpu"))
            pools[Tier.HOST] = host.pin_memory() if device.type == "cuda" else host
        return cls(pools, cfg.kv_layout, block_bytes, num_blocks, num_blocks if scratch_block else None)

    @property
    def device(self) -> torch.Tensor:
        return self.pools[Tier.DEVICE]

    def _blocks(self, pool: torch.Tensor, start: int, length: int) -> torch.Tensor:
        if self.layout == "aggregated":
            return pool[start : start + length]
        return pool[:, :, start : start + length]

    # ----------------------------------------------------------- BlockMover
    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        self._copy(self.pools[src_tier], src_blocks, self.pools[dst_tier], dst_blocks,
                   0 if self.layout == "aggregated" else 2)

    def copy_layer(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int],
                   layer: int) -> None:
        """``copy_blocks`` of one layer's K and V only (layer-wise preloading)."""
        src, dst = self.pools[src_tier], self.pools[dst_tier]
        if self.layout == "aggregated":
            self._copy(src[:, layer], src_blocks, dst[:, layer], dst_blocks, 0)
        else:
            self._copy(src[layer], src_blocks, dst[layer], dst_blocks, 1)

    @staticmethod
    def _copy(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int], dim: int) -> None:
        src_idx = torch.tensor(src_blocks, device=src.device)
        dst_idx = torch.tensor(dst_blocks, device=dst.device)
        # Into host memory the copy must be complete on return (a save frees its source
        # next, and a CUDA->CPU non_blocking copy would still be in flight); copies to the
        # device stay asynchronous, in stream order.
        moved = src.index_select(dim, src_idx).to(dst.device, non_blocking=dst.device.type != "cpu")
        dst.index_copy_(dim, dst_idx, moved)

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[memoryview]:
        """One host buffer per contiguous run of blocks (zero-copy on CPU, aggregated)."""
        pool = self.pools[tier]
        out = []
        for start, length in contiguous_runs(blocks):
            t = self._blocks(pool, start, length).contiguous().cpu()
            out.append(memoryview(t.view(torch.uint8).numpy()).cast("B"))
        return out

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[bytes | memoryview]) -> None:
        pool = self.pools[tier]
        for (start, length), buf in zip(contiguous_runs(blocks), buffers, strict=True):
            dst = self._blocks(pool, start, length)
            src = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=pool.dtype)
            dst.copy_(src.view(dst.shape).to(dst.device))

    # ------------------------------------------------------- by-layer transfer
    def read_layer(self, blocks: list[int], layer: int) -> memoryview:
        """A host copy of layer ``layer``'s K and V of device ``blocks``, as
        ``[len(blocks), 2, block_size, kv_heads, head_dim]`` in either layout (by-layer
        transfer: a copy, so the step may reuse the blocks before it is sent)."""
        k, v = layer_kv(self.device, layer, self.layout)
        idx = torch.tensor(blocks, device=self.device.device)
        t = torch.stack((k.index_select(0, idx), v.index_select(0, idx)), dim=1).cpu()
        return memoryview(t.view(torch.uint8).numpy()).cast("B")

    def write_layer(self, tier: Tier, blocks: list[int], layer: int, buf: bytes | memoryview) -> None:
        """Store what ``read_layer`` produced into ``blocks`` of ``tier``."""
        pool = self.pools[tier]
        k, v = layer_kv(pool, layer, self.layout)
        data = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=pool.dtype)
        data = data.view(len(blocks), 2, *k.shape[1:]).to(pool.device)
        idx = torch.tensor(blocks, device=pool.device)
        k.index_copy_(0, idx, data[:, 0])
        v.index_copy_(0, idx, data[:, 1])
