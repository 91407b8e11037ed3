"""The per-worker Prometheus families, declared once each: name, help, labels and how a
worker's ``/v1/stats`` entry gives its samples.

``EngineStatsCollector`` (``metrics.py``) builds every family at each scrape and feeds
it from each worker's entry of ``engine.stats()["workers"]``, in this order, so the
exposition lists the families as declared here. Adding a metric is one entry."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Samples = Iterable[tuple[list[str], float]]
Worker = dict[str, Any]


@dataclass(frozen=True)
class WorkerMetric:
    family: type[GaugeMetricFamily] | type[CounterMetricFamily]
    name: str
    help: str
    labels: tuple[str, ...]
    samples: Callable[[str, Worker], Samples]  # (instance, entry) -> (label values, value)


def _scalar(key: str, default: float = 0) -> Callable[[str, Worker], Samples]:
    return lambda instance, w: [([instance], w.get(key, default))]


def _per_tier(key: str) -> Callable[[str, Worker], Samples]:
    return lambda instance, w: [([instance, tier], count) for tier, count in w.get(key, {}).items()]


def _tier_io(field: str) -> Callable[[str, Worker], Samples]:
    return lambda instance, w: [([instance, tier], io.get(field, 0)) for tier, io in w.get("kv_tiers", {}).items()]


def _prefetch(field: str) -> Callable[[str, Worker], Samples]:
    """Reported by the host tier of a worker with a disk tier only."""
    return lambda instance, w: [([instance], io[field]) for io in w.get("kv_tiers", {}).values() if field in io]


def _allocation(field: str) -> Callable[[str, Worker], Samples]:
    """Reported by workers under ``--schedule-policy cacheopt`` only."""
    return lambda instance, w: [([instance], w["kv_allocation"][field])] if w.get("kv_allocation") else []


def _handoffs(instance: str, w: Worker) -> Samples:
    pd = w.get("pd", {})
    return [([instance, what], pd.get(what, 0)) for what in ("handoffs", "blocks_sent", "bytes_sent", "messages")]


def _spec(field: str) -> Callable[[str, Worker], Samples]:
    return lambda instance, w: [([instance], w.get("spec_decode", {}).get(field, 0))]


G, C = GaugeMetricFamily, CounterMetricFamily
I, IT = ("instance",), ("instance", "tier")
WORKER_METRICS = (
    WorkerMetric(G, "memserve_worker_alive", "1 if the worker process is alive", I,
                 lambda instance, w: [([instance], 1.0 if w.get("alive") else 0.0)]),
    WorkerMetric(G, "memserve_num_requests_running", "Requests in the worker's running batch", I,
                 _scalar("num_running")),
    WorkerMetric(G, "memserve_num_requests_waiting", "Requests queued at the worker", I, _scalar("num_waiting")),
    WorkerMetric(G, "memserve_free_blocks", "Free KV blocks per memory tier", IT, _per_tier("free_blocks")),
    WorkerMetric(G, "memserve_cache_hit_rate", "Fraction of prompt tokens served from the KV cache", I,
                 _scalar("cache_hit_rate", 0.0)),
    WorkerMetric(C, "memserve_cached_tokens", "Prompt tokens served from the KV cache", I,
                 _scalar("cached_tokens_total")),
    WorkerMetric(C, "memserve_shared_prefill_holds",
                 "Requests admitted after waiting for a running prefill to compute blocks of their prompt (found "
                 "cached instead of computed twice)", I, _scalar("num_held_admissions")),
    WorkerMetric(G, "memserve_kv_tier_bytes_used", "Bytes of KV blocks allocated per tier", IT,
                 _tier_io("bytes_used")),
    WorkerMetric(C, "memserve_kv_tier_hit_blocks", "Cached KV blocks matched per tier", IT, _tier_io("hits")),
    WorkerMetric(C, "memserve_kv_tier_read_bytes", "KV bytes read from each tier (loads, saves)", IT,
                 _tier_io("read_bytes")),
    WorkerMetric(C, "memserve_kv_tier_write_bytes", "KV bytes written to each tier", IT, _tier_io("write_bytes")),
    WorkerMetric(G, "memserve_kv_tier_saving_blocks", "Cached blocks being saved down from each tier", IT,
                 _tier_io("saving")),
    WorkerMetric(C, "memserve_kv_tier_dropped_unsaved_blocks",
                 "Cached KV blocks dropped from each tier though a slower tier exists (its slower tiers were full "
                 "of blocks in use)", IT, _tier_io("dropped_unsaved")),
    WorkerMetric(G, "memserve_kv_save_queue", "KV save jobs not yet committed", I, _scalar("kv_save_queue")),
    WorkerMetric(G, "memserve_kv_tier_queue_depth",
                 "KV blocks queued or in flight between each tier and another (saves, prefetches)", IT,
                 _tier_io("queue_depth")),
    WorkerMetric(C, "memserve_kv_prefetched_blocks",
                 "KV blocks prefetched from disk to host for queued requests (--eviction-policy scheduler-aware)", I,
                 _prefetch("prefetched")),
    WorkerMetric(C, "memserve_kv_prefetch_hit_blocks", "Prefetched KV blocks a request then read from above the disk",
                 I, _prefetch("prefetch_hits")),
    WorkerMetric(G, "memserve_worker_role", "1 for the worker's role (colocated, prefill, decode)", ("instance", "role"),
                 lambda instance, w: [([instance, w.get("role", "colocated")], 1.0)]),
    WorkerMetric(C, "memserve_pd_handoff",
                 "Disaggregated KV handoffs sent by a prefill worker: handoffs, blocks, bytes, messages",
                 ("instance", "what"), _handoffs),
    WorkerMetric(G, "memserve_kv_reserve_blocks_in_use",
                 "Global-reserve KV blocks lent to requests that outgrew their allocation (--schedule-policy "
                 "cacheopt)", I, _allocation("reserve_in_use_blocks")),
    WorkerMetric(G, "memserve_kv_unheld_blocks",
                 "KV blocks allocated to running requests beyond what they use: padding of the predicted length and "
                 "over-allocation (--schedule-policy cacheopt)", I, _allocation("unheld_blocks")),
    WorkerMetric(G, "memserve_kv_tier_cached_blocks", "KV blocks the worker's index holds per memory tier", IT,
                 _per_tier("cached_blocks")),
    WorkerMetric(G, "memserve_kv_pinned_blocks",
                 "Cached KV blocks per tier that requests pinned with cache_control (at most --max-pinned-fraction "
                 "of each tier)", IT, _per_tier("pinned_blocks")),
    WorkerMetric(C, "memserve_spec_decode_num_draft_tokens",
                 "Draft tokens proposed by n-gram speculative decoding (--speculative-config)", I,
                 _spec("draft_tokens")),
    WorkerMetric(C, "memserve_tensor_parallel_comm_seconds",
                 "Seconds the worker's steps spent in collectives between its tensor-parallel ranks (divided by "
                 "memserve_engine_steps: the communication time per step)", I, _scalar("tensor_parallel_comm_s", 0.0)),
    WorkerMetric(C, "memserve_engine_steps", "Engine steps the worker ran", I, _scalar("num_steps")),
    WorkerMetric(C, "memserve_spec_decode_num_accepted_tokens",
                 "Draft tokens the model agreed with (each one an output token without a step of its own)", I,
                 _spec("accepted_tokens")),
)
