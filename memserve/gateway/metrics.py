"""Prometheus metrics of one gateway app.

Each app owns its ``CollectorRegistry`` (several apps in one process, as in tests, do not
clash). Request-level metrics are recorded by the HTTP layer; worker gauges are read
from ``engine.stats()`` at scrape time so they are never stale."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from memserve.gateway.routing_metrics import RouterStatsCollector
from memserve.gateway.slo_metrics import SLOAttainment, SLOStatsCollector
from memserve.gateway.worker_metrics import WORKER_METRICS

log = logging.getLogger("memserve.gateway")

# generate_latest writes the classic text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's, so dashboards built for it read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Per-worker gauges from ``engine.stats()["workers"]``, labelled by instance id."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            workers = self._stats().get("workers", [])
        except Exception:
            log.exception("engine.stats() failed; worker metrics skipped in this scrape")
            return
        families = [(m, m.family(m.name, m.help, labels=list(m.labels))) for m in WORKER_METRICS]
        for worker in workers:
            instance = str(worker.get("instance_id"))
            for metric, family in families:
                for labels, value in metric.samples(instance, worker):
                    family.add_metric(labels, value)
        yield from (family for _, family in families)


class GatewayMetrics:
    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memserve_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("memserve_prompt_tokens", "Prompt tokens of generation requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("memserve_generation_tokens", "Tokens generated",
                                         registry=self.registry)
        self.ttft = Histogram("memserve_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("memserve_time_per_output_token_seconds", "Mean gap between output tokens of a request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("memserve_e2e_request_latency_seconds", "Arrival to last output token",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        # API requests by key id (gateway/auth.py; only with --api-key): never the key itself.
        self.requests_by_key = Counter("memserve_requests_by_key", "API requests by API key id (first 8 hex "
                                       "digits of the key's SHA-256)", ["key_id"], registry=self.registry)
        self.registry.register(EngineStatsCollector(engine_stats))
        self.registry.register(RouterStatsCollector(engine_stats))
        self.registry.register(SLOStatsCollector(engine_stats))
        self.slo = SLOAttainment(self.registry)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_key(self, key_id: str) -> None:
        self.requests_by_key.labels(key_id=key_id).inc()

    def observe_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_finished(self, ttft_s: float, e2e_s: float, num_output_tokens: int) -> None:
        self.e2e.observe(e2e_s)
        if num_output_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def observe_slo(self, slo: dict | None, ttft_s: float, max_gap_s: float) -> None:
        self.slo.observe(slo, ttft_s, max_gap_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
