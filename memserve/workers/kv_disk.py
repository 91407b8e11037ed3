"""The disk tier of a model runner: a ``DiskStore`` under ``--disk-cache-dir`` whose
fingerprint names everything that makes KV bytes reusable, so that files written by one
model, dtype, KV cache dtype or KV layout are never read by another (a restart with the
same ones, or an upgrade of memserve that keeps them, finds its blocks again). A KV cache
dtype other than the model's (``--kv-cache-dtype fp8``) is named on its own; with
``auto`` the fingerprint is what it was before the option existed."""

from __future__ import annotations

from pathlib import Path

import torch

from memserve.config import EngineConfig
from memserve.kvcache.disk_store import DiskStore, fingerprint
from memserve.workers.tensor_parallel_disk import GroupDiskStore, RankCalls

_SAMPLE_BYTES = 1 << 20  # of each weights file's head and tail, to tell fine-tunes apart


def weights_identity(model_dir: Path) -> list[bytes]:
    """config.json plus, per weights file, its name, size and first and last MiB."""
    parts = [(model_dir / "config.json").read_bytes()]
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_SAMPLE_BYTES)
            f.seek(max(0, size - _SAMPLE_BYTES))
            tail = f.read()
        parts += [path.name.encode(), str(size).encode(), head, tail]
    return parts


def open_disk_store(cfg: EngineConfig, model_dir: Path, dtype: torch.dtype, kv_dtype: torch.dtype,
                    block_nbytes: int, rank: int = 0, followers: RankCalls | None = None) -> DiskStore:
    """The disk tier of a model computing in ``dtype`` whose pools hold ``kv_dtype``
    (``block_nbytes``: a block's bytes on this rank). The ranks of a tensor-parallel worker
    share ``--disk-cache-gb`` and the fingerprint, each rank has a directory of its own;
    rank 0 is given the others (``followers``) and keeps them in step."""
    if cfg.disk_cache_dir is None:
        raise ValueError("no disk tier configured (--disk-cache-dir)")
    kv_cache = [str(kv_dtype)] if kv_dtype != dtype else []
    ranks = cfg.tensor_parallel_size
    split = [f"tensor-parallel {ranks}"] if ranks > 1 else []
    key = fingerprint(*weights_identity(model_dir), str(dtype), *kv_cache, cfg.kv_layout, str(cfg.block_size),
                      str(block_nbytes), *split)
    capacity, part = int(cfg.disk_cache_gb * 2**30) // ranks, f"r{rank}" if ranks > 1 else ""
    if followers is not None:
        return GroupDiskStore(followers, cfg.disk_cache_dir, capacity, block_nbytes, key, part)
    return DiskStore(cfg.disk_cache_dir, capacity, block_nbytes, key, part)
