"""MemPool test helpers: a numpy block mover, a fake clock, pools, prompts and workloads."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.kvcache.blocks import contiguous_runs
from memserve.kvcache.mempool import KVFlags, MemPool, OutOfBlocks

BS = 4


class NumpyBlockMover:
    """A BlockMover over numpy arrays, one ``[num_blocks, block_nbytes]`` array a tier:
    what the model runner does with its KV tensors, minus the model."""

    def __init__(self, num_blocks: dict[Tier, int], block_nbytes: int = 32) -> None:
        self.block_nbytes = block_nbytes
        self.stores = {Tier(t): np.zeros((n, block_nbytes), np.uint8) for t, n in num_blocks.items()}
        self.copies: list[tuple[Tier, list[int], Tier, list[int]]] = []

    def fill(self, tier: Tier, blocks: Sequence[int], seed: int) -> None:
        self.stores[tier][list(blocks)] = np.random.default_rng(seed).integers(0, 256, (len(blocks), self.block_nbytes))

    def get(self, addrs: Sequence[int]) -> bytes:
        return b"".join(self.stores[addr_tier(a)][addr_block(a)].tobytes() for a in addrs)

    def copy_blocks(self, src_tier, src_blocks, dst_tier, dst_blocks) -> None:
        self.copies.append((src_tier, list(src_blocks), dst_tier, list(dst_blocks)))
        self.stores[dst_tier][list(dst_blocks)] = self.stores[src_tier][list(src_blocks)]

    def read_blocks(self, tier, blocks) -> list[memoryview]:
        store = self.stores[tier]
        return [memoryview(store[start : start + n]).cast("B") for start, n in contiguous_runs(blocks)]

    def write_blocks(self, tier, blocks, buffers) -> None:
        for (start, n), buf in zip(contiguous_runs(blocks), buffers, strict=True):
            self.stores[tier][start : start + n] = np.frombuffer(buf, np.uint8).reshape(n, self.block_nbytes)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pool(device: int = 16, host: int = 0, disk: int = 0, instance: int = 0, **kw) -> MemPool:
    tiers = {Tier.DEVICE: device, Tier.HOST: host, Tier.DISK: disk}
    mover = NumpyBlockMover({t: n for t, n in tiers.items() if n}) if host or disk else None
    return MemPool(instance, tiers, BS, mover=kw.pop("mover", mover), **kw)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(blocks * BS)]


def cache(pool: MemPool, tokens: list[int]) -> list[int]:
    """Run a request to completion: allocate, insert, free; returns its addresses."""
    addrs = pool.alloc_mem(len(tokens) // BS)
    pool.insert(tokens, addrs, KVFlags.RELEASE)
    return addrs


def workload_prompts(seed: int) -> list[list[int]]:
    """30 prompts, many sharing one of 7 system prompts of one or two blocks."""
    rng = random.Random(seed)
    return [prompt(i % 7, 1) * rng.randrange(1, 3) + prompt(i, rng.randrange(1, 5)) for i in range(30)]


def random_workload(pool: MemPool, clock: Clock, seed: int, steps: int) -> Iterator[list[list[int]]]:
    """Requests that reuse, extend and drop cached prompts under memory pressure, with
    swaps and deletes; yields the running requests' addresses after every step."""
    rng = random.Random(seed)
    prompts = workload_prompts(seed)
    running: list[list[int]] = []
    for step in range(steps):
        clock.now = step
        op = rng.random()
        if op < 0.5:
            tokens = rng.choice(prompts)
            hit = pool.match(tokens)
            fast = [a for a in hit if addr_tier(a) == Tier.DEVICE]
            slow = hit[len(fast) :]  # a cached prefix reads device blocks first
            need = len(tokens) // BS - len(fast)
            if pool.can_alloc(need):
                device = pool.swap_in(slow) if slow else []
                blocks = fast + device + pool.alloc_mem(need - len(slow))
                pool.free_mem(slow)
                pool.insert(tokens, blocks)
                running.append(blocks)
            else:
                with pytest.raises(OutOfBlocks):
                    pool.alloc_mem(need)
                pool.free_mem(hit)
        elif op < 0.85 and running:
            pool.free_mem(running.pop(rng.randrange(len(running))))
        elif op < 0.95:
            pool.swap_out(rng.randrange(1, 6))
        else:
            pool.delete(rng.choice(prompts))
        yield running
    for blocks in running:
        pool.free_mem(blocks)


def assert_accounting(pool: MemPool, running: list[list[int]]) -> None:
    """Each allocated block is indexed or held by a running request, and nothing else."""
    indexed = {n.addr for n in pool.index.nodes()}
    held = {a for r in running for a in r}
    stats = pool.stats()
    allocated = sum(stats[t]["total"] - stats[t]["free"] for t in ("device", "host", "disk"))
    assert allocated == len(indexed | held)
    for node in pool.index.nodes():  # children never sit in a faster tier
        assert node.parent is pool.index.root or node.parent.tier <= node.tier
