"""`GET /v1/stats` and `GET /v1/stats/stream`: one JSON snapshot of the serving system
(instances, KV tiers, router, PD transfers, latency histograms, SLOs, admission), once
or as server-sent events once a second; the dashboard (``web/dashboard.html``) draws it.

Every figure comes from the sources ``/health`` and ``/metrics`` read: the engine's
``stats()`` (workers' latest heartbeat stats, router, admission) and the gateway's
Prometheus histograms and counters, so the three endpoints agree. Counters are
cumulative, as on /metrics; the dashboard turns them into rates. The schema is
documented in docs/observability.md."""

from __future__ import annotations

import asyncio
import logging
import math
import platform
import time
from collections.abc import Callable

import orjson
from aiohttp import web
from prometheus_client import Histogram

from memserve.gateway.metrics import GatewayMetrics

log = logging.getLogger("memserve.gateway")

STREAM_INTERVAL_S = 1.0
# A snapshot is built at most this often for all stream clients together.
_SHARED_MAX_AGE_S = 0.5


def health_status(workers: list[dict]) -> tuple[str, str | None]:
    """``/health``'s verdict on the workers, and why when it is not ``ok``: unhealthy when
    none is there or one is not alive, degraded when one's heartbeats are late or its step
    is stuck."""
    dead = [w.get("instance_id") for w in workers if not w.get("alive")]
    if not workers or dead:
        return "unhealthy", f"workers not alive: {dead}" if dead else "no workers"
    degraded = [w.get("instance_id") for w in workers if w.get("state") == "degraded"]
    if degraded:
        return "degraded", f"workers degraded: {degraded}"
    return "ok", None


def _instance(worker: dict, node: str) -> dict:
    """One worker's entry; ``node``: where it runs when the worker does not say (the gateway's host)."""
    kv_blocks = worker.get("kv_blocks", {})
    blocks = {}
    for tier, free in worker.get("free_blocks", {}).items():
        total = kv_blocks.get(tier, {}).get("total", 0)
        blocks[tier] = {"total": total, "used": max(total - free, 0), "free": free,
                        "cached": kv_blocks.get(tier, {}).get("cached", 0)}
    tiers = worker.get("kv_tiers", {})
    pd = worker.get("pd", {})
    return {
        "id": worker.get("instance_id"),
        "role": worker.get("role", "colocated"),
        "state": worker.get("state", "unknown"),
        "alive": bool(worker.get("alive")),
        "node": worker.get("node") or node,
        "pid": worker.get("pid"),
        "restarts": worker.get("restarts", 0),
        "running": worker.get("num_running", 0),
        "waiting": worker.get("num_waiting", 0),
        "blocks": blocks,
        "prefix_hit_ratio": worker.get("cache_hit_rate", 0.0),
        "cached_tokens_total": worker.get("cached_tokens_total", 0),
        "prompt_tokens_total": worker.get("prompt_tokens_total", 0),
        "evictions_total": worker.get("evicted_blocks", 0),
        "saves_total": worker.get("demoted_blocks", 0),
        "tier_write_bytes_total": {t: io.get("write_bytes", 0) for t, io in tiers.items()},
        "tier_read_bytes_total": {t: io.get("read_bytes", 0) for t, io in tiers.items()},
        "dropped_unsaved_total": sum(io.get("dropped_unsaved", 0) for io in tiers.values()),
        "save_queue": worker.get("kv_save_queue", 0),
        "preemptions_total": sum(worker.get("preemptions", {}).values()),
        "pd": {what: pd.get(what, 0) for what in ("handoffs", "blocks_sent", "bytes_sent", "messages")},
        "spec_decode": worker.get("spec_decode", {"draft_tokens": 0, "accepted_tokens": 0}),
    }


def _histogram(hist: Histogram) -> dict:
    """Cumulative bucket counts (``le`` → count, as on /metrics), count and sum of a
    prometheus_client ``Histogram``."""
    buckets: list[list] = []
    count, total = 0.0, 0.0
    for family in hist.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets.append(["+Inf" if math.isinf(le) else le, int(sample.value)])
            elif sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return {"buckets": buckets, "count": int(count), "sum": total}


def _slo(metrics: GatewayMetrics) -> dict:
    counts: dict[str, dict[str, int]] = {"ttft": {"met": 0, "missed": 0}, "tbt": {"met": 0, "missed": 0}}
    for family in metrics.slo.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                counts.setdefault(sample.labels["slo"], {})[sample.labels["outcome"]] = int(sample.value)
    out = {}
    for slo, c in counts.items():
        n = c.get("met", 0) + c.get("missed", 0)
        out[slo] = {**c, "attainment": c.get("met", 0) / n if n else None}
    return out


def build_snapshot(stats: dict, metrics: GatewayMetrics, node: str | None = None) -> dict:
    """One snapshot from ``engine.stats()`` and the gateway's metrics."""
    node = node or platform.node() or "local"
    workers = stats.get("workers", [])
    router = stats.get("router") or {}
    admission = stats.get("admission") or {}
    instances = [_instance(w, node) for w in workers]
    return {
        "time": time.time(),
        "status": health_status(workers)[0],
        "instances": instances,
        "spare_workers": len(stats.get("spare_workers", [])),
        "requests_in_flight": stats.get("num_requests_in_flight", 0),
        "router": {"policy": router.get("policy"), "decisions": dict(router.get("decisions", {})),
                   "routed": {str(k): v for k, v in router.get("routed", {}).items()}},
        "pd": {"transfers": sum(i["pd"]["handoffs"] for i in instances),
               "blocks": sum(i["pd"]["blocks_sent"] for i in instances),
               "bytes": sum(i["pd"]["bytes_sent"] for i in instances)},
        "latency": {"ttft_seconds": _histogram(metrics.ttft), "tbt_seconds": _histogram(metrics.tpot)},
        "slo": _slo(metrics),
        "admission": {"mode": admission.get("mode"), "rejections": dict(admission.get("rejected", {})),
                      "held": admission.get("held", 0)},
    }


class StatsEndpoints:
    """The two handlers; stream clients share one snapshot per tick."""

    def __init__(self, engine_stats: Callable[[], dict], metrics: GatewayMetrics) -> None:
        self._engine_stats = engine_stats
        self._metrics = metrics
        self._node = platform.node() or "local"
        self._shared: tuple[float, bytes] | None = None

    def snapshot(self) -> dict:
        return build_snapshot(self._engine_stats(), self._metrics, self._node)

    def _shared_bytes(self) -> bytes:
        now = time.monotonic()
        if self._shared is None or now - self._shared[0] >= _SHARED_MAX_AGE_S:
            self._shared = (now, orjson.dumps(self.snapshot()))
        return self._shared[1]

    async def stats(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.snapshot()), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """One ``data:`` event per second until the client leaves (the handler is then
        cancelled, or a write fails). A failing snapshot is logged and skipped: the
        stream outlives a worker's death and restart."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        try:
            while True:
                try:
                    body = self._shared_bytes()
                except Exception:
                    log.exception("stats snapshot failed; event skipped")
                    body = None
                if body is not None:
                    await response.write(b"data: " + body + b"\n\n")
                next_at += STREAM_INTERVAL_S
                await asyncio.sleep(max(next_at - loop.time(), 0.0))
        except (ConnectionResetError, ConnectionError):
            pass
        return response


def add_stats_routes(app: web.Application, engine_stats: Callable[[], dict], metrics: GatewayMetrics) -> None:
    endpoints = StatsEndpoints(engine_stats, metrics)
    app.add_routes([web.get("/v1/stats", endpoints.stats), web.get("/v1/stats/stream", endpoints.stream)])
