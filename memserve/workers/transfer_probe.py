"""Worker-to-worker KV transfer time, measured the way workers transfer.

A receiver runs in its own process (as another worker would) with a real MemPool over
the same KV pool layout; this process sends through a ``KVTransferEndpoint`` over
``ipc://`` sockets in a private directory, on the same-host path the config names
(``kv_same_host_transport``): shm, the receiver copying the blocks out of this process's
pool, which it maps when the probe starts; zmq, the blocks as frames. Each timed transfer
is a full ``MemPool.transfer``: the remote allocation round trip, the data message (one
frame per run of blocks, or the blocks' addresses in place), the receiver's write into
its pool and its answer. The receiver is told to expect each ticket (as the gateway
does) before the clock starts."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from memserve.config import EngineConfig
from memserve.ipc.kv_transfer import KVTransferEndpoint
from memserve.kvcache.address import Tier
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.workers.kv_pools import KVPools
from memserve.workers.kv_share import shared_pools
from memserve.workers.model.dtype import resolve_dtype
from memserve.workers.model.model_config import ModelConfig

SENDER, RECEIVER = 0, 1
START_TIMEOUT_S = 120.0


def _endpoint(model_dir: str, cfg: EngineConfig, instance: int, bind: str) -> KVTransferEndpoint:
    """A transfer endpoint over a MemPool whose mover is a real KV pool of ``cfg``'s size."""
    import torch

    device = torch.device(cfg.rank_device(0))
    pools = KVPools.create(ModelConfig.from_folder(model_dir), cfg, resolve_dtype(cfg.dtype, device), device)
    pools.device.fill_(1)  # fault the pages in: untouched ones all read as one cached zero page
    pool = MemPool(instance, {Tier.DEVICE: pools.num_device_blocks}, cfg.block_size, mover=pools)
    return KVTransferEndpoint(pool, bind=bind, shared=shared_pools(pools, cfg.kv_same_host_transport))


def _receiver_main(conn: Any, model_dir: str, cfg: dict, bind: str) -> None:
    endpoint = _endpoint(model_dir, EngineConfig(**cfg), RECEIVER, bind)
    conn.send(endpoint.address)
    try:
        while True:
            endpoint.serve(timeout_ms=2)
            if conn.poll():
                cmd, *args = conn.recv()
                if cmd == "stop":
                    return
                endpoint.expect(*args)  # ("expect", ticket, src_instance, max_blocks)
                conn.send(None)
    finally:
        endpoint.close()


class TransferProbe:
    """A receiver process and a sender endpoint, kept for the whole profile (context manager)."""

    def __init__(self, model_dir: Path, cfg: EngineConfig, max_blocks: int, sync: Callable[[], None]) -> None:
        self.model_dir = model_dir
        self.cfg = EngineConfig(**{**vars(cfg), "num_blocks": max_blocks, "num_host_blocks": 0})
        self.sync = sync
        self._tickets = itertools.count()
        self.in_place = False  # set on entering: whether the receiver reads this pool in place

    def __enter__(self) -> "TransferProbe":
        self._runtime = tempfile.mkdtemp(prefix="memserve-profile-")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_receiver_main, daemon=True,
                                 args=(child, str(self.model_dir), vars(self.cfg), f"ipc://{self._runtime}/receiver"))
        self._proc.start()
        self.sender = _endpoint(str(self.model_dir), self.cfg, SENDER, f"ipc://{self._runtime}/sender")
        if not self._conn.poll(START_TIMEOUT_S):
            self.__exit__()
            raise RuntimeError("the transfer receiver process did not start")
        self.sender.connect(RECEIVER, self._conn.recv())
        self.in_place = bool(self.sender.same_host_tiers(RECEIVER))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop",))
            self._proc.join(10)
        self.sender.close()
        if self._proc.is_alive():
            self._proc.kill()
        shutil.rmtree(self._runtime, ignore_errors=True)

    @property
    def block_nbytes(self) -> int:
        mover = self.sender.pool.mover
        assert mover is not None  # _endpoint builds its pool over the runner's KV pools
        return mover.block_nbytes

    def measure(self, num_blocks: int) -> float:
        """Seconds to transfer ``num_blocks`` blocks to the receiver, which frees them."""
        pool = self.sender.pool
        src = pool.alloc_mem(num_blocks)
        try:
            ticket = f"profile-{next(self._tickets)}"
            self._conn.send(("expect", ticket, SENDER, num_blocks))
            self._conn.recv()
            start = time.perf_counter()
            pool.transfer(RECEIVER, src, flags=KVFlags.RELEASE, ticket=ticket)
            self.sync()
            return time.perf_counter() - start
        finally:
            pool.free_mem(src)
