"""Worker faults against a real two-worker `memserve up`: a worker killed with SIGKILL
under load (its queued requests are answered by the other worker and its streaming ones
resume there, none gets an error event, no block leaks on the survivor, the dead one
comes back), a frozen worker
(SIGSTOP) reported degraded and then replaced within the heartbeat timeout, and a 503
with Retry-After while no worker is alive."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from helpers.live_server import all_ok, health, wait_until, workers
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server

NUM_BLOCKS = 256
HEARTBEAT_TIMEOUT_S = 3.0
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = start_server(["--cpu-workers", "2", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "2",
                           "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)],
                          tmp_path_factory.mktemp("faults") / "memserve.log", cwd=REPO)
    yield handle
    stop_server(handle)


async def stream_completion(session: aiohttp.ClientSession, server, prompt: str, started: asyncio.Event) -> dict:
    """Streams one completion; returns its tokens, finish reason and any error event."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0}
    result: dict = {"status": None, "text": "", "finish_reason": None, "error": None}
    async with session.post(server.base_url + "/v1/completions", json=body) as resp:
        result["status"] = resp.status
        if resp.status != 200:
            result["error"] = (await resp.json())["error"]
            return result
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result["error"] = event["error"]
                continue
            choice = event["choices"][0]
            result["text"] += choice["text"]
            result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
            if choice["text"]:
                started.set()
    return result


def test_sigkill_under_load_moves_every_request_and_leaks_nothing(server):
    wait_until(lambda: all_ok(server), 120, "both workers healthy")
    victim = workers(server)[0]

    async def scenario() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            events = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.create_task(stream_completion(session, server, f"Story number {i}: once upon a time",
                                                           events[i])) for i in range(8)]
            # Two requests run on each worker (--max-num-seqs 2), two more wait there.
            await asyncio.wait_for(_at_least(events, 4), 60)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    killed_at = time.monotonic()
    results = asyncio.run(scenario())
    assert all(r["status"] == 200 for r in results), results
    # The victim's two streaming requests resume on the survivor, its queued ones are sent there.
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in results), results
    survivor = 1
    wait_until(lambda: workers(server)[survivor]["free_blocks"]["device"] == NUM_BLOCKS, 30,
               "the survivor's blocks to be free")
    wait_until(lambda: all_ok(server), 120, "the killed worker to come back")
    recovered = workers(server)[0]
    assert recovered["restarts"] == 1 and recovered["pid"] != victim["pid"]
    print(f"killed worker back after {time.monotonic() - killed_at:.1f} s")


async def _at_least(events: list[asyncio.Event], n: int) -> None:
    while sum(e.is_set() for e in events) < n:
        await asyncio.sleep(0.05)


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_frozen_worker_is_degraded_then_replaced(server):
    wait_until(lambda: all_ok(server), 120, "both workers healthy")
    victim = workers(server)[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        status, body = wait_until(lambda: (h := health(server))[1]["status"] == "degraded" and h, 10,
                                  "/health to say degraded")
        assert status == 200 and "1" in body["detail"]
        assert time.monotonic() - stopped_at < HEARTBEAT_TIMEOUT_S + 1
        # After the heartbeat timeout it is declared dead and replaced.
        wait_until(lambda: workers(server)[1]["pid"] != victim["pid"], HEARTBEAT_TIMEOUT_S + 10,
                   "the frozen worker to be replaced")
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    wait_until(lambda: all_ok(server), 120, "the replacement to be ready")


def test_no_live_worker_is_503_with_retry_after(server):
    wait_until(lambda: all_ok(server), 120, "both workers healthy")
    for w in workers(server).values():
        os.kill(w["pid"], signal.SIGKILL)
    wait_until(lambda: health(server)[0] == 503, 10, "/health to see the dead workers")
    req = urllib.request.Request(server.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 503 and int(exc.value.headers["Retry-After"]) > 0
    assert json.loads(exc.value.read())["error"]["type"] == "ServiceUnavailableError"
    wait_until(lambda: all_ok(server), 120, "the workers to come back")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening_tcp_ports(inodes: set[str]) -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_only_the_http_port_listens_on_tcp_and_internal_sockets_are_private(server):
    wait_until(lambda: all_ok(server), 120, "both workers healthy")
    pids = [server.process.pid] + [w["pid"] for w in workers(server).values()]
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    http_port = int(server.base_url.rsplit(":", 1)[1])
    assert _listening_tcp_ports(inodes) == {http_port}
    with open("/proc/net/unix") as f:
        paths = [cols[7] for cols in (line.split() for line in f.readlines()[1:])
                 if len(cols) >= 8 and cols[6] in inodes]
    socket_dirs = {os.path.dirname(p) for p in paths if os.path.basename(p).startswith(("gateway", "kv-"))}
    assert len(socket_dirs) == 1, paths
    assert os.stat(socket_dirs.pop()).st_mode & 0o777 == 0o700
