"""`memserve up --ray --cpu-workers 2` on a local Ray instance that the gateway starts
itself: it serves a greedy chat answer identical to a server without Ray's, /health names
each worker's node, a worker whose Ray actor is killed is restarted in a new actor while
the server keeps answering the same, and stopping the server leaves no process behind,
neither a worker nor Ray's own. Slow (Ray starts in some 10-20 s and takes about 1 GB);
skipped where Ray is not installed."""

from __future__ import annotations

import json
import signal
import urllib.request

import psutil
import pytest
from helpers.live_server import all_ok, wait_until, workers
from helpers.paths import REPO
from helpers.ray_processes import assert_gone, ray_processes

from memserve.bench.server_process import start_server, stop_server

pytest.importorskip("ray", reason="Ray is not installed (pip install 'memserve[ray]')")

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "temperature": 0, "max_tokens": 24}


def answer(server) -> str:
    body = json.dumps({"model": server.model, **CHAT}).encode()
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_ray_workers_serve_like_local_ones_and_are_restarted(memserve_server, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # --ray alone: a local Ray instance of its own
    local = answer(memserve_server)
    server = start_server(["--ray", "--cpu-workers", "2", "--num-blocks", "256"], tmp_path / "memserve.log",
                          threads=1, cwd=REPO)
    started = ray_processes(server.process.pid)
    left: list[psutil.Process] = []
    try:
        assert started, "the gateway started no local Ray instance"
        before = workers(server)
        assert sorted(before) == [0, 1]
        assert all(w["alive"] and w["node"] and w["pid"] for w in before.values()), before
        assert answer(server) == local

        worker = psutil.Process(before[0]["pid"])
        actor = worker.parent()
        assert actor is not None and "WorkerActor" in actor.name() + " ".join(actor.cmdline())
        actor.send_signal(signal.SIGKILL)  # the actor dies: its worker goes with it, and comes back
        wait_until(lambda: workers(server)[0]["restarts"] == 1 and all_ok(server), 120, "worker 0's restart")
        psutil.wait_procs([worker], timeout=30)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        after = workers(server)
        assert after[0]["pid"] != before[0]["pid"] and after[0]["node"] == before[0]["node"]
        assert answer(server) == local
        left = [psutil.Process(w["pid"]) for w in after.values()]
    finally:
        status = stop_server(server)
    assert status == 0
    assert_gone(started + left)
