"""Ray's own processes under a process, so that a test can check none outlives it."""

from __future__ import annotations

import psutil

RAY_PROCESSES = ("raylet", "gcs_server")


def ray_processes(pid: int | None = None) -> list[psutil.Process]:
    """The raylets and GCS servers that descend from process ``pid`` (default: this one)."""
    return [p for p in psutil.Process(pid).children(recursive=True) if p.name() in RAY_PROCESSES]


def assert_gone(processes: list[psutil.Process], timeout_s: float = 30.0) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert not alive, f"left behind: {alive}"
