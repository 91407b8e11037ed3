"""``--model org/name`` not in the local Hugging Face cache is downloaded into it through
``huggingface_hub`` (from a local stand-in for the Hub), model files only; with
``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, it is a clear error at once.
Each case runs in a fresh process, as ``memserve up`` does: huggingface_hub reads its
endpoint and cache from the environment when it is first imported."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.fake_hub import SHA, fake_hub
from helpers.paths import REPO as REPO_ROOT

from memserve.testing.random_models import save_tiny_model

REPO = "memserve-test/tiny-llama"
RESOLVE = ("import sys; from memserve.model_files.gguf_convert import ensure_model_dir; "
           "print(ensure_model_dir(sys.argv[1]))")


def resolve(repo: str, hub_cache: Path, endpoint: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_ENDPOINT": endpoint,
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1" if offline else "0"}
    return subprocess.run([sys.executable, "-c", RESOLVE, repo], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_repo_id_not_cached_is_downloaded_model_files_only_then_found_offline(tmp_path):
    repo_files = tmp_path / "repo"
    save_tiny_model(repo_files, "llama")
    (repo_files / "model.gguf").write_bytes(b"another format of the same weights")
    (repo_files / "tokenizer.json").write_text("{}")
    hub_cache = tmp_path / "hub"
    with fake_hub({REPO: repo_files}) as (endpoint, requested):
        done = resolve(REPO, hub_cache, endpoint)
        assert done.returncode == 0, done.stderr
        snapshot = Path(done.stdout.strip().splitlines()[-1])
        assert snapshot == hub_cache / "models--memserve-test--tiny-llama" / "snapshots" / SHA
        assert sorted(p.name for p in snapshot.iterdir()) == \
            ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
        assert (snapshot / "model.safetensors").read_bytes() == (repo_files / "model.safetensors").read_bytes()
        assert not any(p.endswith("model.gguf") for p in requested)
    shutil.rmtree(repo_files)  # the Hub is gone; the cache serves it, online or not
    for offline in (True, False):
        again = resolve(REPO, hub_cache, f"http://127.0.0.1:{closed_port()}", offline=offline)
        assert again.returncode == 0 and Path(again.stdout.strip().splitlines()[-1]) == snapshot, again.stderr


def test_offline_a_repo_id_not_cached_is_a_clear_error_at_once(tmp_path):
    with fake_hub({}) as (endpoint, requested):
        start = time.monotonic()
        done = resolve("memserve-test/not-cached", tmp_path / "hub", endpoint, offline=True)
    assert done.returncode != 0 and "HF_HUB_OFFLINE is set" in done.stderr
    assert requested == [] and time.monotonic() - start < 60


def test_a_hub_that_cannot_be_reached_or_has_no_such_repo_is_a_clear_error(tmp_path):
    with fake_hub({}) as (endpoint, _):
        for url in (endpoint, f"http://127.0.0.1:{closed_port()}"):
            done = resolve("memserve-test/nowhere", tmp_path / "hub", url)
            assert done.returncode != 0
            assert "memserve-test/nowhere is not in the local Hugging Face cache and downloading it failed" \
                in done.stderr, done.stderr
