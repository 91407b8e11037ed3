"""The KV tensors of one worker, one pool per tier, and the block mover the MemPool uses
to copy blocks between tiers and to read/write them for transfers.

Aggregated layout (default): ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``
so a run of consecutive blocks is one contiguous buffer. Layer-major layout
``[num_layers, 2, num_blocks, ...]`` is kept for comparison (MemServe Figs. 11-12).

With ``--kv-same-host-transport shm`` a CPU worker's pools live in memfds (``shares``),
which same-host peers map to copy blocks out of (``kv_share.py``); each memfd stays open
as long as its ``KVPools``, and its pages are reserved when it is made, as ``torch.zeros``
touches them.

The pools' element type is ``--kv-cache-dtype``'s (``kv_cache_dtype``): the model's dtype,
or float8_e4m3fn, which attention quantizes K and V into as it writes them and widens
as it reads them (``model/attention.py``). Every tier holds the same element type, and
everything here (tier moves, reads and writes for transfers and the disk, by-layer
transfers) copies blocks as bytes, never converting them: an FP8 block leaves and
returns bit for bit."""

from __future__ import annotations

import logging
import math
import os
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import contiguous_runs, paired_runs
from memserve.kvcache.mover import Buffer
from memserve.workers.model.attention import allocate_kv_cache, kv_cache_shape, layer_kv

log = logging.getLogger("memserve.worker")

# --kv-cache-dtype's FP8 names (vLLM's): both are e4m3 (fp8_e5m2 is not offered).
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' element type for ``--kv-cache-dtype name``: auto keeps the model's."""
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported: auto, or fp8 / fp8_e4m3 (float8_e4m3fn); "
                         "vLLM's fp8_e5m2 is not offered")
    return FP8_KV_CACHE_DTYPES[name]


@dataclass(frozen=True)
class HostShare:
    """The memfd a CPU pool lives in: a peer opens it as ``/proc/<pid>/fd/<fd>`` and checks
    the name (a reused fd number is never mapped)."""

    fd: int
    name: str
    nbytes: int


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, HostShare]:
    """A zeroed CPU tensor in a memfd of its own; raises (OSError, or RuntimeError from
    torch) where none can be made."""
    nbytes = math.prod(shape) * dtype.itemsize
    name = f"memserve-kv-{secrets.token_hex(8)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    return flat.view(dtype).view(shape), HostShare(fd, name, nbytes)


@dataclass
class KVPools:
    pools: dict[Tier, torch.Tensor]
    layout: str
    block_nbytes: int  # one block: every layer's K and V for block_size tokens
    num_device_blocks: int  # the device blocks the MemPool hands out: 0 .. num_device_blocks - 1
    scratch_block: int | None = None  # a device block past those, written by CUDA graphs' padding rows
    shares: dict[Tier, HostShare] = field(default_factory=dict)  # the CPU pools that live in memfds

    def __post_init__(self) -> None:
        for share in self.shares.values():
            weakref.finalize(self, os.close, share.fd)

    @classmethod
    def create(cls, model_config, cfg: EngineConfig, model_dtype: torch.dtype, device: torch.device,
               scratch_block: bool = False) -> "KVPools":
        """Pools of ``cfg.kv_cache_dtype`` for a model computing in ``model_dtype``."""
        dtype = kv_cache_dtype(cfg.kv_cache_dtype, model_dtype)
        shape = (model_config.num_layers, cfg.block_size, model_config.num_kv_heads, model_config.head_dim)
        block_bytes = 2 * shape[0] * shape[1] * shape[2] * shape[3] * dtype.itemsize
        num_blocks = cfg.num_blocks or max(1, int(cfg.kv_cache_gb * 2**30) // block_bytes)

        shares: dict[Tier, HostShare] = {}
        # CPU workers' pools go in memfds for same-host peers; a CUDA worker shares its
        # device pool by IPC handle, and its host tier is pinned memory of its own.
        share = cfg.kv_same_host_transport == "shm" and device.type == "cpu"

        def pool(tier: Tier, n: int, dev: torch.device) -> torch.Tensor:
            if share:
                try:
                    t, shares[tier] = shared_zeros(
                        kv_cache_shape(n, shape[0], cfg.block_size, shape[2], shape[3], cfg.kv_layout), dtype)
                    return t
                except (OSError, RuntimeError) as exc:  # no memfd, or /proc cannot reopen it
                    log.warning("the %s KV pool is private (%s): same-host peers get its blocks as frames",
                                tier.name.lower(), exc)
            return allocate_kv_cache(n, shape[0], cfg.block_size, shape[2], shape[3], dtype, dev, cfg.kv_layout)

        pools = {Tier.DEVICE: pool(Tier.DEVICE, num_blocks + int(scratch_block), device)}
        if cfg.num_host_blocks:
            host = pool(Tier.HOST, cfg.num_host_blocks, torch.device("cpu"))
            pools[Tier.HOST] = host.pin_memory() if device.type == "cuda" else host
        return cls(pools, cfg.kv_layout, block_bytes, num_blocks, num_blocks if scratch_block else None, shares)

    @property
    def device(self) -> torch.Tensor:
        return self.pools[Tier.DEVICE]

    @property
    def dtype(self) -> torch.dtype:
        """The element type of every tier's pool (``--kv-cache-dtype``)."""
        return self.device.dtype

    @property
    def block_dim(self) -> int:
        """The pools' dimension that indexes blocks."""
        return 0 if self.layout == "aggregated" else 2

    def _blocks(self, pool: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return pool.narrow(self.block_dim, start, length)

    # ----------------------------------------------------------- BlockMover
    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        self.copy_from(self.pools, src_tier, src_blocks, dst_tier, dst_blocks)

    def copy_layer(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int],
                   layer: int) -> None:
        """``copy_blocks`` of one layer's K and V only (layer-wise preloading)."""
        self.copy_from(self.pools, src_tier, src_blocks, dst_tier, dst_blocks, layer)

    def copy_from(self, src_pools: dict[Tier, torch.Tensor], src_tier: Tier, src_blocks: list[int], dst_tier: Tier,
                  dst_blocks: list[int], layer: int | None = None) -> None:
        """Copy blocks of ``src_pools`` (these pools, or a same-host peer's of this layout)
        into these: every layer, or only ``layer``'s K and V."""
        src, dst = src_pools[src_tier], self.pools[dst_tier]
        if layer is None:
            self._copy(src, src_blocks, dst, dst_blocks, self.block_dim)
        elif self.layout == "aggregated":
            self._copy(src[:, layer], src_blocks, dst[:, layer], dst_blocks, 0)
        else:
            self._copy(src[layer], src_blocks, dst[layer], dst_blocks, 1)

    @staticmethod
    def _copy(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int], dim: int) -> None:
        if src.device.type == dst.device.type == "cpu":
            # A CPU gather (index_select) of whole blocks runs at a few hundred MB/s; a slice
            # per run of blocks consecutive at both ends copies as fast as memcpy.
            for s, d, n in paired_runs(src_blocks, dst_blocks):
                dst.narrow(dim, d, n).copy_(src.narrow(dim, s, n))
            return
        src_idx = torch.tensor(src_blocks, device=src.device)
        dst_idx = torch.tensor(dst_blocks, device=dst.device)
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)  # bytes: index_copy_ knows no FP8
        # Into host memory the copy must be complete on return (a save frees its source
        # next, and a CUDA->CPU non_blocking copy would still be in flight); copies to the
        # device stay asynchronous, in stream order.
        moved = src.index_select(dim, src_idx).to(dst.device, non_blocking=dst.device.type != "cpu")
        dst.index_copy_(dim, dst_idx, moved)

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[Buffer]:
        """One host buffer per contiguous run of blocks, block after block (each block's
        bytes whole, whatever the layout: the disk tier cuts a run into one file per
        block); zero-copy on CPU in the aggregated layout."""
        pool = self.pools[tier]
        out: list[Buffer] = []
        for start, length in contiguous_runs(blocks):
            t = self._blocks(pool, start, length).movedim(self.block_dim, 0).contiguous().cpu()
            out.append(t.view(torch.uint8).numpy().data.cast("B"))
        return out

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[Buffer]) -> None:
        """Store buffers laid out as ``read_blocks`` gives them."""
        pool = self.pools[tier]
        for (start, length), buf in zip(contiguous_runs(blocks), buffers, strict=True):
            dst = self._blocks(pool, start, length).movedim(self.block_dim, 0)
            src = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=pool.dtype)
            dst.copy_(src.view(dst.shape).to(dst.device))

    # ------------------------------------------------------- by-layer transfer
    def read_layer(self, blocks: list[int], layer: int,
                   gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> memoryview:
        """A host copy of layer ``layer``'s K and V of device ``blocks``, as
        ``[len(blocks), 2, block_size, kv_heads, head_dim]`` in either layout (by-layer
        transfer: a copy, so the step may reuse the blocks before it is sent), as bytes.
        ``gather``: what makes of these bytes (``layer_bytes``) the ones sent (every rank's
        part, rank by rank, in a tensor-parallel worker)."""
        t = self.layer_bytes(blocks, layer)
        return (gather(t) if gather is not None else t).cpu().numpy().data.cast("B")

    def layer_bytes(self, blocks: list[int], layer: int) -> torch.Tensor:
        """Layer ``layer``'s K and V of device ``blocks`` as ``read_layer`` lays them out,
        flat uint8 on the device."""
        k, v = layer_kv(self.device.view(torch.uint8), layer, self.layout)
        idx = torch.tensor(blocks, device=self.device.device)
        return torch.stack((k.index_select(0, idx), v.index_select(0, idx)), dim=1).reshape(-1)

    def write_layer(self, tier: Tier, blocks: list[int], layer: int, buf: bytes | memoryview) -> None:
        """Store what ``read_layer`` produced into ``blocks`` of ``tier``, as bytes
        (index_copy_ knows no FP8); raises ValueError for a sender's blocks of another size."""
        pool = self.pools[tier].view(torch.uint8)
        k, v = layer_kv(pool, layer, self.layout)
        want = len(blocks) * 2 * math.prod(k.shape[1:])
        if memoryview(buf).nbytes != want:
            raise ValueError(f"one layer of {len(blocks)} blocks came as {memoryview(buf).nbytes} B, {want} B here "
                             f"({self.dtype} KV): the workers differ in model, --dtype or --kv-cache-dtype")
        data = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=torch.uint8)
        data = data.view(len(blocks), 2, *k.shape[1:]).to(pool.device)
        idx = torch.tensor(blocks, device=pool.device)
        k.index_copy_(0, idx, data[:, 0])
        v.index_copy_(0, idx, data[:, 1])
