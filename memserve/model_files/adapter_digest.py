"""What a LoRA adapter's KV blocks are named by, beside its name: a digest of its files.

An adapter changes every layer's K and V, so blocks computed through it are named with it
(``kvcache/hashing.adapter_salt``). Its name alone is not enough once adapters are loaded
and unloaded at run time: a name unloaded and loaded again from other weights would find
the old weights' blocks. The digest of the files it is read from names the weights
themselves, the same in the gateway (which names blocks for routing) and in every worker,
and across restarts (a disk tier's blocks of an unchanged adapter are found again).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_CHUNK = 1 << 20


def adapter_digest(folder: str | Path) -> str:
    """The hex xxh3-128 of the adapter's config and weights, in that order; raises
    ``FileNotFoundError`` naming the file a folder that is not a PEFT adapter lacks."""
    digest = xxhash.xxh3_128()
    for name in ADAPTER_FILES:
        path = Path(folder) / name
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not a LoRA adapter: it has no {name}")
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()
