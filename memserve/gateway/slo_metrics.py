"""SLO metrics on /metrics (CacheOpt §5's measures, taken in the gateway):

- ``memserve_slo_requests_total{slo, outcome}``: finished requests that carried a TTFT
  or TBT SLO, by whether they met it (attainment = met / (met + missed)). TTFT is HTTP
  arrival to the first token; TBT is met when *every* gap between two outputs carrying
  tokens was within the SLO, as CacheOpt counts it.
- ``memserve_admission_*``: requests refused by admission control (by reason), admitted
  (directly or after being held) and held now (``admission.Admission``).
- ``memserve_preemptions_total{instance, kind}``: from each worker's heartbeat stats,
  ``"preemptions": {kind: count}`` (swap, recompute).
- ``memserve_predictor_*``: the output-length predictor's counts, mean absolute error,
  measured arrival rate and padding confidence (``engine.stats()["predictor"]``, when on).

Engine-side figures are read from ``engine.stats()`` at scrape time, like the router's."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("memserve.gateway")


class SLOAttainment:
    """Per finished request, whether it met the SLOs it carried."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("memserve_slo_requests", "Finished requests with an SLO, by SLO (ttft, tbt) and "
                                "outcome (met, missed)", ["slo", "outcome"], registry=registry)
        for slo in ("ttft", "tbt"):  # exported from the start, so a rate() has its zero
            for outcome in ("met", "missed"):
                self.requests.labels(slo=slo, outcome=outcome)

    def observe(self, slo: dict | None, ttft_s: float, max_gap_s: float) -> None:
        """``max_gap_s``: the longest wait between two outputs with tokens (0 for one)."""
        if not slo:
            return
        for name, measured_s in (("ttft", ttft_s), ("tbt", max_gap_s)):
            limit_ms = slo.get(f"{name}_ms")
            if limit_ms is not None:
                outcome = "met" if measured_s * 1000.0 <= limit_ms else "missed"
                self.requests.labels(slo=name, outcome=outcome).inc()


class SLOStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:
            log.exception("engine.stats() failed; SLO metrics skipped in this scrape")
            return
        admission = stats.get("admission")
        if admission:
            rejected = CounterMetricFamily("memserve_admission_rejections", "Requests refused by admission "
                                           "control (429), by reason", labels=["reason"])
            for reason, n in admission["rejected"].items():
                rejected.add_metric([reason], n)
            admitted = CounterMetricFamily("memserve_admission_admitted", "Requests with a TTFT SLO admitted, "
                                           "directly or after being held", labels=["path"])
            for path, n in admission["admitted"].items():
                admitted.add_metric([path], n)
            held = GaugeMetricFamily("memserve_admission_queue_depth", "Requests held by --admission queue now")
            held.add_metric([], admission["held"])
            capacity = GaugeMetricFamily("memserve_admission_queue_capacity", "Requests --admission queue holds "
                                         "at most")
            capacity.add_metric([], admission["max_held"])
            yield from (rejected, admitted, held, capacity)
        preemptions = CounterMetricFamily("memserve_preemptions", "Requests preempted in a worker, by kind "
                                          "(swap, recompute)", labels=["instance", "kind"])
        for worker in stats.get("workers", []):
            for kind, n in worker.get("preemptions", {}).items():
                preemptions.add_metric([str(worker.get("instance_id")), kind], n)
        yield preemptions
        predictor = stats.get("predictor")
        if predictor:
            yield from _predictor_metrics(predictor)


def _predictor_metrics(predictor: dict) -> Iterator[Metric]:
    """From ``memserve.predictor.Predictor.stats()``."""
    for key, name, doc in (("predictions", "memserve_predictor_predictions", "Output lengths predicted"),
                           ("observed", "memserve_predictor_observed", "Finished requests learned from"),
                           ("refits", "memserve_predictor_refits", "Online refits of the length model")):
        counter = CounterMetricFamily(name, doc)
        counter.add_metric([], predictor[key])
        yield counter
    for key, name, doc in (("mean_abs_error", "memserve_predictor_mean_abs_error_tokens",
                            "Mean |predicted - actual| output tokens of the finished requests it predicted"),
                           ("arrival_rate", "memserve_predictor_arrival_rate", "Measured arrival rate (1/s)"),
                           ("confidence", "memserve_predictor_padding_confidence",
                            "Hoeffding padding confidence c = alpha / (1 + beta * rate)")):
        if predictor.get(key) is not None:
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], predictor[key])
            yield gauge
