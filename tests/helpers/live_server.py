"""What a live `memserve up` reports about itself: its /health answer, its workers, and
the device blocks they can allocate; and the KV pool of the shared ``memserve_server``."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

SERVER_NUM_BLOCKS = 512  # KV blocks of the shared test server's worker


def health(server) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def workers(server) -> dict[int, dict]:
    return {w["instance_id"]: w for w in health(server)[1]["workers"]}


def all_ok(server) -> bool:
    status, body = health(server)
    return status == 200 and body["status"] == "ok"


def free_device_blocks(server) -> int:
    """Allocatable (free or cached-evictable) device blocks, from the workers' heartbeats."""
    health = server.get_json("/health")
    return sum(w["free_blocks"]["device"] for w in health["workers"])


def wait_free_blocks(server, until, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not until(free := free_device_blocks(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return free
