"""Same-host KV transfers, the worker's side of ``ipc/same_host.py``: this worker's KV
pools described for its peers on the machine, and a peer's pools mapped here to copy
blocks out of. Only the handle differs between devices:

- CPU: each pool lives in a memfd (``KVPools.create``). A peer opens it as
  ``/proc/<pid>/fd/<fd>`` (same user, same pid namespace) and maps it. The memory lives
  while any process maps it, so a sender that dies mid-transfer leaves its pool readable,
  and nothing is left in /dev/shm after the last process.
- CUDA: the device pool's IPC handle (``torch.multiprocessing.reductions.reduce_tensor``),
  opened with ``rebuild_cuda_tensor`` on the local device of the same UUID: a peer that
  does not see that GPU maps nothing and gets frames. The pinned host tier is not shared.

Invariants: a mapped pool has this worker's layout, KV dtype (``--kv-cache-dtype``) and
block shape (``open`` refuses others, naming what differs), so a block copies as it is;
a copy out of a peer's pool runs on a copy stream after the compute enqueued before it
(the blocks it writes may still be read by a step in flight) and is complete on return,
since the receiver answers next and the sender may then reuse its blocks.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from memserve.ipc.same_host import KV_SAME_HOST_TRANSPORTS
from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.workers.copy_stream import CopyStream
from memserve.workers.kv_pools import KVPools


def shared_pools(pools: KVPools, transport: str) -> SharedKVPools | None:
    """What a transfer endpoint shares under ``--kv-same-host-transport`` (None: zmq)."""
    if transport not in KV_SAME_HOST_TRANSPORTS:
        raise ValueError(f"unknown same-host KV transport {transport!r}; expected one of {KV_SAME_HOST_TRANSPORTS}")
    return SharedKVPools(pools) if transport == "shm" else None


class SharedKVPools:
    """``SharedPools`` over one worker's ``KVPools``."""

    def __init__(self, pools: KVPools) -> None:
        self.pools = pools
        self.copies = CopyStream(pools.device.device)

    def describe(self) -> dict[str, Any]:
        tiers = []
        for tier, pool in self.pools.pools.items():
            if pool.is_cuda:
                tiers.append({"tier": int(tier), **_describe_cuda(pool)})
            elif tier in self.pools.shares:
                share = self.pools.shares[tier]
                tiers.append({"tier": int(tier), "kind": "memfd", "pid": os.getpid(), "fd": share.fd,
                              "name": share.name, "nbytes": share.nbytes, "shape": list(pool.shape),
                              "dtype": _dtype_name(pool.dtype)})
        if not tiers:
            raise RuntimeError("no KV pool of this worker is in memory a peer can map")
        return {"layout": self.pools.layout, "block_nbytes": self.pools.block_nbytes,
                "kv_dtype": _dtype_name(self.pools.dtype), "tiers": tiers}

    def open(self, description: dict[str, Any]) -> MappedPools:
        here = _dtype_name(self.pools.dtype)
        if description["kv_dtype"] != here:
            raise ValueError(f"the peer's KV cache holds {description['kv_dtype']}, this one {here}: the workers' "
                             f"--kv-cache-dtype (or --dtype) differ, and their blocks cannot be exchanged")
        if description["layout"] != self.pools.layout or description["block_nbytes"] != self.pools.block_nbytes:
            raise ValueError(f"the peer's blocks are {description['layout']}, {description['block_nbytes']} B; "
                             f"here {self.pools.layout}, {self.pools.block_nbytes} B")
        want = self._geometry(self.pools.device)
        mapped = {}
        for d in description["tiers"]:
            pool = _open_cuda(d) if d["kind"] == "cuda" else _open_memfd(d)
            if self._geometry(pool) != want:
                raise ValueError(f"the peer's {Tier(d['tier']).name.lower()} pool holds blocks of "
                                 f"{self._geometry(pool)}; here {want}")
            mapped[Tier(d["tier"])] = pool
        return MappedPools(self, mapped)

    def publish(self) -> None:
        device = self.pools.device.device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def _geometry(self, pool: torch.Tensor) -> tuple[torch.dtype, list[int]]:
        """A pool's dtype and shape, less the number of blocks."""
        shape = list(pool.shape)
        del shape[self.pools.block_dim]
        return pool.dtype, shape


class MappedPools:
    """A peer's pools mapped here (``MappedPeer``)."""

    def __init__(self, owner: SharedKVPools, pools: dict[Tier, torch.Tensor]) -> None:
        self.owner = owner
        self.pools = pools
        self.tiers = frozenset(int(t) for t in pools)

    def copy_in(self, src: list[int], dst: list[int], layer: int | None = None) -> None:
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destinations")
        groups: dict[tuple[Tier, Tier], tuple[list[int], list[int]]] = {}
        for s, d in zip(src, dst):
            src_tier, dst_tier = Tier(addr_tier(s)), Tier(addr_tier(d))
            if src_tier not in self.pools:
                raise ValueError(f"the peer's {src_tier.name.lower()} pool is not mapped here")
            src_blocks, dst_blocks = groups.setdefault((src_tier, dst_tier), ([], []))
            src_blocks.append(addr_block(s))
            dst_blocks.append(addr_block(d))
        local = self.owner.pools

        def copy() -> None:
            for (src_tier, dst_tier), (src_blocks, dst_blocks) in groups.items():
                local.copy_from(self.pools, src_tier, src_blocks, dst_tier, dst_blocks, layer)

        self.owner.copies.run_sync(copy)

    def close(self) -> None:
        self.pools = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gpu_uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _describe_cuda(pool: torch.Tensor) -> dict[str, Any]:
    """The pool's CUDA IPC handle and what ``rebuild_cuda_tensor`` needs besides, msgpack-able."""
    _, args = reduce_tensor(pool)
    (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _, ref_counter, ref_counter_offset,
     event, event_sync) = args
    return {"kind": "cuda", "uuid": _gpu_uuid(device), "shape": list(size), "stride": list(stride), "offset": offset,
            "dtype": _dtype_name(dtype), "handle": handle, "size_bytes": size_bytes, "offset_bytes": offset_bytes,
            "ref_counter": ref_counter, "ref_counter_offset": ref_counter_offset, "event": event,
            "event_sync": event_sync}


def _open_cuda(d: dict[str, Any]) -> torch.Tensor:
    """A peer's device pool, opened on the local device that is its GPU."""
    visible = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    device = next((i for i in visible if _gpu_uuid(i) == d["uuid"]), None)
    if device is None:
        raise ValueError(f"the peer's GPU {d['uuid']} is not visible here")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["shape"]), tuple(d["stride"]), d["offset"],
                               torch.storage.TypedStorage, getattr(torch, d["dtype"]), device, d["handle"],
                               d["size_bytes"], d["offset_bytes"], False, d["ref_counter"], d["ref_counter_offset"],
                               d["event"], d["event_sync"])


def _open_memfd(d: dict[str, Any]) -> torch.Tensor:
    """A peer's CPU pool, mapped from its memfd."""
    path = f"/proc/{d['pid']}/fd/{d['fd']}"
    if os.readlink(path) != f"/memfd:{d['name']} (deleted)" or os.stat(path).st_size < d["nbytes"]:
        raise ValueError(f"{path} is not the peer's pool")
    flat = torch.from_file(path, shared=True, size=d["nbytes"], dtype=torch.uint8)
    return flat.view(getattr(torch, d["dtype"])).view(d["shape"])
