"""A Hugging Face repo id (``Qwen/Qwen3-0.6B``) served from the local Hugging Face cache,
as ``vllm serve`` finds it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, snapshot of the ``main`` ref.

memserve never downloads weights: a repo id that is not cached is a clear error at once,
with or without a network (``HF_HUB_OFFLINE`` changes nothing here), never a hang."""

from __future__ import annotations

import re
from pathlib import Path

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(model: str) -> bool:
    """``org/name`` that names no file or folder here."""
    return bool(_REPO_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of ``repo_id``; FileNotFoundError when it is not cached."""
    from huggingface_hub import snapshot_download  # only when a repo id is served
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id} is not in the local Hugging Face cache: memserve does not download models; "
            f"fetch it first (`huggingface-cli download {repo_id}`) or pass a folder or a .gguf file"
        ) from None
