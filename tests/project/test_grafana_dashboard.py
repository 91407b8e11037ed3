"""The example Grafana dashboard only queries metrics a live gateway exports.

Every PromQL ``expr`` of ``examples/grafana/memserve.json`` is parsed for the metric names
it uses; a real ``memserve up`` serves one request (so the histograms have samples) and
its /metrics, parsed with prometheus_client, must export each of them under its
exposition name (counters end in ``_total``; histograms expose ``_bucket``, ``_sum`` and
``_count``). The Prometheus example must scrape the gateway's /metrics.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from helpers.paths import REPO
from prometheus_client.parser import text_string_to_metric_families

from memserve.bench.server_process import start_server, stop_server

DASHBOARD = REPO / "examples" / "grafana" / "memserve.json"
PROMETHEUS = REPO / "examples" / "prometheus.yml"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "atan2", "inf", "nan"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out += p.get("panels", [])  # rows
    return out


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: identifiers not called as functions, with
    label matchers, range selectors, grouping clauses, strings and numbers removed."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group(0)
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or name in _KEYWORDS:
            continue  # a function or an operator keyword
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # part of a number such as 1e-9
        names.add(name)
    return names


def exported_names(metrics_text: str) -> set[str]:
    """Every name a query may use: sample names, and the exposition names of each family
    (also when it has no sample yet)."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_dashboard_is_a_dashboard_model():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert set(p["gridPos"]) == {"h", "w", "x", "y"}
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("tier", "prefix-hit", "router", "pd transfer", "ttft", "tbt", "slo", "admission", "running"):
        assert topic in titles, topic
    for expr in exprs(dashboard):
        names = metric_names(expr)
        assert names and all(n.startswith("memserve_") for n in names), (expr, names)


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(memserve_time_to_first_token_seconds_bucket'
            '{worker=~"$worker"}[$__rate_interval]))) / clamp_min(sum(memserve_free_blocks), 1e-9)')
    assert metric_names(expr) == {"memserve_time_to_first_token_seconds_bucket", "memserve_free_blocks"}


def test_prometheus_example_scrapes_the_gateway():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = config["scrape_configs"]
    assert any(j.get("metrics_path", "/metrics") == "/metrics" and j["static_configs"][0]["targets"] for j in jobs)


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory):
    server = start_server(["--num-blocks", "64", "--num-host-blocks", "16", "--predictor", "off"],
                          tmp_path_factory.mktemp("grafana") / "memserve.log", cwd=REPO)
    try:
        body = json.dumps({"model": server.model, "prompt": "The capital of France is", "max_tokens": 4,
                           "temperature": 0, "slo_ttft_ms": 60000, "slo_tbt_ms": 60000}).encode()
        req = urllib.request.Request(server.base_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
            return r.read().decode()
    finally:
        stop_server(server)


def test_every_dashboard_metric_is_exported(metrics_text):
    exported = exported_names(metrics_text)
    used = set().union(*(metric_names(e) for e in exprs(json.loads(DASHBOARD.read_text()))))
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics the gateway does not export: {missing}"
    # histograms have samples after one request
    assert any(line.startswith("memserve_time_to_first_token_seconds_count 1") for line in metrics_text.splitlines())
