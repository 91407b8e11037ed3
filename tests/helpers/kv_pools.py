"""Real KV pools for the transfer tests (``workers/kv_pools.py`` over a toy model shape),
with the test movers' ``fill`` and ``get``: what a worker's runner transfers, minus the model."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier, addr_block, addr_tier
from memserve.workers.kv_pools import KVPools

MODEL = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=8)


class TestPools(KVPools):
    """``KVPools`` whose blocks a test fills with seeded values and reads back as bytes."""

    __test__ = False  # not a test class

    def fill(self, tier: Tier, blocks: Sequence[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for b in blocks:
            block = self._blocks(self.pools[tier], b, 1)
            block.copy_(torch.randn(block.shape, generator=gen))

    def get(self, addrs: Sequence[int]) -> bytes:
        return b"".join(bytes(buf) for a in addrs for buf in self.read_blocks(Tier(addr_tier(a)), [addr_block(a)]))


def make_pools(num_blocks: dict[Tier, int], block_size: int, transport: str = "shm",
               layout: str = "aggregated") -> TestPools:
    """CPU pools of ``num_blocks`` per tier, in memfds when ``transport`` is shm."""
    cfg = EngineConfig(num_blocks=num_blocks[Tier.DEVICE], num_host_blocks=num_blocks.get(Tier.HOST, 0),
                       block_size=block_size, kv_layout=layout, kv_same_host_transport=transport)
    return TestPools.create(MODEL, cfg, torch.float32, torch.device("cpu"))
