"""Start a real `memserve up` to measure or test, and stop it: one place for the free port,
the log file, the start-up deadline and the shutdown that the end-to-end tests, the
real-server benchmarks and the soak and chaos scripts all need.

The server runs as a subprocess (``python -m memserve.cli up``), so that it is measured
as a user runs it; nothing here imports the gateway or the workers.

    with serving(["--num-blocks", "512"], Path("up.log"), threads=1) as server:
        print(server.get_json("/health"))
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"  # the name the embedded default model is served as
LOG_TAIL_CHARS = 4000  # how much of the server's log an error message carries


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    model: str
    process: subprocess.Popen
    log_path: Path

    def get_json(self, path: str) -> dict:
        """GET ``path`` (e.g. ``/health``) and decode the JSON answer."""
        with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
            return json.loads(r.read())


def _log_tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError as e:
        return f"(no log: {e})"


def start_server(flags: Sequence[str], log_path: Path, *, threads: int | None = None, timeout_s: float = 300.0,
                 cwd: Path | str | None = None, auto_profile: bool = False) -> ServerHandle:
    """`memserve up` on a free port of 127.0.0.1, in float32 unless ``flags`` say
    otherwise (``--dtype float32`` comes before them, so a later ``--dtype`` wins), its
    output in ``log_path``. ``threads`` sets OMP_NUM_THREADS for it and its workers, so
    that several workers share a small machine fairly (None: torch's default).
    ``auto_profile`` lets a server without a cost model profile one in the background;
    off by default (``--no-auto-profile``), so that what is measured or tested shares
    the CPU with nothing and no profile is written into the user's cache. Returns
    once /health answers 200; raises RuntimeError with the log's tail if the server
    exits first or is not healthy within ``timeout_s`` (then it is stopped)."""
    port = free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "memserve.cli", "up", "--port", str(port), "--dtype", "float32",
           *([] if auto_profile else ["--no-auto-profile"]), *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    with log_path.open("w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    handle = ServerHandle(f"http://127.0.0.1:{port}", MODEL, proc, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"memserve up exited with {proc.returncode} (log: {log_path}):\n{_log_tail(log_path)}")
        try:
            with urllib.request.urlopen(handle.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return handle
        except OSError:
            pass
        time.sleep(0.3)
    stop_server(handle)
    raise RuntimeError(f"memserve up not healthy after {timeout_s:.0f} s (log: {log_path}):\n{_log_tail(log_path)}")


def stop_server(handle: ServerHandle, timeout_s: float = 30.0) -> int:
    """SIGTERM (the gateway stops its workers), then SIGKILL after ``timeout_s``.
    Returns the server's exit status."""
    if handle.process.poll() is None:
        handle.process.terminate()
        try:
            handle.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            handle.process.kill()
            handle.process.wait()
    return handle.process.returncode


@contextmanager
def serving(flags: Sequence[str], log_path: Path, *, threads: int | None = None, timeout_s: float = 300.0,
            cwd: Path | str | None = None, auto_profile: bool = False) -> Iterator[ServerHandle]:
    """``start_server`` for a ``with`` block: yields the handle, stops the server after."""
    handle = start_server(flags, log_path, threads=threads, timeout_s=timeout_s, cwd=cwd, auto_profile=auto_profile)
    try:
        yield handle
    finally:
        stop_server(handle)
