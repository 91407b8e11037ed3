"""The simulator's stand-in for the gateway predictor (sim/predictor.py): exact without
error, /CKA's fixed 10% padding, deterministic per request id, and padded by CacheOpt's
confidence-based padding, which shrinks as the arrival rate grows."""

from __future__ import annotations

from memserve.sim.predictor import NoisyOracle


def test_without_error_the_prediction_is_the_truth_and_fixed_padding_adds_ten_percent():
    assert NoisyOracle(0.0, 1.0)("r", 200) == 200  # no spread: Hoeffding pads nothing
    assert NoisyOracle(0.0, 1.0, padding="fixed")("r", 200) == 220


def test_predictions_are_seeded_by_request_id_and_their_padding_follows_the_arrival_rate():
    calm, busy = NoisyOracle(0.3, 0.05, seed=1), NoisyOracle(0.3, 3.0, seed=1)
    assert calm("a", 300) == calm("a", 300)
    assert len({busy(f"r{i}", 300) for i in range(50)}) > 10
    # Same raw predictions; at 0.05 req/s the confidence is 90%, at 3 req/s 8/301: the
    # padding differs for every request.
    spread = [abs(calm(f"r{i}", 300) - busy(f"r{i}", 300)) for i in range(50)]
    assert all(d > 0 for d in spread)
