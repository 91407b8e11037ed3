"""Re-positioning cached KV blocks (position-decoupled truncation, AttentionStore §3.4).

The pool stores keys after RoPE. RoPE rotates each (i, i + head_dim/2) pair of a key by
``position * inv_freq[i]``, and rotations compose, so a key cached at position ``p`` is
turned into the key of position ``p + delta`` by one more rotation by ``delta``; values
carry no position and are copied as they are. That is what lets a conversation whose
oldest turns were truncated reuse the KV of the turns it kept, instead of recomputing
it (``KVCacheManager.reuse_truncated`` plans which blocks; this module moves tensors).

The rotation is done in float32 whatever the pool's dtype: a bf16 or FP8 key is rounded
once, on the way back into the pool, as the directly computed key is. A model whose layers
rotate with different bases (Gemma 3's sliding and global layers) shifts each layer's
keys with its own rotary."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memserve.workers.model.attention import store_kv
from memserve.workers.model.rope import RotaryEmbedding, apply_rotary


@torch.no_grad()
def shift_blocks(kv_cache: torch.Tensor, layout: str, rotary: RotaryEmbedding | Sequence[RotaryEmbedding],
                 src_blocks: list[int], dst_blocks: list[int], delta_positions: int) -> None:
    """Copy blocks ``src_blocks`` to ``dst_blocks`` of ``kv_cache`` (every layer), their
    keys moved by ``delta_positions`` positions (negative: earlier) by ``rotary``: one for
    every layer, or one per layer. The sources are left as they are; a destination must
    not be a source."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    if not src_blocks:
        return
    if layout == "aggregated":  # [blocks, layers, 2, block_size, heads, dim]
        block_dim, kv_dim, layer_dim = 0, 2, 1
    elif layout == "layer-major":  # [layers, 2, blocks, block_size, heads, dim]
        block_dim, kv_dim, layer_dim = 2, 1, 0
    else:
        raise ValueError(f"unknown KV layout {layout!r}")
    device = kv_cache.device
    blocks = kv_cache.index_select(block_dim, torch.tensor(src_blocks, device=device))  # a copy
    keys = blocks.select(kv_dim, 0)
    layers = keys.shape[layer_dim]
    rotaries = [rotary] * layers if isinstance(rotary, RotaryEmbedding) else list(rotary)
    delta = torch.tensor([delta_positions], device=device)
    tables = {r: r.cos_sin(delta, torch.float32) for r in dict.fromkeys(rotaries)}  # each [1, 1, dim]
    shape = [1] * keys.dim()
    shape[layer_dim], shape[-1] = layers, -1
    # Each layer's cos and sin, broadcast over the keys' other dims.
    cos, sin = (torch.stack([tables[r][i] for r in rotaries]).view(shape) for i in (0, 1))
    keys.copy_(store_kv(apply_rotary(keys.float(), cos, sin), keys.dtype))  # FP8: clamped as stored
    # As bytes: index_copy_ knows no FP8 (--kv-cache-dtype fp8) on CPU.
    kv_cache.view(torch.uint8).index_copy_(block_dim, torch.tensor(dst_blocks, device=device), blocks.view(torch.uint8))
