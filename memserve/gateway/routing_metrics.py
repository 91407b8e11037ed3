"""What the router exports on /metrics: decisions by policy and reason, prefix pulls by
outcome, decisions that counted a prompt still being prefilled as cached, and how far
the cost model's predicted TTFT was from the real one (a histogram of the signed
relative error plus both sums), so its error is visible in production.
The router keeps plain counts (the simulator has no Prometheus); the collector reads
them from ``engine.stats()["router"]`` at scrape time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from memserve.gateway.routing.ttft_errors import RELATIVE_ERROR_BUCKETS

log = logging.getLogger("memserve.gateway")

class RouterStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            router = self._stats().get("router")
        except Exception:
            log.exception("engine.stats() failed; router metrics skipped in this scrape")
            return
        if not router:
            return
        decisions = CounterMetricFamily("memserve_router_decisions", "Routing decisions by policy and reason",
                                        labels=["policy", "reason"])
        for reason, n in router["decisions"].items():
            decisions.add_metric([router["policy"], reason], n)
        routed = CounterMetricFamily("memserve_router_routed_requests", "Requests routed to each worker",
                                     labels=["instance"])
        for instance, n in router["routed"].items():
            routed.add_metric([str(instance)], n)
        pulls = CounterMetricFamily("memserve_router_prefix_pulls", "Cached prefixes pulled between workers before "
                                    "a request (MemServe eq. 2), by outcome", labels=["outcome"])
        for outcome, n in router["pulls"].items():
            pulls.add_metric([outcome], n)
        pending = CounterMetricFamily("memserve_router_pending_prefix_hits", "Routing decisions that counted a "
                                      "prompt routed to the chosen worker and not yet in its KV events as cached")
        pending.add_metric([], router["pending_hits"])
        ttft = router["ttft_prediction"]
        cumulative, buckets = 0, []
        for bound, n in zip([*RELATIVE_ERROR_BUCKETS, float("inf")], ttft["relative_error_counts"]):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        error = HistogramMetricFamily("memserve_router_ttft_relative_error",
                                      "(predicted - actual) / actual TTFT of routed requests",
                                      buckets=buckets, sum_value=ttft["relative_error_sum"])
        predicted = CounterMetricFamily("memserve_router_ttft_predicted_seconds",
                                        "Sum of the cost model's predicted TTFTs (divide by the histogram's count)")
        predicted.add_metric([], ttft["predicted_sum_s"])
        actual = CounterMetricFamily("memserve_router_ttft_actual_seconds",
                                     "Sum of the measured TTFTs of the same requests")
        actual.add_metric([], ttft["actual_sum_s"])
        yield from (decisions, routed, pulls, pending, error, predicted, actual)
