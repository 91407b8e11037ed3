"""A cost model from the first start, without a model: ``--router cost`` starts without a
profile and routes by its prompt-tree fallback; the router and admission control take a
cost model handed over later (routing by cost, pricing the queued work routed before,
judging TTFT SLOs); a profile is looked up by the model's own name; the background
profile's command follows the workers' device and threads; the background profile (here
a stand-in child that copies a prepared profile, or fails, or hangs) hands its result
over, logs once what is off until then, and is stopped with the gateway; while the
gateway serves, the profile's whole process group (here a stand-in that counts, and a
process it started that counts too) makes no progress, goes on once the gateway has
been idle for a while, and a paused profile still ends cleanly on SIGTERM when the
gateway shuts down. The real profile behind a real ``memserve up`` is in
``tests/e2e/test_auto_profile_e2e.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.routing import BS, PROMPT, linear_cost, view

from memserve.config import EngineConfig, ServeConfig
from memserve.costmodel.model import CostKey, CostModel
from memserve.costmodel.store import cost_model_dir
from memserve.gateway.auto_profile import (
    PAUSE_POLL_S,
    RESUME_AFTER_IDLE_S,
    STOP_TIMEOUT_S,
    AutoProfile,
    profile_command,
    report_no_profile,
)
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.engine_protocol import RequestRejected
from memserve.gateway.router_setup import build_router, profile_model_name
from memserve.gateway.routing.admission import REJECT, Admission
from memserve.gateway.routing.route_types import RouteDecision, RouteRequest
from memserve.gateway.routing.router import Router
from memserve.ipc.messages import WorkerStats


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``$MEMSERVE_CACHE``: no profile anywhere, nothing written to the real one."""
    monkeypatch.setenv("MEMSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def profiled(model: str) -> CostModel:
    """The exact linear toy, keyed as ``memserve profile`` keys ``model`` in float32."""
    return dataclasses.replace(linear_cost(), key=CostKey(model, "float32", "test-hw"))


# ------------------------------------------------------------------ the hand-over
def test_the_router_routes_by_the_fallback_until_the_cost_model_arrives():
    """Worker 0 holds half the prompt and has 100 prompt tokens queued, worker 1 nothing.
    prompt-tree follows the prefix; once the cost model arrives the queue routed before it
    is priced (exec = 100 s on worker 0) and cost pulls the prefix to worker 1 instead, as
    in ``test_cost_pulls_exactly_when_eq2_holds``."""
    router = Router.named("cost", fallback="prompt-tree")
    assert (router.policy.name, router.awaiting and router.awaiting.name, router.cost) == ("prompt-tree", "cost", None)
    router.ledger.admit("first", 0, 4, 0, max_tokens=8)
    router.ledger.admit("second", 0, 96, 0, max_tokens=8)
    workers = [view(0, cached=PROMPT[:32]), view(1)]
    assert router.route(RouteRequest("before", PROMPT), workers) == RouteDecision(0, "cache_hit")
    router.release("before")
    assert router.ledger.work_s(0) == 0.0

    router.use_cost_model(linear_cost(2.0, transfer_latency_s=11.0))
    assert (router.policy.name, router.awaiting) == ("cost", None)
    assert router.ledger.work_s(0) == 100.0
    assert router.route(RouteRequest("after", PROMPT), workers) == RouteDecision(1, "pull", pull_from=0, pull_blocks=8)


def test_admission_judges_once_the_router_has_a_cost_model():
    """A 1 ms TTFT SLO cannot be met by a 64-token prefill that takes 32 s or more: before
    the cost model the request is admitted unjudged, after it it is refused."""
    cluster = SimpleNamespace(workers={i: SimpleNamespace(stats=WorkerStats(), config=SimpleNamespace(role="colocated"))
                                       for i in (0, 1)},
                              states=lambda work_s: {0: "ok", 1: "ok"})
    router = Router.named("cost", fallback="prompt-tree")
    client = ZmqEngineClient(SimpleNamespace(), cluster, BS, router=router, admission=Admission(REJECT))
    request = RouteRequest("r", PROMPT, slo={"ttft_ms": 1.0})
    asyncio.run(client.admit(request))
    assert client.admission.stats()["rejected"] == {}

    router.use_cost_model(linear_cost())
    with pytest.raises(RequestRejected, match="TTFT SLO"):
        asyncio.run(client.admit(request))
    assert client.admission.stats()["rejected"] == {"infeasible": 1}


# ------------------------------------------------------------------ start-up
def test_the_cost_router_starts_without_a_profile(cache: Path):
    router = build_router(ServeConfig(router="cost"))
    assert router.cost is None and router.policy.name == "prompt-tree" and router.awaiting.name == "cost"
    assert not cost_model_dir().exists()  # looking wrote nothing


def test_without_a_background_profile_the_log_says_what_stays_off(cache: Path, caplog: pytest.LogCaptureFixture):
    cfg = ServeConfig(router="cost", auto_profile=False)
    with caplog.at_level(logging.INFO, logger="memserve.gateway"):
        report_no_profile(cfg, build_router(cfg))
        report_no_profile(ServeConfig(admission="off"), build_router(ServeConfig(admission="off")))
    [line] = [r.getMessage() for r in caplog.records]  # nothing to say when nothing asked for a cost model
    assert f"no cost model for SmolLM2-135M-Instruct in {cost_model_dir()}, and --no-auto-profile: cost routing " \
           "falls back to prompt-tree and SLO admission (--admission reject) is off" in line


def test_a_profile_is_found_by_the_models_own_name(cache: Path, tmp_path: Path):
    """``memserve profile`` keys a folder's profile by the folder's name; the gateway finds
    it under that name whatever ``--served-model-name`` says."""
    folder = tmp_path / "my-model"
    engine = EngineConfig(model=str(folder), dtype="float32")
    assert profile_model_name(engine) == "my-model"
    profiled("my-model").save(cost_model_dir() / "my-model.json")
    router = build_router(ServeConfig(engine=engine, router="cost", served_model_name="public-name"))
    assert router.cost is not None and router.policy.name == "cost" and router.awaiting is None


def test_the_profile_runs_on_a_workers_device_with_a_workers_threads(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    base = [sys.executable, "-m", "memserve.cli", "profile", "--quick", "--dtype", "auto"]
    assert profile_command(ServeConfig()) == [*base, "--device", "cpu"]
    assert profile_command(ServeConfig(engine=EngineConfig(model="m", cpu_threads=3))) == \
        [*base, "--model", "m", "--device", "cpu", "--threads", "3"]
    assert profile_command(ServeConfig(cpu_workers=2))[-2:] == ["--threads", str(max(1, (os.cpu_count() or 1) // 2))]
    assert profile_command(ServeConfig(gpus=[2, 3]))[-2:] == ["--device", "cuda:2"]
    split = profile_command(ServeConfig(engine=EngineConfig(tensor_parallel_size=2)))
    assert split[split.index("--tensor-parallel-size") + 1] == "2"


# ------------------------------------------------------------------ the background profile
def _auto_profile(cfg: ServeConfig, command: list[str]) -> tuple[AutoProfile, Router]:
    router = build_router(cfg)
    profile = AutoProfile(cfg, router)
    profile.command = command
    return profile, router


def profile_pid(caplog: pytest.LogCaptureFixture) -> int:
    """The pid that the profile's first log line names."""
    return int(re.search(r"pid (\d+)", caplog.records[0].getMessage()).group(1))


def test_a_finished_profile_turns_cost_routing_and_admission_on(cache: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture):
    cfg = ServeConfig(engine=EngineConfig(dtype="float32"), router="cost")
    staged = profiled("SmolLM2-135M-Instruct").save(tmp_path / "staged.json")
    target = cost_model_dir() / "SmolLM2-135M-Instruct-float32-test-hw.json"
    copy = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
    profile, router = _auto_profile(cfg, [sys.executable, "-c", copy, str(staged), str(target)])
    cost_model_dir().mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="memserve.gateway"):
        asyncio.run(profile.run(lambda: False))
    assert router.cost is not None and router.policy.name == "cost"
    waiting, ready = [r.getMessage() for r in caplog.records]
    assert f"until the profile in {cost_model_dir()} is ready, cost routing falls back to prompt-tree and " \
           "SLO admission (--admission reject) is off" in waiting
    assert f"written to {target}: cost routing and SLO admission (--admission reject) are on" in ready


def test_a_failed_profile_leaves_the_fallback_and_says_why(cache: Path, caplog: pytest.LogCaptureFixture):
    cfg = ServeConfig(engine=EngineConfig(dtype="float32"), router="cost", admission="off")
    profile, router = _auto_profile(cfg, [sys.executable, "-c", "import sys; print('no luck'); sys.exit(3)"])
    with caplog.at_level(logging.INFO, logger="memserve.gateway"):
        asyncio.run(profile.run(lambda: False))
    assert router.cost is None and router.policy.name == "prompt-tree"
    failed = caplog.records[-1].getMessage()
    assert "failed (exit 3): cost routing falls back to prompt-tree;" in failed and "no luck" in failed


def test_the_profile_stops_with_the_gateway(cache: Path, caplog: pytest.LogCaptureFixture):
    profile, router = _auto_profile(ServeConfig(), [sys.executable, "-c", "import time; time.sleep(600)"])

    async def start_then_stop() -> None:
        task = asyncio.create_task(profile.run(lambda: False))
        while not caplog.records:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="memserve.gateway"):
        asyncio.run(start_then_stop())
    with pytest.raises(ProcessLookupError):
        os.kill(profile_pid(caplog), 0)  # stopped and reaped
    assert router.cost is None


COUNTER = """
import os, signal, subprocess, sys, time
path, role = sys.argv[1], sys.argv[2]
if role == "leader":  # starts a helper, as the profile starts its transfer receiver
    helper = subprocess.Popen([sys.executable, __file__, path + ".helper", "helper"])

    def ended(*_):
        helper.kill()
        helper.wait()
        open(path + ".ended", "w").write("SIGTERM")
        sys.exit(0)

    signal.signal(signal.SIGTERM, ended)
n = 0
while True:
    n += 1
    with open(path + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(path + ".tmp", path)
    time.sleep(0.01)
"""


def test_the_profile_makes_no_progress_while_the_gateway_serves(cache: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture):
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    counters = [tmp_path / "count", tmp_path / "count.helper"]
    profile, router = _auto_profile(ServeConfig(), [sys.executable, str(script), str(counters[0]), "leader"])
    busy = False

    def counts() -> list[int]:
        return [int(c.read_text()) if c.exists() else 0 for c in counters]

    async def progress(since: list[int]) -> float:
        """Seconds until both counters passed ``since``."""
        start = time.monotonic()
        while not all(now > then for now, then in zip(counts(), since)):
            assert time.monotonic() - start < 30, "the profile made no progress"
            await asyncio.sleep(0.01)
        return time.monotonic() - start

    async def held_still() -> list[int]:
        """The counters, once they have not moved for half a second."""
        await asyncio.sleep(PAUSE_POLL_S + 0.3)  # paused, and the last writes done
        paused = counts()
        await asyncio.sleep(0.5)
        assert counts() == paused, "the profile went on while the gateway served"
        return paused

    async def serve_twice_then_shut_down() -> float:
        nonlocal busy
        task = asyncio.create_task(profile.run(lambda: busy))
        await progress([0, 0])
        busy = True
        paused = await held_still()
        busy = False
        assert await progress(paused) >= RESUME_AFTER_IDLE_S - PAUSE_POLL_S  # held through a chat's gaps
        busy = True
        await held_still()
        start = time.monotonic()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic() - start

    with caplog.at_level(logging.INFO, logger="memserve.gateway"):
        shut_down_s = asyncio.run(serve_twice_then_shut_down())
    assert (tmp_path / "count.ended").read_text() == "SIGTERM"  # continued, so it handled SIGTERM
    assert shut_down_s < STOP_TIMEOUT_S  # no SIGKILL needed
    with pytest.raises(ProcessLookupError):
        os.kill(profile_pid(caplog), 0)  # ended and reaped
    said = [r.getMessage() for r in caplog.records if "paused while requests are served" in r.getMessage()]
    assert len(said) == 1  # once, for two pauses
    assert router.cost is None
