"""A Hugging Face repo id (``Qwen/Qwen3-0.6B``) served as ``vllm serve`` serves it: from
the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, snapshot of the ``main`` ref) when it is there, else
downloaded into that cache through ``huggingface_hub`` (its progress bars on stderr).

Only what a model folder needs is fetched (config and generation JSON, safetensors
weights, tokenizer files, chat templates), not the other formats a repo may also carry.
With ``HF_HUB_OFFLINE=1`` nothing is downloaded: a repo id that is not cached is a clear
error at once, as is a download that fails (no network, no such repo, no access)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# A model folder's files: config, weights, tokenizer, chat template.
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_repo_id(model: str) -> bool:
    """``org/name`` that names no file or folder here."""
    return bool(_REPO_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE``, read now (huggingface_hub reads it once, when first imported)."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def hub_snapshot(repo_id: str) -> Path:
    """The snapshot folder of ``repo_id``: the cached one, else a download (unless offline).
    FileNotFoundError, saying why, when neither gives one."""
    from huggingface_hub import snapshot_download  # only when a repo id is served
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILE_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        if hub_offline():
            raise FileNotFoundError(
                f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: fetch it first "
                f"(`huggingface-cli download {repo_id}`), unset HF_HUB_OFFLINE, or pass a folder or a .gguf file"
            ) from None
    log.info("downloading %s from the Hugging Face Hub into its cache", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILE_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise FileNotFoundError(f"{repo_id} is not in the local Hugging Face cache and downloading it failed: "
                                f"{exc}; pass a folder or a .gguf file, or fetch it first") from None
