"""Shared fixtures: a real `memserve up` (real processes, sockets and model) for the
end-to-end tests, started once per test session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
SERVER_NUM_BLOCKS = 512  # KV blocks of the shared test server's worker


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MEMSERVE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set MEMSERVE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
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
        import json

        with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
            return json.loads(r.read())


def start_server(tmp: Path, *args: str, timeout_s: float = 300.0) -> ServerHandle:
    """Start `memserve up` on a free port and wait until /health answers 200."""
    port = free_port()
    log_path = tmp / f"memserve-{port}.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "memserve.cli", "up", "--port", str(port), "--dtype", "float32", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    handle = ServerHandle(f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"memserve up exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(handle.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return handle
        except OSError:
            pass
        time.sleep(0.3)
    stop_server(handle)
    raise RuntimeError(f"memserve up not healthy after {timeout_s} s:\n{log_path.read_text()[-4000:]}")


def stop_server(handle: ServerHandle, timeout_s: float = 20.0) -> int:
    if handle.process.poll() is None:
        handle.process.terminate()
        try:
            handle.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            handle.process.kill()
            handle.process.wait()
    return handle.process.returncode


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded SmolLM2 as a Hugging Face folder (converted once, then cached)."""
    from memserve.model_files.gguf_convert import ensure_model_dir

    return ensure_model_dir(None)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer files alone (no weights), for gateway tests on a fake engine."""
    from test_chat_template import smollm2_tokenizer_folder

    return smollm2_tokenizer_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder: Path):
    from memserve.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(tokenizer_folder)


@pytest.fixture(scope="session")
def memserve_server(tmp_path_factory):
    """One live server for the end-to-end tests: float32 (so greedy output can be compared
    with transformers), a modest KV pool."""
    handle = start_server(tmp_path_factory.mktemp("server"), "--num-blocks", str(SERVER_NUM_BLOCKS))
    yield handle
    stop_server(handle)
