"""Fixtures shared by all tests: a real `memserve up` (real processes, sockets and model)
for the end-to-end tests, started once per test session, the embedded model and its
tokenizer. Code shared by several test files lives in ``tests/helpers/``; this file's
folder is on ``sys.path`` (pytest's rootdir conftest), so it imports as ``helpers.xxx``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.live_server import SERVER_NUM_BLOCKS
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MEMSERVE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set MEMSERVE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded SmolLM2 as a Hugging Face folder (converted once, then cached)."""
    from memserve.model_files.gguf_convert import ensure_model_dir

    return ensure_model_dir(None)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer files alone (no weights), for gateway tests on a fake engine."""
    from helpers.tokenizer_files import smollm2_tokenizer_folder

    return smollm2_tokenizer_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder: Path):
    from memserve.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(tokenizer_folder)


@pytest.fixture(scope="session")
def memserve_server(tmp_path_factory):
    """One live server for the end-to-end tests: float32 weights and products (the GGUF file
    widened, ``--quantization none``: the default's decode rows quantize their activations)
    so that greedy output and log-probabilities can be compared with transformers, a
    modest KV pool."""
    handle = start_server(["--num-blocks", str(SERVER_NUM_BLOCKS), "--quantization", "none"],
                          tmp_path_factory.mktemp("server") / "memserve.log", cwd=REPO)
    yield handle
    stop_server(handle)
