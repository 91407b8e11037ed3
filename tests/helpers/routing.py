"""Hand-built worker views, prompt-tree mirrors and an exact linear cost model for the router tests."""

from __future__ import annotations

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)
from memserve.gateway.routing.router import WorkerView
from memserve.ipc.messages import WorkerStats
from memserve.kvcache.events import STORED, KVEvent
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror

BS = 4  # tokens per block
PROMPT = list(range(100, 164))  # 64 tokens = 16 blocks


def mirror(i: int, *cached: list[int]) -> PromptTreeMirror:
    """The mirror of worker ``i`` after it cached the full blocks of each prompt."""
    m = PromptTreeMirror(i, BS)
    for tokens in cached:
        hashes = block_hashes(tokens, BS)
        known = m.index.known_prefix(hashes)
        if known < len(hashes):
            addrs = [(i << 40) + 1000 * len(m.entries()) + k for k in range(known, len(hashes))]
            m.apply_event(KVEvent(STORED, hashes[known:], hashes[known - 1] if known else None, addrs))
    return m


def view(i: int, state: str = "ok", in_flight: int = 0, cached: list[int] | None = None) -> WorkerView:
    return WorkerView(i, state, in_flight, WorkerStats(), mirror(i, cached) if cached else PromptTreeMirror(i, BS))


def linear_cost(transfer_bytes_per_s: float = 1.0, decode_per_step: float = 0.0,
                transfer_latency_s: float = 0.0) -> CostModel:
    """exec(x, y) = x * (1 - y) seconds; transfer of n bytes = latency + n / bandwidth (1
    byte per token); decode steps cost ``decode_per_step``: every figure below is exact."""
    return CostModel(CostKey("toy", "float32", "paper"), BS, kv_bytes_per_token=1,
                     operators={"gemm": OperatorCost(per_token=1.0)}, attention=AttentionCost(0, 0, 0, 0),
                     decode=DecodeCost(decode_per_step, 0.0, 0.0), copy=BandwidthCost(0.0, 1.0),
                     transfer=BandwidthCost(transfer_latency_s, transfer_bytes_per_s))
