"""Attention over the paged KV cache.

The cache is one tensor for all layers. In the *aggregated* layout (MemServe's "huge
page") a block holds every layer's K and V of its tokens, so moving a request's KV is one
contiguous copy per run of blocks:

    aggregated:  [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer-major: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

Either way a layer sees its K (and V) cache as a [num_blocks, block_size, heads, dim]
view, so one code path serves both layouts.

Per forward pass, ``AttentionPlan.build`` turns the metadata into device tensors (write
indices, gather indices, masks) once; every layer reuses them, so no layer rebuilds masks
or waits on the host. Decode sequences (one new token) are attended in padded batched
calls with a key-padding mask, one per group of similar context lengths: every sequence of
a group is padded to its longest, and a short sequence batched with long ones would
otherwise copy and attend over mostly padding each layer. Prefill chunks are attended per
sequence, with a causal mask aligned bottom-right so that chunks after a cached prefix see
the whole prefix.

On CUDA with xformers installed, the whole batch instead goes through one
memory-efficient-attention call with a block-diagonal, bottom-right-causal mask over
per-sequence padded keys. That path cannot run in the CPU test suite; the SDPA path is the
tested reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # xformers is optional and CUDA-only; the SDPA path below is the reference.
    from xformers.ops import memory_efficient_attention_forward as _xformers_attention
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalWithOffsetPaddedKeysMask
except ImportError:  # pragma: no cover - depends on the installation
    _xformers_attention = None

KV_LAYOUTS = ("aggregated", "layer-major")
# A decode sequence joins a group of longer ones only while the padding it adds stays
# under both bounds (tokens, share of the group's width); past them, one more batched call
# per layer costs less than copying and attending over the padding.
DECODE_GROUP_MAX_PAD_TOKENS = 128
DECODE_GROUP_MAX_PAD_SHARE = 0.25


@dataclass
class AttentionMetadata:
    """What the model runner tells attention about one flattened batch of T new tokens."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset where each new K/V goes
    query_start_loc: list[int]  # [num_seqs + 1]: offsets of each sequence's new tokens in the batch
    context_lens: list[int]  # [num_seqs]: tokens in the sequence's KV after this step (incl. new ones)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] long, padded with 0
    block_size: int
    layout: str = "aggregated"


def kv_cache_shape(
    num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, layout: str
) -> tuple[int, ...]:
    if layout == "aggregated":
        return (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    if layout == "layer-major":
        return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    raise ValueError(f"unknown KV layout {layout!r}; expected one of {KV_LAYOUTS}")


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    layout: str = "aggregated",
) -> torch.Tensor:
    """A zeroed KV pool. Zeroed, not empty: padded key slots are masked out, but their
    values still enter the attention matmul with weight 0, and 0 * NaN would be NaN."""
    shape = kv_cache_shape(num_blocks, num_layers, block_size, num_kv_heads, head_dim, layout)
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_kv(kv_cache: torch.Tensor, layer: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (K, V) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    if layout == "aggregated":
        return kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    if layout == "layer-major":
        return kv_cache[layer, 0], kv_cache[layer, 1]
    raise ValueError(f"unknown KV layout {layout!r}; expected one of {KV_LAYOUTS}")


@dataclass
class DecodeGroup:
    """Sequences with exactly one new token, attended in one padded batched call."""

    tokens: slice | torch.Tensor  # their rows in the flat batch
    block_tables: torch.Tensor  # [B, blocks needed by the longest]
    key_mask: torch.Tensor  # [B, 1, 1, blocks * block_size] bool, True = attend


@dataclass
class PrefillSequence:
    """One sequence with several new tokens (a prompt or a chunk of one)."""

    tokens: slice
    block_ids: torch.Tensor | None  # blocks holding its context; None = no cached prefix
    context_len: int
    causal_mask: torch.Tensor | None  # [1, 1, q, context] bool; None = plain causal (no prefix)


@dataclass
class XformersBatch:
    """The whole batch as one xformers call: keys gathered per sequence, padded."""

    block_tables: torch.Tensor  # [num_seqs, blocks needed by the longest]
    bias: object  # BlockDiagonalCausalWithOffsetPaddedKeysMask


@dataclass
class AttentionPlan:
    """Everything the layers need, derived once per forward from AttentionMetadata."""

    layout: str
    write_blocks: torch.Tensor  # [T] block id of each new token's slot
    write_offsets: torch.Tensor  # [T] offset inside that block
    decodes: list[DecodeGroup]
    prefills: list[PrefillSequence]
    xformers: XformersBatch | None
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, meta: AttentionMetadata, device: torch.device) -> AttentionPlan:
        if meta.layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {meta.layout!r}; expected one of {KV_LAYOUTS}")
        bs = meta.block_size
        slots = meta.slot_mapping.to(device, non_blocking=True)
        block_tables = meta.block_tables.to(device, non_blocking=True)
        starts, ctx = meta.query_start_loc, meta.context_lens
        query_lens = [starts[i + 1] - starts[i] for i in range(len(ctx))]
        if device.type == "cuda" and _xformers_attention is not None:
            max_blocks = _blocks_for(max(ctx), bs)
            bias = BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=query_lens, kv_padding=max_blocks * bs, kv_seqlen=ctx, device=device
            )
            xformers = XformersBatch(block_tables[:, :max_blocks], bias)
            return cls(meta.layout, slots // bs, slots % bs, [], [], xformers)

        decode_seqs = [i for i, q in enumerate(query_lens) if q == 1]
        prefills = [
            _plan_prefill(slice(starts[i], starts[i + 1]), block_tables[i], ctx[i], bs, device)
            for i, q in enumerate(query_lens)
            if q > 1
        ]
        decodes = [_plan_decode(group, starts, ctx, block_tables, bs, device)
                   for group in decode_groups(decode_seqs, ctx)]
        return cls(meta.layout, slots // bs, slots % bs, decodes, prefills, None)

    def gather(self, cache: torch.Tensor, block_tables: torch.Tensor, buffer: str) -> torch.Tensor:
        """[..., blocks] block ids -> [..., heads, blocks * block_size, dim] keys or values.

        Copies into a buffer that every layer reuses: a fresh multi-megabyte tensor per
        layer costs page faults that doubled CPU decode time. index_select copies whole
        blocks and is several times faster than advanced indexing on CPU."""
        shape = (block_tables.numel(), *cache.shape[1:])
        out = self._buffers.get(buffer)
        if out is None or out.shape != shape or out.dtype != cache.dtype:
            out = self._buffers[buffer] = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        torch.index_select(cache, 0, block_tables.flatten(), out=out)
        tokens = out.view(*block_tables.shape[:-1], -1, *cache.shape[-2:])
        return tokens.transpose(-3, -2)

    def to_float32(self, x: torch.Tensor, buffer: str) -> torch.Tensor:
        """A contiguous float32 copy of ``x`` in a buffer that every layer reuses."""
        out = self._buffers.get(buffer)
        if out is None or out.shape != x.shape:
            out = self._buffers[buffer] = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return out.copy_(x)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _as_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when the rows are one contiguous run (free to apply), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long, device=device)


def decode_groups(seqs: list[int], context_lens: list[int]) -> list[list[int]]:
    """Decode sequences split into groups of similar context length (each group in batch
    order), so that padding each to its group's longest wastes little."""
    groups: list[list[int]] = []
    longest = 0
    for i in sorted(seqs, key=lambda i: -context_lens[i]):
        pad = longest - context_lens[i]
        if not groups or (pad > DECODE_GROUP_MAX_PAD_TOKENS and pad > DECODE_GROUP_MAX_PAD_SHARE * longest):
            groups.append([])
            longest = context_lens[i]
        groups[-1].append(i)
    return [sorted(group) for group in groups]


def _plan_decode(
    seqs: list[int], starts: list[int], ctx: list[int], block_tables: torch.Tensor, bs: int, device: torch.device
) -> DecodeGroup:
    lens = [ctx[i] for i in seqs]
    max_blocks = _blocks_for(max(lens), bs)
    tables = block_tables[_as_index(seqs, device), :max_blocks]
    key_pos = torch.arange(max_blocks * bs, device=device)
    key_mask = key_pos[None, :] < torch.tensor(lens, device=device)[:, None]
    return DecodeGroup(_as_index([starts[i] for i in seqs], device), tables, key_mask[:, None, None, :])


def _plan_prefill(
    tokens: slice, block_table: torch.Tensor, context_len: int, bs: int, device: torch.device
) -> PrefillSequence:
    query_len = tokens.stop - tokens.start
    if context_len == query_len:  # nothing cached before this chunk: attend to its own K/V
        return PrefillSequence(tokens, None, context_len, None)
    first_query_pos = context_len - query_len
    query_pos = torch.arange(first_query_pos, context_len, device=device)
    key_pos = torch.arange(context_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    return PrefillSequence(tokens, block_table[: _blocks_for(context_len, bs)], context_len, mask[None, None])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
    """Store the new tokens' K/V [T, kv_heads, dim] at their slots."""
    k_cache[plan.write_blocks, plan.write_offsets] = k
    v_cache[plan.write_blocks, plan.write_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Write k/v [T, kv_heads, dim] into the cache, then attend q [T, heads, dim] to each
    sequence's context. Returns [T, heads, dim]."""
    write_kv(k_cache, v_cache, k, v, plan)
    if plan.xformers is not None:
        return _xformers_paged_attention(q, k_cache, v_cache, plan, scale)
    out = q.new_empty(q.shape)  # contiguous even where q is a view into the fused projection
    for i, group in enumerate(plan.decodes):
        queries = q[group.tokens].unsqueeze(2)  # [B, heads, 1, dim]
        keys = plan.gather(k_cache, group.block_tables, f"decode-{i}-k")
        values = plan.gather(v_cache, group.block_tables, f"decode-{i}-v")
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # torch's CPU kernel attends one query row in bf16 30x slower than in float32
            # (measured, torch 2.13): upcasting the gathered context is far cheaper.
            queries = queries.float()
            keys, values = plan.to_float32(keys, f"decode-{i}-k32"), plan.to_float32(values, f"decode-{i}-v32")
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.key_mask, scale=scale, enable_gqa=True
        )
        out[group.tokens] = attended.squeeze(2).to(q.dtype)
    for i, seq in enumerate(plan.prefills):
        queries = q[seq.tokens].transpose(0, 1)[None]  # [1, heads, q, dim]
        if seq.block_ids is None:
            keys, values = k[seq.tokens].transpose(0, 1)[None], v[seq.tokens].transpose(0, 1)[None]
        else:
            keys = plan.gather(k_cache, seq.block_ids, f"prefill-{i}-k")[None, :, : seq.context_len]
            values = plan.gather(v_cache, seq.block_ids, f"prefill-{i}-v")[None, :, : seq.context_len]
        attended = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=seq.causal_mask,
            is_causal=seq.causal_mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[seq.tokens] = attended[0].transpose(0, 1)
    return out


def _xformers_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:  # pragma: no cover - needs CUDA and xformers
    """All sequences in one memory-efficient-attention call. GQA uses xformers' 5-D
    [batch, tokens, kv_groups, heads_per_group, dim] form with K/V broadcast (no copy)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    blocks = plan.xformers.block_tables.flatten()
    # gather() yields [heads, tokens, dim] views; transposed back they are contiguous [tokens, heads, dim].
    keys = plan.gather(k_cache, blocks, "all-k").transpose(0, 1).reshape(1, -1, num_kv_heads, 1, head_dim)
    values = plan.gather(v_cache, blocks, "all-v").transpose(0, 1).reshape(1, -1, num_kv_heads, 1, head_dim)
    out = _xformers_attention(
        q.reshape(1, num_tokens, num_kv_heads, group, head_dim),
        keys.expand(-1, -1, -1, group, -1),
        values.expand(-1, -1, -1, group, -1),
        attn_bias=plan.xformers.bias,
        scale=scale,
    )
    return out.reshape(num_tokens, num_heads, head_dim)
