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
otherwise copy and attend over mostly padding each layer. The query heads that share a KV
head are folded into that head's query rows (GQA without reading each key once per query
head); with as many rows, bf16 is attended in bf16. Prefill chunks are attended per
sequence, causally aligned bottom-right so that chunks after a cached prefix see the whole
prefix. Through SDPA on CPU, such a chunk is attended without a mask where that is faster
(``PrefillSequence.prefix_path``): after a short prefix with zero query rows in front of
it, after a long one as the prefix and its own triangle merged by their log-sum-exps.

On CPU, a prefill chunk goes either to torch's SDPA or to the blocked path, whichever
``prefill_probe`` measured faster on this CPU (``AttentionMetadata.cpu_prefill``). The
blocked path (with oneDNN) attends PREFILL_QUERY_BLOCK queries at a time:
the block's scores against the keys up to its last position are one oneDNN GEMM per KV
head, its own causal triangle masked, then softmax and a second GEMM with the values
(FlashAttention's blocking without its online softmax: a block's scores fit in L2). Keys
past a block's last query are never touched, where SDPA with a bottom-right mask computes
them all, and both products run at oneDNN's speed: on AMD CPUs torch's float32 matmul (and
the SDPA CPU kernel's) goes to MKL's AVX2 path at less than half of it. bf16 chunks are
attended in float32 (bf16 scores halved greedy agreement with float32). Measured 1.3-1.9x
SDPA in float32 and 1.4-2x in bf16 on AMD EPYC, but 0.2x in bf16 and 0.6-0.9x in float32
on an Intel Xeon with AMX, where SDPA's flash kernel runs bf16 on the tile units
(benchmarks/micro/prefill_attention_micro.py).

On CPU, decode rows go to a compiled kernel (cpu_kernels, csrc/paged_decode.cpp) that
reads each row's blocks in place, unless ``--cpu-attention torch`` or it cannot be built;
the grouped, gathered SDPA path below is then what runs. A chunk of at most
KERNEL_MAX_QUERIES tokens (a decode with speculative drafts, a short follow-up prompt) is
attended as that many kernel rows, query j seeing the keys up to its own position: a
sequence's rows are adjacent work items, so its blocks are read from DRAM about once and
from cache after, while a prefill plan costs a dozen ops per sequence and layer, which
for 16 such chunks outweighed the verify step's products.

On CPU, a decode group of at least DECODE_CHUNK_MIN_TOKENS padded context tokens (and
more than one chunk) never has its padded context materialised: it is gathered and
attended DECODE_CHUNK_BLOCKS (16) block columns at a time, each chunk by torch's CPU flash
kernel (the private op, the one fused kernel that also returns the log-sum-exp), and the
chunks merged by their log-sum-exp (flash-decoding). A 256-token chunk stays in cache from
its copy to its use; one multi-megabyte gather does not. Measured 1.1-1.5x faster
(float32; more in bf16) from 8 x 1024 tokens up, and slower below, where everything fits
in cache and the merge's ops cost more than they save: hence the rule
(benchmarks/micro/paged_attention_micro.py).
Reading blocks strictly in place measured slower everywhere: a one-block-column loop pays
~10 ops per column per layer (0.02-0.7x), and torch 2.13's inductor flex_attention over
the cache as one long key sequence costs time that grows with the pool (0.01-0.05x over
4k blocks), compiles for tens of seconds per batch size, and does not compile at batch 1.

On CUDA with ``--attention-backend xformers`` (what ``auto`` resolves to where the Triton
kernel cannot run and xformers imports: attention_backend.py), the whole batch instead goes
through one memory-efficient-attention call with a block-diagonal, bottom-right-causal
mask over per-sequence padded keys. That path cannot run in the CPU test suite; the SDPA
path is the tested reference.

With ``--attention-backend triton`` a plan holds only the kernel's arguments
(``TritonBatch``, triton_batch.py: where each sequence's rows start, its context length
and block table, int32 on the device, made once per step and shared by every layer and
window), and each layer is one launch of the Triton kernel (triton_attention.py) over all
the step's rows, prefill chunks, decode rows and speculative verify rows alike: K/V are
read in place through the block tables, the kernel applies GQA, windows and soft-caps
itself, and nothing is gathered, padded or masked here. A chunk with nothing cached
before it attends its K/V as the cache holds them (an FP8 cache's rounded values), not as
computed. On the CPU the kernel runs only under Triton's interpreter, which is how the
tests check this path.

A decode batch replayed from a CUDA graph (``decode_graphs.py``) has a plan of its own,
``AttentionPlan.static``: built from device tensors by device ops alone (a graph cannot
read host data), every row attends its whole fixed-width block table, masked past its
context length; with the triton backend it holds the kernel's arguments instead
(``TritonBatch.static``), and the graph captures the kernel's launches. The CPU tests run
it eagerly against the other paths.

A sliding window W (Mistral's ``sliding_window``; ``AttentionPlan.window``) limits each
query at position p to the keys at positions p - W < j <= p: the kernel starts each row
at its window, the SDPA paths mask keys before it (decode groups are then attended in one
call, not chunked), the blocked prefill skips and masks them and the Triton kernel starts
each row's keys at its window too; xformers and the static plan know no window, so with
xformers a windowed batch takes the SDPA path on CUDA, and a windowed model is not
captured in CUDA graphs. The cache still holds every token (prefix reuse is by
position, as without a window). A model whose layers have different windows (Gemma's
sliding and global layers) builds one plan per window.

Soft-capped attention (Gemma 2's ``attn_logit_softcapping``; ``AttentionPlan.softcap``)
turns each scaled score s into cap * tanh(s / cap) before the softmax. SDPA and torch's
flash kernel cannot do that, so where it is set the SDPA paths compute the scores
explicitly (``_softcapped_attention``; decode groups are then attended in one call, not
chunked), the blocked prefill, the CPU kernel and the Triton kernel cap their scores
themselves, and xformers, which cannot cap them either, gives way to the SDPA path on
CUDA; a soft-capped model is not captured in CUDA graphs.

An FP8 KV cache (``--kv-cache-dtype fp8``: pools of float8_e4m3fn, per-tensor scale 1.0)
holds K and V clamped to e4m3's range and rounded as ``write_kv`` stores them
(``store_kv``). Attention reads them widened to the queries' dtype: every gathered path
widens its gather (``AttentionPlan.gather``'s ``dtype``), the CPU kernel widens each
element as it reads it, and a prefill chunk with nothing cached before it attends its
own K and V as computed, before rounding (as vLLM does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memserve.workers.model import cpu_kernels
from memserve.workers.model.triton_batch import TritonBatch, triton_paged_attention

try:  # xformers is optional and CUDA-only; the SDPA path below is the reference.
    from xformers.ops import memory_efficient_attention_forward as _xformers_attention
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalWithOffsetPaddedKeysMask
except ImportError:  # pragma: no cover - depends on the installation
    _xformers_attention = None


def xformers_available() -> bool:
    """Whether xformers' attention imported (installed, and built for this torch)."""
    return _xformers_attention is not None


KV_LAYOUTS = ("aggregated", "layer-major")
CPU_ATTENTIONS = ("kernel", "torch")
# A decode sequence joins a group of longer ones only while the padding it adds stays
# under both bounds (tokens, share of the group's width); past them, one more batched call
# per layer costs less than copying and attending over the padding.
DECODE_GROUP_MAX_PAD_TOKENS = 128
DECODE_GROUP_MAX_PAD_SHARE = 0.25
# On CPU, a decode group of at least this many (padded) context tokens in all is gathered
# and attended DECODE_CHUNK_BLOCKS block columns at a time (see the module docstring).
DECODE_CHUNK_MIN_TOKENS = 8192
DECODE_CHUNK_BLOCKS = 16
# On CPU with the kernel, a chunk of at most this many queries is attended as decode rows
# (one per query); longer chunks take the blocked prefill, which reads the keys once.
KERNEL_MAX_QUERIES = 8
# Queries per block of the CPU prefill path: from 64 to 128 measured the same or better
# at 1 and 2 threads; 256 rows of scores per query head fall out of the L2 cache.
PREFILL_QUERY_BLOCK = 128
# On CPU, an SDPA prefill chunk of at least this many queries after a cached prefix is
# attended without a mask: padded (``_padded_causal``) where the prefix is at most a
# quarter of the chunk, else as two flash calls merged (``_prefix_then_causal``); shorter
# chunks with the mask, which costs them no more (benchmarks/micro/prefill_attention_micro.py).
PREFIX_PATH_MIN_QUERIES = 256


@dataclass
class AttentionMetadata:
    """What the model runner tells attention about one flattened batch of T new tokens."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset where each new K/V goes
    query_start_loc: list[int]  # [num_seqs + 1]: offsets of each sequence's new tokens in the batch
    context_lens: list[int]  # [num_seqs]: tokens in the sequence's KV after this step (incl. new ones)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] long, padded with 0
    block_size: int
    layout: str = "aggregated"
    cpu_attention: str = "kernel"  # kernel: CPU decode rows through cpu_kernels where it builds; torch: SDPA
    cpu_prefill: str = "blocked"  # blocked: CPU prefill chunks through _blocked_prefill (needs oneDNN); sdpa: SDPA
    # sdpa: the gathered torch paths; xformers: one xformers call on CUDA where a plan has no
    # window or soft-cap; triton: the Triton kernel (attention_backend.py resolves --attention-backend)
    attention_backend: str = "sdpa"


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
    chunks: list[DecodeChunk]  # empty: attended in one call


@dataclass
class KernelDecodes:
    """Every decode row of the batch, for the compiled CPU kernel: no groups, no padding."""

    tokens: slice | torch.Tensor  # their rows in the flat batch
    block_tables: torch.Tensor  # [rows, blocks needed by the longest] int64
    context_lens: torch.Tensor  # [rows] int64


@dataclass
class DecodeChunk:
    """DECODE_CHUNK_BLOCKS block columns of a decode group, attended on their own."""

    start: int  # first key position
    masked: bool  # some row ends inside (or before) this chunk
    empty_rows: torch.Tensor | None  # [B, 1, 1] 0 / -inf: -inf where a row ends before it


@dataclass
class PrefillSequence:
    """One sequence with several new tokens (a prompt or a chunk of one)."""

    tokens: slice
    block_ids: torch.Tensor | None  # blocks holding its context; None = no cached prefix
    context_len: int
    causal_mask: torch.Tensor | None  # [1, 1, q, context] bool; None = plain causal (no prefix) or blocked
    prefix_path: str = ""  # after a cached prefix without a mask: "padded" (_padded_causal) or "split"


@dataclass
class XformersBatch:
    """The whole batch as one xformers call: keys gathered per sequence, padded."""

    block_tables: torch.Tensor  # [num_seqs, blocks needed by the longest]
    bias: object  # BlockDiagonalCausalWithOffsetPaddedKeysMask


@dataclass
class StaticDecode:
    """A decode batch of fixed shape (one new token per row), every row attending its
    whole block table: what a CUDA graph captures."""

    block_tables: torch.Tensor  # [B, W] long
    key_mask: torch.Tensor  # [B, 1, 1, W * block_size] bool, True = attend


@dataclass
class AttentionPlan:
    """Everything the layers need, derived once per forward from AttentionMetadata."""

    layout: str
    write_blocks: torch.Tensor  # [T] block id of each new token's slot
    write_offsets: torch.Tensor  # [T] offset inside that block
    decodes: list[DecodeGroup]
    prefills: list[PrefillSequence]
    xformers: XformersBatch | None
    blocked_prefill: bool = False  # prefills through _blocked_prefill (CPU with oneDNN, when chosen)
    kernel_decodes: KernelDecodes | None = None  # decode rows for the CPU kernel (then ``decodes`` is empty)
    static_decode: StaticDecode | None = None  # the whole batch, when the plan is ``static``
    window: int = 0  # sliding window: each query sees its last ``window`` keys; 0: all of them
    softcap: float = 0.0  # scores soft-capped at this value (Gemma 2); 0: not capped
    triton: TritonBatch | None = None  # the whole batch through the Triton kernel (then nothing else is planned)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def static(cls, slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
               layout: str, backend: str = "sdpa", row_tokens: int = 1) -> AttentionPlan:
        """The plan of a batch of B rows of ``row_tokens`` new tokens each held in device
        tensors (slots [B * row_tokens], context_lens [B], block_tables [B, W]), built by
        device ops alone so that a CUDA graph captures it: the Triton kernel's arguments
        with ``backend`` triton, else (one token a row) a gathered SDPA plan."""
        if backend == "triton":
            return cls(layout, slots // block_size, slots % block_size, [], [], None,
                       triton=TritonBatch.static(context_lens, block_tables, row_tokens))
        if row_tokens != 1:
            raise ValueError("a static plan of rows of several tokens needs the triton backend")
        key_pos = torch.arange(block_tables.shape[1] * block_size, device=slots.device)
        key_mask = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]
        return cls(layout, slots // block_size, slots % block_size, [], [], None,
                   static_decode=StaticDecode(block_tables, key_mask))

    @classmethod
    def static_windows(cls, slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       block_size: int, layout: str, backend: str, windows: Iterable[int],
                       softcap: float = 0.0, row_tokens: int = 1) -> dict[int, AttentionPlan]:
        """``static``'s plan for each distinct window of a model's layers. Windows and
        soft-caps only through the Triton kernel: the static SDPA plan applies neither."""
        plan = cls.static(slots, block_tables, context_lens, block_size, layout, backend, row_tokens)
        if plan.triton is not None:
            return plan.for_windows(windows, softcap)
        if any(windows) or softcap:
            raise ValueError("a static decode plan applies windows and soft-caps only with the triton backend")
        return {0: plan}

    def for_windows(self, windows: Iterable[int], softcap: float) -> dict[int, AttentionPlan]:
        """This Triton plan for each distinct window of ``windows``: one TritonBatch for all,
        so a step's device tensors are made once, whatever the windows."""
        assert self.triton is not None
        return {w: dataclasses.replace(self, window=w, softcap=softcap, _buffers={}) for w in dict.fromkeys(windows)}

    @classmethod
    def build(cls, meta: AttentionMetadata, device: torch.device, window: int = 0,
              softcap: float = 0.0) -> AttentionPlan:
        if meta.layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {meta.layout!r}; expected one of {KV_LAYOUTS}")
        bs = meta.block_size
        slots = meta.slot_mapping.to(device, non_blocking=True)
        block_tables = meta.block_tables.to(device, non_blocking=True)
        starts, ctx = meta.query_start_loc, meta.context_lens
        if meta.attention_backend == "triton":
            triton = TritonBatch.build(starts, ctx, block_tables, device)
            return cls(meta.layout, slots // bs, slots % bs, [], [], None, window=window, softcap=softcap,
                       triton=triton)
        query_lens = [starts[i + 1] - starts[i] for i in range(len(ctx))]
        # xformers applies neither a window nor a soft-cap: such plans take the SDPA path.
        if (meta.attention_backend == "xformers" and device.type == "cuda" and _xformers_attention is not None
                and not window and not softcap):
            max_blocks = _blocks_for(max(ctx), bs)
            bias = BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=query_lens, kv_padding=max_blocks * bs, kv_seqlen=ctx, device=device
            )
            xformers = XformersBatch(block_tables[:, :max_blocks], bias)
            return cls(meta.layout, slots // bs, slots % bs, [], [], xformers)

        use_kernel = device.type == "cpu" and meta.cpu_attention == "kernel" and cpu_kernels.available()
        most_rows = KERNEL_MAX_QUERIES if use_kernel else 1  # a chunk of at most this many queries: decode rows
        decode_seqs = [i for i, q in enumerate(query_lens) if q <= most_rows]
        blocked = device.type == "cpu" and meta.cpu_prefill == "blocked" and torch.backends.mkldnn.is_available()
        prefills = [
            _plan_prefill(slice(starts[i], starts[i + 1]), block_tables[i], ctx[i], bs, device, blocked, window,
                          softcap)
            for i, q in enumerate(query_lens)
            if q > most_rows
        ]
        if decode_seqs and use_kernel:
            # Query j of a chunk of q tokens ending at ctx sees the first ctx - q + 1 + j keys.
            rows = [(starts[i] + j, i, ctx[i] - query_lens[i] + 1 + j) for i in decode_seqs
                    for j in range(query_lens[i])]
            lens = [n for _, _, n in rows]
            kernel = KernelDecodes(_as_index([t for t, _, _ in rows], device),
                                   block_tables[_as_index([i for _, i, _ in rows], device), : _blocks_for(max(lens), bs)],
                                   torch.tensor(lens, dtype=torch.long))
            return cls(meta.layout, slots // bs, slots % bs, [], prefills, None, blocked, kernel, window=window,
                       softcap=softcap)
        decodes = [_plan_decode(group, starts, ctx, block_tables, bs, device, window, softcap)
                   for group in decode_groups(decode_seqs, ctx)]
        return cls(meta.layout, slots // bs, slots % bs, decodes, prefills, None, blocked, window=window,
                   softcap=softcap)

    @classmethod
    def build_windows(cls, meta: AttentionMetadata, device: torch.device, windows: Iterable[int],
                      softcap: float = 0.0) -> dict[int, AttentionPlan]:
        """One plan per distinct window of a model's layers (Gemma's sliding and global
        layers); Triton plans differ by their window alone (``for_windows``)."""
        first, *rest = distinct = list(dict.fromkeys(windows))
        plan = cls.build(meta, device, first, softcap)
        if plan.triton is not None:
            return plan.for_windows(distinct, softcap)
        return {first: plan, **{w: cls.build(meta, device, w, softcap) for w in rest}}

    def gather(self, cache: torch.Tensor, block_tables: torch.Tensor, buffer: str,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """[..., blocks] block ids -> [..., heads, blocks * block_size, dim] keys or values,
        in ``dtype`` (the compute dtype; None: the cache's): an FP8 cache's blocks are
        widened after the gather.

        Copies into a buffer that every layer reuses: a fresh multi-megabyte tensor per
        layer costs page faults that doubled CPU decode time. index_select copies whole
        blocks and is several times faster than advanced indexing on CPU."""
        shape = (block_tables.numel(), *cache.shape[1:])
        out = self.scratch(buffer, shape, cache.dtype, cache.device)
        torch.index_select(cache, 0, block_tables.flatten(), out=out)
        if dtype is not None and dtype != cache.dtype:
            out = self.scratch(f"{buffer}-wide", shape, dtype, cache.device).copy_(out)
        tokens = out.view(*block_tables.shape[:-1], -1, *cache.shape[-2:])
        return tokens.transpose(-3, -2)

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                zeroed: bool = False) -> torch.Tensor:
        """The reused buffer ``name``, made anew (of zeros where ``zeroed``) where its shape
        or dtype changed."""
        out = self._buffers.get(name)
        if out is None or out.shape != shape or out.dtype != dtype:
            out = self._buffers[name] = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
        return out

    def additive_mask(self, group: DecodeGroup, dtype: torch.dtype, buffer: str) -> torch.Tensor:
        """The group's key mask as 0 / -inf in ``dtype`` (what the CPU flash kernel takes),
        built by the first layer that needs it."""
        out = self._buffers.get(buffer)
        if out is None or out.dtype != dtype:
            out = torch.zeros(group.key_mask.shape, dtype=dtype, device=group.key_mask.device)
            out = self._buffers[buffer] = out.masked_fill_(~group.key_mask, float("-inf"))
        return out

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
    seqs: list[int], starts: list[int], ctx: list[int], block_tables: torch.Tensor, bs: int, device: torch.device,
    window: int = 0, softcap: float = 0.0,
) -> DecodeGroup:
    lens = [ctx[i] for i in seqs]
    max_blocks = _blocks_for(max(lens), bs)
    tables = block_tables[_as_index(seqs, device), :max_blocks]
    key_pos = torch.arange(max_blocks * bs, device=device)
    row_lens = torch.tensor(lens, device=device)[:, None]
    key_mask = key_pos[None, :] < row_lens
    if window:
        key_mask &= key_pos[None, :] >= row_lens - window
    chunks = []
    if (device.type == "cpu" and not window and not softcap and max_blocks > DECODE_CHUNK_BLOCKS
            and len(seqs) * max_blocks * bs >= DECODE_CHUNK_MIN_TOKENS):
        for start in range(0, max_blocks * bs, DECODE_CHUNK_BLOCKS * bs):
            empty = [n <= start for n in lens]
            empty_rows = None
            if any(empty):
                empty_rows = torch.tensor([float("-inf") if e else 0.0 for e in empty], device=device).view(-1, 1, 1)
            chunks.append(DecodeChunk(start, min(lens) < start + DECODE_CHUNK_BLOCKS * bs, empty_rows))
    return DecodeGroup(_as_index([starts[i] for i in seqs], device), tables, key_mask[:, None, None, :], chunks)


def _plan_prefill(
    tokens: slice, block_table: torch.Tensor, context_len: int, bs: int, device: torch.device, blocked: bool,
    window: int = 0, softcap: float = 0.0,
) -> PrefillSequence:
    query_len = tokens.stop - tokens.start
    # None: nothing cached before this chunk, it attends to its own K/V.
    blocks = block_table[: _blocks_for(context_len, bs)] if context_len > query_len else None
    # No mask: the blocked path masks its own triangle (and window), and SDPA's is_causal
    # covers a chunk without prefix or window whose scores are not capped.
    if blocked or (blocks is None and not 0 < window < context_len and not softcap):
        return PrefillSequence(tokens, blocks, context_len, None)
    if blocks is not None and not window and not softcap and device.type == "cpu" \
            and query_len >= PREFIX_PATH_MIN_QUERIES:
        path = "padded" if 4 * (context_len - query_len) <= query_len else "split"
        return PrefillSequence(tokens, blocks, context_len, None, prefix_path=path)
    first_query_pos = context_len - query_len
    query_pos = torch.arange(first_query_pos, context_len, device=device)
    key_pos = torch.arange(context_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return PrefillSequence(tokens, blocks, context_len, mask[None, None])


def tanh_softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma's soft-capping, ``cap * tanh(x / cap)``, in x's dtype as transformers does."""
    return torch.tanh(x / cap) * cap


def store_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a pool of ``dtype`` stores it: into FP8 (scale 1.0) clamped to its range
    first, as vLLM does (torch 2.13 saturates a larger value, but its casts have turned
    one into NaN before)."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
    """Store the new tokens' K/V [T, kv_heads, dim] at their slots (in the cache's dtype)."""
    k_cache[plan.write_blocks, plan.write_offsets] = store_kv(k, k_cache.dtype)
    v_cache[plan.write_blocks, plan.write_offsets] = store_kv(v, v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write k/v [T, kv_heads, dim] into the cache (unless ``kv_written``: the layer's fused
    rotary stored them), then attend q [T, heads, dim] to each sequence's context. Returns
    [T, heads, dim]."""
    if not kv_written:
        write_kv(k_cache, v_cache, k, v, plan)
    if plan.triton is not None:
        return triton_paged_attention(q, k_cache, v_cache, plan.triton, scale, plan.window, plan.softcap)
    if plan.static_decode is not None:
        return _static_decode_attention(q, k_cache, v_cache, plan, plan.static_decode, scale)
    if plan.xformers is not None:
        return _xformers_paged_attention(q, k_cache, v_cache, plan, plan.xformers, scale)
    out = q.new_empty(q.shape)  # contiguous even where q is a view into the fused projection
    if plan.kernel_decodes is not None:
        _kernel_decode_attention(out, q, k_cache, v_cache, plan, plan.kernel_decodes, scale)
    _torch_decodes(out, q, k_cache, v_cache, plan, scale)
    _torch_prefills(out, q, k, v, k_cache, v_cache, plan, scale)
    return out


def _torch_decodes(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: AttentionPlan, scale: float) -> None:
    """The plan's decode groups through torch's attention, into ``out``."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[-2]
    for i, group in enumerate(plan.decodes):
        # GQA folded into the query length: the heads sharing a KV head are that head's
        # query rows, so each key is read once, not once per query head.
        queries = q[group.tokens].view(-1, kv_heads, num_heads // kv_heads, head_dim)
        upcast = q.device.type == "cpu" and q.dtype != torch.float32 and num_heads == kv_heads
        if group.chunks and not upcast:
            attended = _chunked_decode(queries, k_cache, v_cache, plan, group, f"decode-{i}", scale)
            out[group.tokens] = attended.reshape(-1, num_heads, head_dim)
            continue
        keys = plan.gather(k_cache, group.block_tables, f"decode-{i}-k", q.dtype)
        values = plan.gather(v_cache, group.block_tables, f"decode-{i}-v", q.dtype)
        if upcast:
            # torch's CPU kernel attends a single query row in bf16 several times slower
            # than in float32 (measured, torch 2.13; from 2 rows on bf16 is the faster):
            # upcasting the gathered context is far cheaper.
            queries = queries.float()
            keys, values = plan.to_float32(keys, f"decode-{i}-k32"), plan.to_float32(values, f"decode-{i}-v32")
        if plan.softcap:
            attended = _softcapped_attention(queries, keys, values, group.key_mask, scale, plan.softcap)
        else:
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.key_mask, scale=scale)
        out[group.tokens] = attended.reshape(-1, num_heads, head_dim).to(q.dtype)


def _torch_prefills(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, plan: AttentionPlan, scale: float) -> None:
    """The plan's prefill chunks through torch's attention (or the blocked CPU path), into ``out``."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[-2]
    for i, seq in enumerate(plan.prefills):
        if seq.block_ids is None:
            keys, values = k[seq.tokens].transpose(0, 1), v[seq.tokens].transpose(0, 1)
        else:
            keys = plan.gather(k_cache, seq.block_ids, f"prefill-{i}-k", q.dtype)[:, : seq.context_len]
            values = plan.gather(v_cache, seq.block_ids, f"prefill-{i}-v", q.dtype)[:, : seq.context_len]
        if plan.blocked_prefill:
            out[seq.tokens] = _blocked_prefill(q[seq.tokens], keys, values, scale, plan.window, plan.softcap)
            continue
        if seq.prefix_path == "padded":
            padded = plan.scratch(f"prefill-{i}-padded", (1, num_heads, seq.context_len, head_dim), q.dtype, q.device,
                                  zeroed=True)
            _padded_causal(q[seq.tokens], keys, values, scale, out[seq.tokens], padded)
            continue
        if seq.prefix_path == "split":
            _prefix_then_causal(q[seq.tokens], keys, values, scale, out[seq.tokens])
            continue
        if plan.softcap:
            assert seq.causal_mask is not None  # planned with a mask wherever scores are capped
            # The query heads sharing a KV head stacked against it: [kv_heads, group, q, dim].
            queries = q[seq.tokens].view(-1, kv_heads, num_heads // kv_heads, head_dim).permute(1, 2, 0, 3)
            attended = _softcapped_attention(queries, keys[:, None], values[:, None], seq.causal_mask, scale,
                                             plan.softcap)
            out[seq.tokens] = attended.permute(2, 0, 1, 3).reshape(-1, num_heads, head_dim)
            continue
        attended = F.scaled_dot_product_attention(
            q[seq.tokens].transpose(0, 1)[None],  # [1, heads, q, dim]
            keys[None],
            values[None],
            attn_mask=seq.causal_mask,
            is_causal=seq.causal_mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[seq.tokens] = attended[0].transpose(0, 1)


def _kernel_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             plan: AttentionPlan, rows: KernelDecodes, scale: float) -> None:
    """The decode rows through the CPU kernel, into their rows of ``out``. A run of rows
    (every decode-only step) is read and written where it lies: the kernel takes q's rows
    at their stride in the fused projection."""
    in_place = isinstance(rows.tokens, slice) and q.stride(1) == q.shape[2] and q.stride(2) == 1
    queries = q[rows.tokens] if in_place else q[rows.tokens].contiguous()
    attended = out[rows.tokens] if in_place else torch.empty_like(queries)
    cpu_kernels.paged_decode_attention(attended, queries, k_cache, v_cache, rows.block_tables, rows.context_lens,
                                       scale, plan.window, plan.softcap)
    if not in_place:
        out[rows.tokens] = attended


def _blocked_prefill(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     window: int = 0, cap: float = 0.0) -> torch.Tensor:
    """Causal attention of a prefill chunk's queries [n, heads, dim] to its context's keys
    and values [kv_heads, context, dim] (the chunk's own tokens last), PREFILL_QUERY_BLOCK
    queries at a time, both products through oneDNN (see the module docstring). With a
    sliding ``window``, a block's keys start at its first query's window, and its mask
    covers both the future and what fell out of each query's window. With ``cap``, the
    scores are soft-capped before they are masked.

    Per KV head, the query heads sharing it are stacked into one [group * block, dim]
    matrix; its scores against the keys up to the block's last position are one GEMM
    (keys as the weight), the causal triangle is masked on the block's own columns only,
    and the softmaxed scores multiply the values as the transposed product
    values^T [dim, keys] x scores^T, so that both weights are contiguous rows."""
    n, num_heads, head_dim = queries.shape
    kv_heads, context = keys.shape[:2]
    group = num_heads // kv_heads
    prefix = context - n
    dtype = queries.dtype
    # bf16 is attended in float32: oneDNN would round the scores to bf16 before the
    # softmax, and that halved bf16's greedy agreement with float32 (31 % -> 19 % of
    # outputs identical, benchmarks/real/bf16_agreement.py).
    queries = queries.float()
    keys = keys.float().contiguous()
    values_t = values.transpose(1, 2).float().contiguous()  # [kv_heads, dim, context]
    heads_first = (queries * scale).view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).contiguous()
    out = queries.new_empty(kv_heads, group, n, head_dim)
    block = min(PREFILL_QUERY_BLOCK, n)
    future = torch.full((block, block), float("-inf"), dtype=queries.dtype, device=queries.device).triu_(1)
    for start in range(0, n, block):
        stop = min(start + block, n)
        rows, end = stop - start, prefix + stop
        first = max(0, prefix + start - window + 1) if window else 0
        window_mask = _window_mask(prefix + start, rows, first, end, window, queries) if window else None
        for h in range(kv_heads):
            scores = _onednn_linear(heads_first[h, :, start:stop].reshape(group * rows, head_dim), keys[h, first:end])
            if cap:
                scores = tanh_softcap(scores, cap)
            if window_mask is None:
                scores.view(group, rows, end)[..., end - rows :].add_(future[:rows, :rows])
            else:
                scores.view(group, rows, end - first).add_(window_mask)
            probs = torch.softmax(scores, -1)
            out[h, :, start:stop] = _onednn_linear(values_t[h, :, first:end], probs).t().view(group, rows, head_dim)
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(dtype)


def _prefix_then_causal(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        out: torch.Tensor) -> None:
    """Causal attention of a chunk's queries [n, heads, dim] to keys and values [kv_heads,
    prefix + n, dim] (its own last), into ``out`` [n, heads, dim]: the cached prefix, which
    every query sees whole, and the chunk's own keys, top-left causal, as two calls of
    torch's CPU flash kernel (which takes GQA's fewer KV heads as they are and returns
    each row's log-sum-exp), merged by their log-sum-exps. SDPA with the bottom-right mask
    instead computes every score of the chunk's own triangle and reads the mask
    (benchmarks/micro/prefill_attention_micro.py)."""
    n = queries.shape[0]
    prefix = keys.shape[1] - n
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads_first = queries.transpose(0, 1)[None]  # [1, heads, n, dim]
    before, before_lse = flash(heads_first, keys[None, :, :prefix], values[None, :, :prefix], scale=scale)
    own, own_lse = flash(heads_first, keys[None, :, prefix:], values[None, :, prefix:], is_causal=True, scale=scale)
    # exp(lse_before) / (exp(lse_before) + exp(lse_own)): the prefix's share of each row's softmax.
    weight = torch.sigmoid(before_lse - own_lse).unsqueeze(-1)
    target = out.transpose(0, 1)[None]
    if queries.dtype == torch.float32:
        torch.lerp(own, before, weight, out=target)
    else:  # merged in float32, rounded once
        target.copy_(torch.lerp(own.float(), before.float(), weight))


def _padded_causal(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   out: torch.Tensor, padded: torch.Tensor) -> None:
    """The same attention as ``_prefix_then_causal``, for a short prefix: the chunk's
    queries placed after as many zero rows as the prefix has keys, so that SDPA's top-left
    ``is_causal`` is the bottom-right alignment, and the zero rows' outputs dropped. The
    waste, prefix^2 / 2 scores a head, is small beside the chunk's own where the prefix is
    at most a quarter of it (a chat prompt behind its template's cached first block).
    ``padded`` [1, heads, prefix + n, dim] is the plan's buffer that every layer reuses,
    made of zeros: only its last n rows are written."""
    n = queries.shape[0]
    context = keys.shape[1]
    padded[0, :, context - n :] = queries.transpose(0, 1)
    attended = F.scaled_dot_product_attention(padded, keys[None], values[None], is_causal=True, scale=scale,
                                              enable_gqa=True)
    out.copy_(attended[0, :, context - n :].transpose(0, 1))


def _window_mask(first_query: int, rows: int, first_key: int, end: int, window: int,
                 like: torch.Tensor) -> torch.Tensor:
    """[rows, end - first_key] 0 / -inf: query ``first_query + r`` sees key j when
    0 <= (first_query + r) - j < window."""
    query_pos = torch.arange(first_query, first_query + rows, device=like.device)[:, None]
    key_pos = torch.arange(first_key, end, device=like.device)[None, :]
    seen = (key_pos <= query_pos) & (key_pos > query_pos - window)
    return torch.zeros(seen.shape, dtype=like.dtype, device=like.device).masked_fill_(~seen, float("-inf"))


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ weight [n, k]^T through oneDNN: on AMD CPUs torch's float32 matmul goes
    to MKL's AVX2 path, at less than half oneDNN's speed (benchmarks/micro/prefill_attention_micro.py)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _softcapped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, computed explicitly (SDPA cannot cap them) in
    transformers' order: scaled, capped, masked, softmax in float32. queries [..., n, dim]
    against keys and values [..., context, dim], leading dims broadcast; ``mask`` (True:
    attend) broadcasts over the scores [..., n, context]."""
    scores = tanh_softcap(torch.matmul(queries, keys.transpose(-1, -2)) * scale, cap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(values.dtype), values)


def _chunked_decode(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    group: DecodeGroup,
    name: str,
    scale: float,
) -> torch.Tensor:
    """Flash-decoding over a decode group's block columns, DECODE_CHUNK_BLOCKS at a time:
    each chunk is gathered (small enough to stay in cache while it is attended), attended
    by torch's CPU flash kernel, which also returns its log-sum-exp, and merged into the
    running output. queries [B, kv_heads, group, dim] -> [B, kv_heads, group, dim]."""
    block_size = k_cache.shape[1]
    mask = plan.additive_mask(group, queries.dtype, f"{name}-mask") if any(c.masked for c in group.chunks) else None

    def attend(chunk: DecodeChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's output and its log-sum-exp [B, kv_heads, group, 1] (float32)."""
        first = chunk.start // block_size
        blocks = group.block_tables[:, first : first + DECODE_CHUNK_BLOCKS]
        width = blocks.shape[1] * block_size
        keys = plan.gather(k_cache, blocks, f"{name}-k{width}", queries.dtype)
        values = plan.gather(v_cache, blocks, f"{name}-v{width}", queries.dtype)
        chunk_mask = mask[..., chunk.start : chunk.start + width] if mask is not None and chunk.masked else None
        part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, attn_mask=chunk_mask, scale=scale
        )
        part_lse = part_lse.unsqueeze(-1)
        if chunk.empty_rows is not None:  # the kernel gives a row without keys lse 0, output 0
            part_lse = part_lse + chunk.empty_rows[..., None]
        return part, part_lse

    first_chunk, *rest = group.chunks
    out, lse = attend(first_chunk)
    out = out.float()
    for chunk in rest:
        part, part_lse = attend(chunk)
        merged = torch.logaddexp(lse, part_lse)
        out = out * (lse - merged).exp_() + part * (part_lse - merged).exp_()
        lse = merged
    return out.to(queries.dtype)


def _static_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, rows: StaticDecode, scale: float
) -> torch.Tensor:
    """Every row's query [T, heads, dim] against its gathered block table, masked past its
    context; GQA folded into the query length as for decode groups."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    queries = q.reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim)
    keys = plan.gather(k_cache, rows.block_tables, "static-k", q.dtype)
    values = plan.gather(v_cache, rows.block_tables, "static-v", q.dtype)
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=rows.key_mask, scale=scale)
    return attended.reshape(num_tokens, num_heads, head_dim)


def _xformers_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, batch: XformersBatch,
    scale: float,
) -> torch.Tensor:  # pragma: no cover - needs CUDA and xformers
    """All sequences in one memory-efficient-attention call. GQA uses xformers' 5-D
    [batch, tokens, kv_groups, heads_per_group, dim] form with K/V broadcast (no copy)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    blocks = batch.block_tables.flatten()
    # gather() yields [heads, tokens, dim] views; transposed back they are contiguous [tokens, heads, dim].
    keys = plan.gather(k_cache, blocks, "all-k", q.dtype).transpose(0, 1).reshape(1, -1, num_kv_heads, 1, head_dim)
    values = plan.gather(v_cache, blocks, "all-v", q.dtype).transpose(0, 1).reshape(1, -1, num_kv_heads, 1, head_dim)
    out = _xformers_attention(
        q.reshape(1, num_tokens, num_kv_heads, group, head_dim),
        keys.expand(-1, -1, -1, group, -1),
        values.expand(-1, -1, -1, group, -1),
        attn_bias=batch.bias,
        scale=scale,
    )
    return out.reshape(num_tokens, num_heads, head_dim)
