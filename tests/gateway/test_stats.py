"""`GET /v1/stats` and `GET /v1/stats/stream` (memserve/gateway/stats.py) and the web
pages' routes: the snapshot follows its schema and agrees with /metrics and /health on a
live server; the stream sends one snapshot a second; --no-web-ui (``web_ui=False``)
removes the pages but keeps the stats API; the page files load nothing from outside."""

from __future__ import annotations

import itertools
import json
import re
import time
import urllib.request

import jsonschema
import pytest
from helpers.fake_engine import FakeEngine, async_test, serve
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from memserve.gateway.web_ui import WEB_DIR

COUNT = {"type": "integer", "minimum": 0}
NUMBER = {"type": "number", "minimum": 0}
COUNTS = {"type": "object", "additionalProperties": COUNT}
HISTOGRAM = {
    "type": "object",
    "required": ["buckets", "count", "sum"],
    "properties": {
        "buckets": {"type": "array", "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "prefixItems": [{"anyOf": [NUMBER, {"const": "+Inf"}]}, COUNT]}},
        "count": COUNT,
        "sum": NUMBER,
    },
}
TIER_BLOCKS = {
    "type": "object",
    "required": ["total", "used", "free", "cached"],
    "properties": {k: COUNT for k in ("total", "used", "free", "cached")},
    "additionalProperties": False,
}
INSTANCE = {
    "type": "object",
    "required": ["id", "role", "state", "alive", "node", "running", "waiting", "blocks", "prefix_hit_ratio",
                 "cached_tokens_total", "prompt_tokens_total", "evictions_total", "saves_total",
                 "tier_write_bytes_total", "dropped_unsaved_total", "pd"],
    "properties": {
        "id": COUNT,
        "role": {"enum": ["colocated", "prefill", "decode"]},
        "state": {"type": "string"},
        "alive": {"type": "boolean"},
        "node": {"type": "string", "minLength": 1},
        "running": COUNT,
        "waiting": COUNT,
        "blocks": {"type": "object", "required": ["device"],
                   "propertyNames": {"enum": ["device", "host", "disk"]},
                   "additionalProperties": TIER_BLOCKS},
        "prefix_hit_ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "cached_tokens_total": COUNT,
        "prompt_tokens_total": COUNT,
        "evictions_total": COUNT,
        "saves_total": COUNT,
        "tier_write_bytes_total": COUNTS,
        "tier_read_bytes_total": COUNTS,
        "dropped_unsaved_total": COUNT,
        "preemptions_total": COUNT,
        "pd": {"type": "object", "required": ["handoffs", "blocks_sent", "bytes_sent", "messages"],
               "additionalProperties": COUNT},
    },
}
SLO = {"type": "object", "required": ["met", "missed", "attainment"],
       "properties": {"met": COUNT, "missed": COUNT,
                      "attainment": {"anyOf": [{"type": "null"}, {"type": "number", "minimum": 0, "maximum": 1}]}}}
SNAPSHOT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["time", "status", "instances", "requests_in_flight", "router", "pd", "latency", "slo", "admission"],
    "properties": {
        "time": NUMBER,
        "status": {"enum": ["ok", "degraded", "unhealthy"]},
        "instances": {"type": "array", "items": INSTANCE},
        "spare_workers": COUNT,
        "requests_in_flight": COUNT,
        "router": {"type": "object", "required": ["policy", "decisions", "routed"],
                   "properties": {"policy": {"type": ["string", "null"]}, "decisions": COUNTS, "routed": COUNTS}},
        "pd": {"type": "object", "required": ["transfers", "blocks", "bytes"],
               "properties": {"transfers": COUNT, "blocks": COUNT, "bytes": COUNT}},
        "latency": {"type": "object", "required": ["ttft_seconds", "tbt_seconds"],
                    "properties": {"ttft_seconds": HISTOGRAM, "tbt_seconds": HISTOGRAM}},
        "slo": {"type": "object", "required": ["ttft", "tbt"], "properties": {"ttft": SLO, "tbt": SLO}},
        "admission": {"type": "object", "required": ["mode", "rejections", "held"],
                      "properties": {"rejections": COUNTS, "held": COUNT}},
    },
}


def _get(base_url: str, path: str) -> bytes:
    with urllib.request.urlopen(base_url + path, timeout=10) as r:
        return r.read()


def _metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(_get(base_url, "/metrics").decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _wait_idle(base_url: str, timeout_s: float = 30.0, settle_s: float = 3.0) -> None:
    """Until the workers' heartbeats have said nothing runs or waits for ``settle_s`` in a row.

    A heartbeat carries stats the worker published up to one interval (1 s) before the
    heartbeat thread sends them, so an idle reading can predate a request's own stats:
    only idle readings held for several intervals mean the figures have settled."""
    deadline = time.monotonic() + timeout_s
    idle_since = None
    while time.monotonic() < deadline:
        health = json.loads(_get(base_url, "/health"))
        snap = json.loads(_get(base_url, "/v1/stats"))
        idle = all(w["num_running"] == 0 and w["num_waiting"] == 0 for w in health["workers"]) and \
            all(i["running"] == 0 and i["waiting"] == 0 for i in snap["instances"])
        now = time.monotonic()
        idle_since = (idle_since or now) if idle else None
        if idle_since is not None and now - idle_since >= settle_s:
            return
        time.sleep(0.2)
    raise AssertionError("server not idle")


def test_stats_schema_and_agreement(memserve_server):
    base = memserve_server.base_url
    client = OpenAI(base_url=base + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    for _ in range(2):  # the second request finds the first's prompt cached
        client.chat.completions.create(model=memserve_server.model, messages=messages, max_tokens=8, temperature=0)
    _wait_idle(base)

    snap = json.loads(_get(base, "/v1/stats"))
    health = json.loads(_get(base, "/health"))
    metrics = _metrics(base)
    jsonschema.validate(snap, SNAPSHOT_SCHEMA)
    assert abs(snap["time"] - time.time()) < 5
    assert snap["status"] == health["status"]

    by_id = {w["instance_id"]: w for w in health["workers"]}
    assert sorted(i["id"] for i in snap["instances"]) == sorted(by_id)
    for inst in snap["instances"]:
        worker, label = by_id[inst["id"]], str(inst["id"])
        assert inst["role"] == worker["role"]
        assert metrics[("memserve_worker_role", (("instance", label), ("role", inst["role"])))] == 1.0
        assert inst["state"] == worker["state"] and inst["alive"] == worker["alive"]
        assert inst["running"] == worker["num_running"] == 0
        assert metrics[("memserve_num_requests_running", (("instance", label),))] == 0
        assert inst["waiting"] == worker["num_waiting"] == 0
        assert set(inst["blocks"]) == set(worker["free_blocks"])
        for tier, blocks in inst["blocks"].items():
            assert blocks["free"] == worker["free_blocks"][tier]
            assert blocks["free"] == metrics[("memserve_free_blocks", (("instance", label), ("tier", tier)))]
            assert blocks["total"] == worker["kv_blocks"][tier]["total"]
            assert blocks["used"] == blocks["total"] - blocks["free"]
        # Idle: nothing is held by a request, every device block is allocatable.
        assert inst["blocks"]["device"]["used"] == 0
        assert inst["cached_tokens_total"] == worker["cached_tokens_total"] == \
            metrics[("memserve_cached_tokens_total", (("instance", label),))]
        assert inst["cached_tokens_total"] > 0  # the second request's prompt
        assert inst["blocks"]["device"]["cached"] > 0
        assert inst["prefix_hit_ratio"] == pytest.approx(worker["cache_hit_rate"])
        assert inst["prefix_hit_ratio"] == pytest.approx(metrics[("memserve_cache_hit_rate", (("instance", label),))])
        assert inst["evictions_total"] == worker["evicted_blocks"]
        assert inst["pd"]["bytes_sent"] == metrics[("memserve_pd_handoff_total",
                                                    (("instance", label), ("what", "bytes_sent")))]
    total_device = sum(i["blocks"]["device"]["total"] for i in snap["instances"])
    assert total_device == sum(w["kv_blocks"]["device"]["total"] for w in health["workers"]) > 0

    policy = snap["router"]["policy"]
    for reason, n in snap["router"]["decisions"].items():
        assert n == metrics[("memserve_router_decisions_total", (("policy", policy), ("reason", reason)))]
    ttft = snap["latency"]["ttft_seconds"]
    assert ttft["count"] == metrics[("memserve_time_to_first_token_seconds_count", ())] >= 2
    for le, n in ttft["buckets"]:
        bound = "+Inf" if le == "+Inf" else repr(float(le))
        assert n == metrics[("memserve_time_to_first_token_seconds_bucket", (("le", bound),))]
    assert snap["latency"]["tbt_seconds"]["count"] == metrics[("memserve_time_per_output_token_seconds_count", ())]
    for slo in ("ttft", "tbt"):
        for outcome in ("met", "missed"):
            assert snap["slo"][slo][outcome] == metrics[("memserve_slo_requests_total",
                                                         (("outcome", outcome), ("slo", slo)))]
    for reason, n in snap["admission"]["rejections"].items():
        assert n == metrics[("memserve_admission_rejections_total", (("reason", reason),))]


def test_stats_stream_sends_a_snapshot_a_second(memserve_server):
    request = urllib.request.Request(memserve_server.base_url + "/v1/stats/stream")
    events, arrivals = [], []
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        while len(events) < 3:
            line = r.readline().decode()
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                arrivals.append(time.monotonic())
    for event in events:
        jsonschema.validate(event, SNAPSHOT_SCHEMA)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert all(0.7 < g < 1.5 for g in gaps), gaps
    times = [e["time"] for e in events]
    assert all(0.5 < b - a < 2.0 for a, b in itertools.pairwise(times)), times


@async_test
async def test_web_ui_off_keeps_the_stats_api(tokenizer):
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer, web_ui=False) as client:
        for path in ("/", "/dashboard", "/web/chat.js"):
            r = await client.get(path)
            assert r.status == 404, path
        r = await client.get("/v1/stats")
        assert r.status == 200
        snap = await r.json()
        assert [i["id"] for i in snap["instances"]] == [w.instance_id for w in engine.workers]
    async with serve(engine, tokenizer) as client:
        for path, kind in (("/", "text/html"), ("/dashboard", "text/html"), ("/web/chat.js", "text/javascript"),
                           ("/web/style.css", "text/css")):
            r = await client.get(path)
            assert r.status == 200 and r.content_type == kind, path
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        for path in ("/web/../app.py", "/web/nope.js", "/web/%2e%2e%2fstats.py"):
            assert (await client.get(path)).status == 404, path


def test_web_files_load_nothing_from_outside():
    names = sorted(p.name for p in WEB_DIR.iterdir())
    assert {"index.html", "dashboard.html", "chat.js", "dashboard.js", "common.js", "style.css"} <= set(names)
    for name in names:
        text = (WEB_DIR / name).read_text()
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'`)]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)  # the SVG namespace is a name, not a fetch
        assert "innerHTML" not in text and "outerHTML" not in text and "insertAdjacentHTML" not in text, name
        assert "document.write" not in text and "eval(" not in text, name
