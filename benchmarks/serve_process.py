"""Start a real `memserve up` for a benchmark and wait until it is healthy: one place for
the free port, the log file and the start-up deadline that every real-server benchmark
needs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_memserve(flags: list[str], log: Path, threads: int | None = 1,
                   timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """`memserve up` in float32 with ``flags``; ``threads`` per worker (OMP_NUM_THREADS,
    so several workers share a small machine fairly; None leaves torch's default).
    Returns the process and its base URL once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "memserve.cli", "up", "--port", str(port), "--dtype", "float32", *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"memserve up exited with {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"memserve up not healthy after {timeout_s:.0f} s: see {log}")


def stop_memserve(proc: subprocess.Popen) -> None:
    """SIGTERM (the gateway stops its workers), then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serving(flags: list[str], log: Path, threads: int | None = 1) -> Iterator[str]:
    """``start_memserve`` for a ``with`` block: yields the base URL, stops the server after."""
    proc, url = start_memserve(flags, log, threads)
    try:
        yield url
    finally:
        stop_memserve(proc)
