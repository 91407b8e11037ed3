"""A first ``memserve up --router cost`` with no profile anywhere (an empty
``$MEMSERVE_CACHE``): it starts, serves at once by its prompt-tree fallback while a
quick profile runs in the background, writes that profile where ``memserve profile``
would, and then routes by cost and judges TTFT SLOs (a 1 ms SLO is refused), saying so
in its log. Slow: about a minute on 2 cores, most of it the profile."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.live_server import wait_until
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server

PROFILE_TIMEOUT_S = 240.0


def chat(server, **extra) -> int:
    body = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, **extra}
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def policy(server) -> str:
    return server.get_json("/v1/stats")["router"]["policy"]


@pytest.mark.slow
def test_a_first_start_profiles_in_the_background_then_routes_by_cost(model_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MEMSERVE_CACHE", str(tmp_path / "cache"))  # the model comes as a folder: not converted
    log = tmp_path / "memserve.log"
    server = start_server(["--router", "cost", "--model", str(model_dir), "--num-blocks", "128"], log,
                          threads=1, cwd=REPO, auto_profile=True)
    try:
        assert policy(server) == "prompt-tree"  # the profile takes longer than the start's last steps
        assert chat(server) == 200
        assert chat(server, slo_ttft_ms=1) == 200  # no SLO check yet
        wait_until(lambda: policy(server) == "cost", PROFILE_TIMEOUT_S, "the background profile")
        assert chat(server) == 200
        assert chat(server, slo_ttft_ms=1) == 429  # no prefill takes 1 ms
    finally:
        stop_server(server)
    profiles = list((tmp_path / "cache" / "cost-models").glob("*.json"))
    assert [json.loads(p.read_text())["key"]["model"] for p in profiles] == [model_dir.name]
    text = log.read_text()
    assert "cost routing falls back to prompt-tree and SLO admission (--admission reject) is off" in text
    assert f"written to {profiles[0]}: cost routing and SLO admission (--admission reject) are on" in text
