"""Block names: a chained xxhash of each full block's tokens and its parent's name.

The name of block i depends on every token before it, so one name identifies a whole
prefix. Workers (radix index), KV events and the gateway's mirrors all use these names,
which is what lets the router see exactly what each worker has cached.

Chaining uses xxh3_64's seed: ``name_i = xxh3_64(le_uint32(tokens of block i),
seed=name_{i-1})``, with a fixed seed for the first block (``ROOT_SEED``, or for a prompt
with a ``cache_salt`` a seed derived from the salt: ``salt_seed``, so that every name of a
salted prompt differs from the unsalted and other salts' names of the same tokens).
Tokens are packed once per call with ``array`` (about 7 ns a token), then hashed block by
block (about 130 ns a block).
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Sequence

import xxhash

ROOT_SEED = 0x6D656D7365727665  # b"memserve": the "parent" of a prompt's first block

_SALT_DOMAIN = b"memserve.cache_salt\0"

_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)
_hash = xxhash.xxh3_64_intdigest
_ADAPTER_PREFIX = '["lora", '  # how every ``adapter_salt`` of an adapter begins


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes."""
    if isinstance(tokens, array) and tokens.typecode == _TYPECODE:
        packed = tokens
    else:
        packed = array(_TYPECODE, tokens)
    if sys.byteorder == "big":
        packed = array(_TYPECODE, packed)
        packed.byteswap()
    return packed.tobytes()


def salt_seed(salt: str | None) -> int:
    """The seed of a prompt's first block: ``ROOT_SEED`` without a salt, else a hash of
    the salt seeded with it (vLLM's ``cache_salt``)."""
    if not salt:
        return ROOT_SEED
    return _hash(_SALT_DOMAIN + salt.encode("utf-8"), ROOT_SEED)


def adapter_salt(salt: str | None, lora_name: str | None, lora_digest: str = "") -> str | None:
    """The salt a request's blocks are named with under LoRA adapter ``lora_name`` whose
    files have digest ``lora_digest`` (``model_files/adapter_digest.py``): an adapter
    changes every layer's K and V, so its blocks must never be found by the base model,
    another adapter or other weights loaded under its name, in any tier, transfer, mirror
    or event. A salt without an adapter is unchanged, unless it spells an adapter's (a
    body's ``cache_salt`` can be any text): that one is wrapped, so that no base-model
    request can name, and so fill, an adapter's blocks."""
    if lora_name is not None:
        return json.dumps(["lora", lora_name, lora_digest, salt])
    if salt is not None and salt.startswith(_ADAPTER_PREFIX):
        return json.dumps(["base", salt])
    return salt



def adapter_of(salt: str | None) -> str | None:
    """The adapter name an ``adapter_salt`` holds (None: the base model's salt)."""
    if not salt or not salt.startswith(_ADAPTER_PREFIX):
        return None
    return json.loads(salt)[1]


def block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None,
                 salt: str | None = None) -> list[int]:
    """Names of the full blocks of ``tokens``; a trailing partial block has no name.

    ``parent`` is the name of the block just before ``tokens`` (None: they start a prompt),
    so a sequence can name its blocks incrementally as they fill up. ``salt`` (the
    request's ``cache_salt``) seeds the first block when ``tokens`` start a prompt; a
    ``parent`` already carries it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full = len(tokens) // block_size
    if num_full == 0:
        return []
    data = pack_tokens(tokens if len(tokens) == num_full * block_size else tokens[: num_full * block_size])
    step = block_size * 4
    h = salt_seed(salt) if parent is None else parent
    out: list[int] = []
    append = out.append
    for start in range(0, len(data), step):
        h = _hash(data[start : start + step], h)
        append(h)
    return out
