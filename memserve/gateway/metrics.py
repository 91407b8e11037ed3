"""Prometheus metrics of one gateway app.

Each app owns its ``CollectorRegistry`` (several apps in one process, as in tests, do not
clash). Request-level metrics are recorded by the HTTP layer; worker gauges are read
from ``engine.stats()`` at scrape time so they are never stale."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from memserve.gateway.routing_metrics import RouterStatsCollector
from memserve.gateway.slo_metrics import SLOAttainment, SLOStatsCollector

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
        alive = GaugeMetricFamily("memserve_worker_alive", "1 if the worker process is alive", labels=["instance"])
        running = GaugeMetricFamily("memserve_num_requests_running", "Requests in the worker's running batch",
                                    labels=["instance"])
        waiting = GaugeMetricFamily("memserve_num_requests_waiting", "Requests queued at the worker",
                                    labels=["instance"])
        free_blocks = GaugeMetricFamily("memserve_free_blocks", "Free KV blocks per memory tier",
                                        labels=["instance", "tier"])
        cached_blocks = GaugeMetricFamily("memserve_kv_tier_cached_blocks",
                                          "KV blocks the worker's index holds per memory tier",
                                          labels=["instance", "tier"])
        hit_rate = GaugeMetricFamily("memserve_cache_hit_rate", "Fraction of prompt tokens served from the KV cache",
                                     labels=["instance"])
        cached = CounterMetricFamily("memserve_cached_tokens", "Prompt tokens served from the KV cache",
                                     labels=["instance"])
        held = CounterMetricFamily("memserve_shared_prefill_holds",
                                   "Requests admitted after waiting for a running prefill to compute blocks of "
                                   "their prompt (found cached instead of computed twice)", labels=["instance"])
        tier_labels = ["instance", "tier"]
        tier_bytes = GaugeMetricFamily("memserve_kv_tier_bytes_used", "Bytes of KV blocks allocated per tier",
                                       labels=tier_labels)
        tier_hits = CounterMetricFamily("memserve_kv_tier_hit_blocks", "Cached KV blocks matched per tier",
                                        labels=tier_labels)
        tier_read = CounterMetricFamily("memserve_kv_tier_read_bytes", "KV bytes read from each tier (loads, saves)",
                                        labels=tier_labels)
        tier_write = CounterMetricFamily("memserve_kv_tier_write_bytes", "KV bytes written to each tier",
                                         labels=tier_labels)
        tier_saving = GaugeMetricFamily("memserve_kv_tier_saving_blocks",
                                        "Cached blocks being saved down from each tier", labels=tier_labels)
        tier_dropped = CounterMetricFamily("memserve_kv_tier_dropped_unsaved_blocks",
                                           "Cached KV blocks dropped from each tier though a slower tier exists "
                                           "(its slower tiers were full of blocks in use)", labels=tier_labels)
        save_queue = GaugeMetricFamily("memserve_kv_save_queue", "KV save jobs not yet committed",
                                       labels=["instance"])
        tier_queue = GaugeMetricFamily("memserve_kv_tier_queue_depth",
                                       "KV blocks queued or in flight between each tier and another (saves, "
                                       "prefetches)", labels=tier_labels)
        prefetched = CounterMetricFamily("memserve_kv_prefetched_blocks",
                                         "KV blocks prefetched from disk to host for queued requests "
                                         "(--eviction-policy scheduler-aware)", labels=["instance"])
        prefetch_hits = CounterMetricFamily("memserve_kv_prefetch_hit_blocks",
                                            "Prefetched KV blocks a request then read from above the disk",
                                            labels=["instance"])
        reserve = GaugeMetricFamily("memserve_kv_reserve_blocks_in_use",
                                    "Global-reserve KV blocks lent to requests that outgrew their allocation "
                                    "(--schedule-policy cacheopt)", labels=["instance"])
        unheld = GaugeMetricFamily("memserve_kv_unheld_blocks",
                                   "KV blocks allocated to running requests beyond what they use: padding of the "
                                   "predicted length and over-allocation (--schedule-policy cacheopt)",
                                   labels=["instance"])
        role = GaugeMetricFamily("memserve_worker_role", "1 for the worker's role (colocated, prefill, decode)",
                                 labels=["instance", "role"])
        handoff = CounterMetricFamily("memserve_pd_handoff", "Disaggregated KV handoffs sent by a prefill worker: "
                                      "handoffs, blocks, bytes, messages", labels=["instance", "what"])
        pinned = GaugeMetricFamily("memserve_kv_pinned_blocks", "Cached KV blocks per tier that requests pinned "
                                   "with cache_control (at most --max-pinned-fraction of each tier)",
                                   labels=["instance", "tier"])
        drafts = CounterMetricFamily("memserve_spec_decode_num_draft_tokens",
                                     "Draft tokens proposed by n-gram speculative decoding (--speculative-config)",
                                     labels=["instance"])
        accepted = CounterMetricFamily("memserve_spec_decode_num_accepted_tokens",
                                       "Draft tokens the model agreed with (each one an output token without a step "
                                       "of its own)", labels=["instance"])
        for worker in workers:
            instance = str(worker.get("instance_id"))
            spec = worker.get("spec_decode", {})
            drafts.add_metric([instance], spec.get("draft_tokens", 0))
            accepted.add_metric([instance], spec.get("accepted_tokens", 0))
            for tier, count in worker.get("pinned_blocks", {}).items():
                pinned.add_metric([instance, tier], count)
            role.add_metric([instance, worker.get("role", "colocated")], 1.0)
            for what in ("handoffs", "blocks_sent", "bytes_sent", "messages"):
                handoff.add_metric([instance, what], worker.get("pd", {}).get(what, 0))
            alive.add_metric([instance], 1.0 if worker.get("alive") else 0.0)
            running.add_metric([instance], worker.get("num_running", 0))
            waiting.add_metric([instance], worker.get("num_waiting", 0))
            for tier, count in worker.get("free_blocks", {}).items():
                free_blocks.add_metric([instance, tier], count)
            for tier, count in worker.get("cached_blocks", {}).items():
                cached_blocks.add_metric([instance, tier], count)
            hit_rate.add_metric([instance], worker.get("cache_hit_rate", 0.0))
            cached.add_metric([instance], worker.get("cached_tokens_total", 0))
            held.add_metric([instance], worker.get("num_held_admissions", 0))
            for tier, io in worker.get("kv_tiers", {}).items():
                tier_bytes.add_metric([instance, tier], io["bytes_used"])
                tier_hits.add_metric([instance, tier], io["hits"])
                tier_read.add_metric([instance, tier], io["read_bytes"])
                tier_write.add_metric([instance, tier], io["write_bytes"])
                tier_saving.add_metric([instance, tier], io["saving"])
                tier_dropped.add_metric([instance, tier], io.get("dropped_unsaved", 0))
                tier_queue.add_metric([instance, tier], io.get("queue_depth", 0))
                if "prefetched" in io:
                    prefetched.add_metric([instance], io["prefetched"])
                    prefetch_hits.add_metric([instance], io["prefetch_hits"])
            save_queue.add_metric([instance], worker.get("kv_save_queue", 0))
            allocation = worker.get("kv_allocation", {})
            if allocation:
                reserve.add_metric([instance], allocation["reserve_in_use_blocks"])
                unheld.add_metric([instance], allocation["unheld_blocks"])
        yield from (alive, running, waiting, free_blocks, hit_rate, cached, held, tier_bytes, tier_hits, tier_read,
                    tier_write, tier_saving, tier_dropped, save_queue, tier_queue, prefetched, prefetch_hits, role, handoff,
                    reserve, unheld, cached_blocks, pinned, drafts, accepted)


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
