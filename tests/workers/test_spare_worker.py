"""A spare worker (``--spare-workers 1``) loads the model and warms up once the workers
are ready, replaces a worker killed with SIGKILL (the new worker is the spare's process,
not a cold start), serves correctly, and is itself replaced by a new spare process."""

from __future__ import annotations

import os
import signal

import pytest
from helpers.live_server import all_ok, health, wait_until, workers
from helpers.paths import REPO
from openai import OpenAI

from memserve.bench.server_process import start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = start_server(["--num-blocks", "256", "--spare-workers", "1", "--heartbeat-timeout", "3"],
                          tmp_path_factory.mktemp("spare") / "memserve.log", cwd=REPO)
    yield handle
    stop_server(handle)


def ready_spares(server) -> list[dict]:
    return [s for s in health(server)[1]["spare_workers"] if s["state"] == "ready"]


def complete(server) -> str:
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    return out.choices[0].text


def test_killed_worker_is_replaced_by_the_warm_spare(server):
    expected = complete(server)
    spare = wait_until(lambda: ready_spares(server), 180, "a ready spare worker")[0]
    victim = workers(server)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: workers(server)[0]["pid"] != victim["pid"] and all_ok(server), 60,
               "the spare to take over")
    replaced = workers(server)[0]
    assert replaced["pid"] == spare["pid"]
    assert replaced["restarts"] == 1
    assert complete(server) == expected  # same greedy output on the spare
    wait_until(lambda: [s for s in health(server)[1]["spare_workers"] if s["pid"] != spare["pid"]], 60,
               "a new spare worker")
