"""Ctrl-C or SIGTERM stops the gateway and every worker within seconds: no orphans."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.paths import REPO

from memserve.bench.server_process import start_server


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


# SIGINT takes the same path as SIGTERM: `make test-all` runs it.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_stops_gateway_and_workers(tmp_path, sig):
    server = start_server(["--num-blocks", "64", "--cpu-workers", "2"], tmp_path / "memserve.log", cwd=REPO)
    workers = _children(server.process.pid)
    assert len(workers) == 2
    server.process.send_signal(sig)
    server.process.wait(timeout=15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers)
    assert "serving" in server.log_path.read_text()
