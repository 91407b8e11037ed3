"""This process's place in its tensor-parallel group, and the group's two collectives.

A tensor-parallel worker is N rank processes (``--tensor-parallel-size N``) joined by
``torch.distributed`` (gloo on the CPU, NCCL on CUDA). Each holds a shard of every
weight (``linear.py``) and its heads' share of every KV block; a layer's row-parallel
product sums its partial results over the group (``all_reduce``), and the logits of
the vocabulary's shards are joined (``all_gather``). ``SINGLE`` is the group of one:
its collectives return their input, so a one-rank model runs exactly as before.

The time spent in collectives is summed (``comm_seconds``): the worker reports it per
step, the price of the split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    comm_seconds: float = field(default=0.0, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group, in place."""
        if self.size == 1:
            return x
        started = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.comm_seconds += time.perf_counter() - started
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` [..., n] side by side along the last dimension: [..., size * n]."""
        if self.size == 1:
            return x
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.comm_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def split_evenly(total: int, size: int, what: str) -> int:
    """``total`` / ``size``, refused where it does not divide (heads, widths)."""
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by --tensor-parallel-size ({size})")
    return total // size


def kv_heads_per_rank(num_kv_heads: int, size: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks that hold each): the KV heads are split across the
    ranks where there are at least as many; where there are fewer, each is replicated on
    ``size / num_kv_heads`` ranks (vLLM's rule), so every rank's query heads have theirs."""
    if num_kv_heads >= size:
        return split_evenly(num_kv_heads, size, "the number of KV heads"), 1
    if size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size ({size}) is neither a divisor nor a multiple of "
                         f"the number of KV heads ({num_kv_heads})")
    return 1, size // num_kv_heads
