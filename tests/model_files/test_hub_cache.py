"""``--model org/name`` is served from the local Hugging Face cache, as ``vllm serve``
finds it, and with ``HF_HUB_OFFLINE=1`` a repo id that is not cached is a clear error at
once (downloads: test_hub_download.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from memserve.config import EngineConfig, ServeConfig, served_model_name
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.model_files.hub_cache import is_repo_id

REPO = "memserve-test/SmolLM2-135M"


def cache_with(hub: Path, repo: str, folder: Path) -> Path:
    """Lay ``folder``'s files out as the Hugging Face cache keeps a downloaded repo."""
    org, name = repo.split("/")
    root = hub / f"models--{org}--{name}"
    snapshot = root / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    return snapshot


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, hub: Path) -> None:
    """Point huggingface_hub at ``hub``: it reads $HF_HUB_CACHE when first imported, which
    in a test session is long before this test (transformers imports it)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))


def test_a_cached_repo_id_resolves_to_its_snapshot(tmp_path, monkeypatch, model_dir):
    snapshot = cache_with(tmp_path / "hub", REPO, model_dir)
    use_hub_cache(monkeypatch, tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ensure_model_dir(REPO) == snapshot
    assert (snapshot / "config.json").is_file()
    assert served_model_name(ServeConfig(engine=EngineConfig(model=REPO))) == REPO


def test_offline_a_repo_id_not_cached_is_a_clear_error_at_once(tmp_path, monkeypatch):
    use_hub_cache(monkeypatch, tmp_path / "empty-hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        ensure_model_dir("memserve-test/not-cached")
    assert time.monotonic() - start < 5


def test_paths_are_not_repo_ids(tmp_path):
    assert is_repo_id("Qwen/Qwen3-0.6B")
    assert not is_repo_id(str(tmp_path))  # an existing folder
    assert not is_repo_id("model.gguf") and not is_repo_id("/abs/path/x") and not is_repo_id("a/b/c")
