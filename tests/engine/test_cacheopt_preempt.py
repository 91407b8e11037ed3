"""CacheOpt's preemption choices against hand-computed values: the victim order in
magnitude bands (workers/engine/policies/cacheopt/preempt.py) and the swap/recompute sweet spot
L_r(S) = L_s(S) (workers/engine/policies/cacheopt/sweetspot.py)."""

from __future__ import annotations

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)
from memserve.ipc.messages import SamplingParams
from memserve.workers.engine.policies.cacheopt.preempt import (
    pick_victim,
    victim_order_key,
)
from memserve.workers.engine.policies.cacheopt.sweetspot import (
    recompute_s,
    swap_s,
    sweet_spot,
)
from memserve.workers.engine.sequence import Sequence


def seq(rid: str, predicted: int, outputs: int = 0, arrival: float = 0.0) -> Sequence:
    s = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=1000), arrival, predicted_output_tokens=predicted)
    s.output_token_ids = [7] * outputs
    return s


def test_order_is_loose_tbt_then_long_remaining_then_small_kv_in_bands():
    # TBT bands (ms): <50 | 50-200 | 200-500 | 500-2000 | beyond; tokens in bands of 128.
    assert victim_order_key(seq("a", 300, 10), 100.0, 500) == (-1, -2, 3)  # 290 left, 500 tokens of KV
    tight, loose_short, loose_long, loose_long_big = (seq("t", 900), seq("s", 100), seq("l", 300), seq("b", 300))
    running = [tight, loose_short, loose_long, loose_long_big]
    slos = [100.0, 300.0, 300.0, 400.0]  # 300 and 400 ms share a band
    kv = [10, 10, 300, 100]
    # Loose SLO beats a long remaining time; among the loose, 300 left (band 2) beats 100
    # (band 0); of those, 100 tokens of KV (band 0) beat 300 (band 2).
    assert pick_victim(running, slos, kv) is loose_long_big
    assert pick_victim(running[:3], slos[:3], kv[:3]) is loose_long
    assert pick_victim([tight], [100.0], [10]) is tight


def test_equals_in_every_band_preempt_the_latest_arrival():
    early, late = seq("e", 200, arrival=1.0), seq("l", 210, arrival=2.0)
    assert pick_victim([late, early], [300.0, 310.0], [20, 30]) is late


def cost(per_token: float, b: float, latency: float, bytes_per_s: float) -> CostModel:
    return CostModel(CostKey("m", "float16", "hw"), 16, 1000, {"linear": OperatorCost(per_token=per_token)},
                     AttentionCost(0.0, b, 0.0, 0.0), DecodeCost(0.0, 0.0, 0.0), BandwidthCost(latency, bytes_per_s),
                     BandwidthCost(0.0, 1e12))


def test_the_sweet_spot_solves_recompute_equals_swap():
    # L_r(S) = 1e-4 S + 1e-8 S²; L_s(S) = 2 (1e-3 + 1000 S / 1e7) = 2e-3 + 2e-4 S.
    # 1e-8 S² - 1e-4 S - 2e-3 = 0  ->  S = (1e-4 + sqrt(1e-8 + 8e-11)) / 2e-8 = 10019.96.
    c = cost(1e-4, 1e-8, 1e-3, 1e7)
    assert abs(recompute_s(c, 10_000) - 2.0) < 1e-12 and abs(swap_s(c, 10_000) - 2.002) < 1e-12
    assert sweet_spot(c, 1 << 17) == 10_020
    assert recompute_s(c, 10_019) < swap_s(c, 10_019) and recompute_s(c, 10_020) >= swap_s(c, 10_020)


def test_no_sweet_spot_when_recompute_always_wins_and_one_when_swap_always_does():
    assert sweet_spot(cost(1e-4, 1e-8, 1e-3, 1e7), 5000) is None  # crossing past the context window
    assert sweet_spot(cost(1e-3, 0.0, 1e-6, 1e12), 5000) == 1  # copying is nearly free
