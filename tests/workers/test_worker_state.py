"""How the gateway judges a worker from its heartbeats (``WorkerHandle.state``): late
heartbeats make it degraded; so does one engine step running past the heartbeat timeout,
but only beyond the work the gateway knows is queued there, so that a long cold prefill
does not hide the worker that is computing a prefix from the router."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memserve.config import EngineConfig, WorkerConfig
from memserve.gateway.cluster import WorkerHandle
from memserve.ipc.messages import WorkerStats

TIMEOUT_S = 5.0


@pytest.fixture
def handle():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    h = WorkerHandle(WorkerConfig(instance_id=0, role="colocated", engine=EngineConfig(), gateway_addr=""),
                     process=proc, ready=True, last_heartbeat=100.0)
    yield h
    proc.kill()
    proc.wait()


def test_a_step_is_stuck_only_past_the_timeout_beyond_the_queued_work(handle):
    handle.stats = WorkerStats(loop_age_s=7.0)  # heartbeats on time, one step running for 7 s
    assert handle.state(100.5, TIMEOUT_S) == "degraded"
    assert handle.state(100.5, TIMEOUT_S, busy_s=4.0) == "ok"  # 7 s < 5 s + 4 s of queued prefill
    assert handle.state(100.5, TIMEOUT_S, busy_s=1.5) == "degraded"
    handle.stats = WorkerStats(loop_age_s=0.2)
    assert handle.state(100.5, TIMEOUT_S) == "ok"


def test_late_heartbeats_are_degraded_whatever_is_queued(handle):
    handle.stats = WorkerStats(loop_age_s=0.0)
    late = 100.0 + 3 * handle.config.heartbeat_s
    assert handle.state(late, TIMEOUT_S, busy_s=60.0) == "degraded"
