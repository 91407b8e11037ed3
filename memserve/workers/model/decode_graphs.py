"""CUDA graphs of the decode forward pass.

A decode step of a small model on a GPU is mostly kernel launches: dozens per layer,
each costing the host more time than the GPU spends running it. A CUDA graph captured
once launches them all in one call. A graph fixes the shapes and addresses of its tensors, so
one is captured per bucket, ``(batch, width, tokens)``: up to ``batch`` rows of ``tokens``
new tokens each whose contexts fit ``width`` blocks. Rows are of one token (decodes), and
with n-gram drafts and the Triton kernel also of a decode and its most drafts (a row with
fewer, or a short prefill chunk, is padded after its last token). A step runs in the
smallest bucket that holds it; its inputs are copied into that bucket's input buffer and
the rows and tokens it does not fill are padding.

Invariants:

- A graph holds the model's forward pass only (embedding to final norm) over the static
  attention plans (``AttentionPlan.static_windows``: one per window of the model's
  layers, the Triton kernel's where a model has windows or soft-capped scores), which
  read no host data: token ids, positions, slots, block tables and context lengths are
  columns of the bucket's device input buffer, and masks are computed from them on the
  device. Logits and sampling stay eager.
- Padding rows write their K/V into the scratch block, a device block past those the
  MemPool hands out, and attend it alone: they never touch a real block. Block-table
  columns past a row's context point at it too (masked). A row's padding tokens come
  after its own and write the scratch block too; in causal order only they attend past
  the row's context, and their outputs are dropped.
- A graph holds the addresses of the model's weights and of the device KV pool, both
  allocated once at start and never replaced.
- Graphs share one memory pool and are captured largest first, so that the smaller ones
  reuse its memory; a replay may therefore overwrite another graph's output, so the
  caller reads a replay's output before the next replay (the runner computes the logits
  at once).
- Layer hooks cannot run inside a graph: every ``before_layer`` runs before the replay
  (a KV load still streaming is waited for whole) and every ``after_layer`` after it.
- Buckets hold at most ``MAX_CONTEXT_TOKENS`` padded context tokens: beyond that the
  attention's reads dominate a step rather than its launches, and such steps, like
  steps with longer rows (prefill chunks), run eagerly.
- A model whose forward pass cannot be captured runs every step eagerly, for the reason
  ``eager_reason`` gives (logged at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memserve.config import EngineConfig
from memserve.workers.engine.layer_hooks import LayerHooks
from memserve.workers.engine.ngram_proposer import NgramConfig
from memserve.workers.model.attention import AttentionPlan
from memserve.workers.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE

MAX_CONTEXT_TOKENS = 1 << 16  # batch * width * block_size of the largest bucket
MIN_WIDTH_BLOCKS = 8  # the narrowest bucket: padding a short context costs little
# Attention kernels a graph may capture: the memory-efficient one takes the padding mask
# (flash takes none); cuDNN's is left out, its support for capture varying with versions.
CAPTURED_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
# torch's grouped GEMM (F.grouped_mm, the MoE experts) runs its CUTLASS kernel, offsets read
# on the device, for bfloat16 on these major compute capabilities (Hopper, Blackwell); its
# fallback copies the offsets to the host (aten/src/ATen/native/cuda/GroupedBlas.cpp).
GROUPED_MM_DEVICE_MAJORS = (9, 10)

# Captures ``forward``: returns the replay and the output tensor each replay refills.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """start, 2 * start, ... below ``limit``, then ``limit`` itself."""
    out = []
    n = start
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


def decode_buckets(max_batch: int, max_blocks: int, block_size: int) -> list[tuple[int, int]]:
    """Every (batch, width) captured, largest first."""
    widths = powers_of_two_up_to(max_blocks, min(MIN_WIDTH_BLOCKS, max_blocks))
    buckets = [(b, w) for b in powers_of_two_up_to(max_batch) for w in widths
               if b * w * block_size <= MAX_CONTEXT_TOKENS]
    return sorted(buckets, key=lambda bw: (bw[0] * bw[1], bw), reverse=True)


def eager_reason(model: LlamaForCausalLM, backend: str, dtype: torch.dtype, capability: tuple[int, int],
                 tp_size: int, lora: bool) -> str | None:
    """Why ``model``'s decode steps run eagerly on a GPU of compute ``capability`` with
    attention ``backend``; None where graphs capture them."""
    config = model.config
    if (any(model.layer_windows) or config.attn_logit_softcapping is not None) and backend != "triton":
        return ("its sliding windows or soft-capped scores are applied, among the paths a graph captures, by the "
                "Triton kernel alone (--attention-backend triton)")
    if config.sparse_layers and not (dtype == torch.bfloat16 and capability[0] in GROUPED_MM_DEVICE_MAJORS):
        return ("torch's grouped GEMM of its experts reads their row offsets on the host except in bfloat16 on "
                "compute capability 9.x or 10.x, and a graph cannot capture a read by the host")
    if tp_size > 1:
        return "its ranks' collectives follow rank 0's plan step by step, which the graphs do not capture"
    if lora:
        return "a graph would replay the LoRA rows of the step it was captured in"
    return None


def graph_row_tokens(cfg: EngineConfig, backend: str) -> tuple[int, ...]:
    """The new tokens a row of a captured step may have: one (a decode), and with n-gram
    drafts and the Triton kernel also a decode and its most drafts (fewer are padded)."""
    if cfg.speculative_config and backend == "triton":
        return 1, 1 + NgramConfig.from_dict(cfg.speculative_config).num_speculative_tokens
    return (1,)


def cuda_graph(forward: Callable[[], torch.Tensor], pool: _POOL_HANDLE) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``forward`` into a CUDA graph drawing on memory pool ``pool``. One eager run
    on a side stream first (as torch's documentation asks) initialises what is created
    lazily: library handles, workspaces, the rotary table on the device."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the KV copy threads may call CUDA meanwhile; only this thread's calls
    # must be capturable.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph.replay, out


@dataclass
class _Graph:
    inputs: torch.Tensor  # [batch, input_columns(tokens) + width] long, on the device
    replay: Callable[[], None]
    out: torch.Tensor  # [batch * tokens, hidden]


def input_columns(tokens: int) -> int:
    """Columns of a row of ``tokens`` new tokens before its block table: their ids,
    positions and slots, then the row's context length."""
    return 3 * tokens + 1


class DecodeGraphs:
    """The decode graphs of one model over one KV pool, for rows of each of ``row_tokens``
    new tokens (1: decode rows; 1 + k: a decode and its k drafts, with the Triton kernel)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, layout: str, block_size: int,
                 scratch_block: int, max_batch: int, max_blocks: int, attention_backend: str = "sdpa",
                 row_tokens: tuple[int, ...] = (1,)) -> None:
        if max(row_tokens) > 1 and attention_backend != "triton" or max(row_tokens) > block_size:
            raise ValueError(f"rows of {max(row_tokens)} tokens are captured only with the triton backend, "
                             f"and at most a block ({block_size}) of them")
        self.model = model
        self.attention_backend = attention_backend  # triton: the graphs capture the Triton kernel's launches
        self.kv_cache = kv_cache
        self.layout = layout
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.row_tokens = sorted(row_tokens)
        self.buckets = [(b, w, q) for b, w in decode_buckets(max_batch, max_blocks, block_size)
                        for q in reversed(self.row_tokens)]
        self._graphs: dict[tuple[int, int, int], _Graph] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def capture(self, capture: Capture | None = None) -> None:
        """Capture every bucket (``capture``: CUDA graphs in one shared pool, by default).
        Inputs are all padding meanwhile, so only the scratch block is written."""
        if capture is None:
            capture = partial(cuda_graph, pool=torch.cuda.graph_pool_handle())
        for batch, width, tokens in self.buckets:
            inputs = torch.tensor([self._padding(width, tokens)] * batch, dtype=torch.long,
                                  device=self.kv_cache.device)
            replay, out = capture(partial(self._forward, inputs, tokens))
            self._graphs[(batch, width, tokens)] = _Graph(inputs, replay, out)

    def _forward(self, inputs: torch.Tensor, tokens: int) -> torch.Tensor:
        ids, positions, slots = (inputs[:, i * tokens: (i + 1) * tokens].flatten() for i in range(3))
        columns = input_columns(tokens)
        plans = AttentionPlan.static_windows(slots, inputs[:, columns:], inputs[:, columns - 1], self.block_size,
                                             self.layout, self.attention_backend, self.model.layer_windows,
                                             self.model.config.attn_logit_softcapping or 0.0, tokens)
        with sdpa_kernel(CAPTURED_ATTENTION):
            return self.model.forward_planned(ids, positions, self.kv_cache, plans)

    def _padding(self, width: int, tokens: int) -> list[int]:
        """A padding row: token 0 at positions 0 on, written to and attending the scratch block."""
        scratch = self.scratch_block * self.block_size
        return ([0] * tokens + list(range(tokens)) + [scratch + j for j in range(tokens)] + [tokens]
                + [self.scratch_block] * width)

    def bucket(self, rows: int, blocks: int, tokens: int) -> tuple[int, int, int] | None:
        """The smallest captured bucket holding ``rows`` rows of ``tokens`` new tokens (padded
        to them) and at most ``blocks`` blocks each."""
        fits = [(b * w, (b, w, q)) for b, w, q in self._graphs if b >= rows and w >= blocks and q == tokens]
        return min(fits)[1] if fits else None

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], query_start_loc: list[int],
            context_lens: list[int], tables: list[list[int]], hooks: LayerHooks) -> torch.Tensor | None:
        """The hidden states [tokens, hidden] of a step whose sequences' new tokens (rows
        ``query_start_loc``) fit a bucket's graph; None when none holds it (the caller runs
        it eagerly). A row of fewer tokens than its bucket's is padded after its last:
        those tokens write the scratch block, sit at its last token's position, and only
        they attend past its context (causal order), so its own tokens are untouched."""
        counts = [end - start for start, end in zip(query_start_loc, query_start_loc[1:])]
        tokens = next((q for q in self.row_tokens if q >= max(counts)), 0)
        widest = max(-(-(n + tokens - c) // self.block_size) for n, c in zip(context_lens, counts))
        key = self.bucket(len(counts), widest, tokens)
        if key is None:
            return None
        batch, width, tokens = key
        graph = self._graphs[key]
        scratch = self.scratch_block * self.block_size
        rows = []
        for r, (count, context, table) in enumerate(zip(counts, context_lens, tables)):
            rows_of = slice(query_start_loc[r], query_start_loc[r + 1])
            pad = tokens - count
            table = table[: -(-(context + pad) // self.block_size)]
            rows.append(input_ids[rows_of] + [0] * pad + positions[rows_of] + [positions[rows_of][-1]] * pad
                        + slots[rows_of] + [scratch + j for j in range(pad)] + [context + pad]
                        + table + [self.scratch_block] * (width - len(table)))
        rows += [self._padding(width, tokens)] * (batch - len(rows))
        graph.inputs.copy_(torch.tensor(rows, dtype=torch.long))
        num_layers = len(self.model.model.layers)
        for layer in range(num_layers):
            hooks.before_layer(layer)
        graph.replay()
        for layer in range(num_layers):
            hooks.after_layer(layer)
        if tokens == 1:
            return graph.out[: len(input_ids)]
        taken = [r * tokens + j for r, count in enumerate(counts) for j in range(count)]
        return graph.out[torch.tensor(taken, device=graph.out.device)]
