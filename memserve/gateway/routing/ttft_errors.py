"""How far the cost model's predicted TTFT was from the real one, as plain counts the
router keeps (the simulator has no Prometheus; ``routing_metrics.py`` exports them)."""

from __future__ import annotations

import bisect

# (predicted - actual) / actual: negative means the model was optimistic.
RELATIVE_ERROR_BUCKETS = (-0.9, -0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


class TTFTErrors:
    """Predicted vs actual TTFT of routed requests."""

    def __init__(self) -> None:
        self.counts = [0] * (len(RELATIVE_ERROR_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.predicted_sum_s = 0.0
        self.actual_sum_s = 0.0
        self.error_sum = 0.0

    def add(self, predicted_s: float, actual_s: float) -> None:
        error = (predicted_s - actual_s) / max(actual_s, 1e-9)
        self.counts[bisect.bisect_left(RELATIVE_ERROR_BUCKETS, error)] += 1
        self.count += 1
        self.predicted_sum_s += predicted_s
        self.actual_sum_s += actual_s
        self.error_sum += error

    def to_dict(self) -> dict:
        return {"count": self.count, "predicted_sum_s": self.predicted_sum_s, "actual_sum_s": self.actual_sum_s,
                "relative_error_sum": self.error_sum, "relative_error_counts": list(self.counts)}
