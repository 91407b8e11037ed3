"""CUDA graphs of the decode forward pass.

A decode step of a small model on a GPU is mostly kernel launches: dozens per layer,
each costing the host more time than the GPU spends running it. A CUDA graph captured
once launches them all in one call. A graph fixes the shapes and addresses of its tensors, so
one is captured per bucket, ``(batch, width)``: up to ``batch`` rows of one new token each
whose contexts fit ``width`` blocks. A step runs in the smallest bucket that holds it;
its inputs are copied into that bucket's input buffer and the rows it does not fill are
padding.

Invariants:

- A graph holds the model's forward pass only (embedding to final norm) over the static
  attention plans (``AttentionPlan.static_windows``: one per window of the model's layers,
  the Triton kernel's where a model has windows or soft-capped scores), which read no host data: positions, slots,
  block tables and context lengths are columns of the bucket's device input buffer, and
  masks are computed from them on the device. Logits and sampling stay eager.
- Padding rows write their K/V into the scratch block, a device block past those the
  MemPool hands out, and attend it alone: they never touch a real block. Block-table
  columns past a row's context point at it too (masked).
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
  prefills and mixed steps, run eagerly.
- A model whose forward pass cannot be captured runs every step eagerly, for the reason
  ``eager_reason`` gives (logged at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memserve.workers.engine.layer_hooks import LayerHooks
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
INPUT_COLUMNS = 4  # token id, position, slot, context length; then the block table

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
    inputs: torch.Tensor  # [batch, INPUT_COLUMNS + width] long, on the device
    replay: Callable[[], None]
    out: torch.Tensor  # [batch, hidden]


class DecodeGraphs:
    """The decode graphs of one model over one KV pool."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, layout: str, block_size: int,
                 scratch_block: int, max_batch: int, max_blocks: int, attention_backend: str = "sdpa") -> None:
        self.model = model
        self.attention_backend = attention_backend  # triton: the graphs capture the Triton kernel's launches
        self.kv_cache = kv_cache
        self.layout = layout
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buckets = decode_buckets(max_batch, max_blocks, block_size)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def capture(self, capture: Capture | None = None) -> None:
        """Capture every bucket (``capture``: CUDA graphs in one shared pool, by default).
        Inputs are all padding meanwhile, so only the scratch block is written."""
        if capture is None:
            capture = partial(cuda_graph, pool=torch.cuda.graph_pool_handle())
        for batch, width in self.buckets:
            inputs = torch.tensor([self._padding(width)] * batch, dtype=torch.long, device=self.kv_cache.device)
            replay, out = capture(partial(self._forward, inputs))
            self._graphs[(batch, width)] = _Graph(inputs, replay, out)

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ids, positions, slots, context_lens = (inputs[:, i] for i in range(INPUT_COLUMNS))
        plans = AttentionPlan.static_windows(slots, inputs[:, INPUT_COLUMNS:], context_lens, self.block_size,
                                             self.layout, self.attention_backend, self.model.layer_windows,
                                             self.model.config.attn_logit_softcapping or 0.0)
        with sdpa_kernel(CAPTURED_ATTENTION):
            return self.model.forward_planned(ids, positions, self.kv_cache, plans)

    def _padding(self, width: int) -> list[int]:
        """A padding row: token 0 at position 0, written to and attending the scratch block."""
        return [0, 0, self.scratch_block * self.block_size, 1] + [self.scratch_block] * width

    def bucket(self, rows: int, blocks: int) -> tuple[int, int] | None:
        """The smallest captured bucket holding ``rows`` rows of at most ``blocks`` blocks."""
        fits = [(b * w, (b, w)) for b, w in self._graphs if b >= rows and w >= blocks]
        return min(fits)[1] if fits else None

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            tables: list[list[int]], hooks: LayerHooks) -> torch.Tensor | None:
        """The hidden states [rows, hidden] of a decode batch (one new token per row) from
        its bucket's graph; None when no bucket holds it (the caller runs it eagerly)."""
        widths = [-(-n // self.block_size) for n in context_lens]
        key = self.bucket(len(input_ids), max(widths))
        if key is None:
            return None
        batch, width = key
        graph = self._graphs[key]
        rows = [[token, pos, slot, n] + table[:w] + [self.scratch_block] * (width - w)
                for token, pos, slot, n, table, w in zip(input_ids, positions, slots, context_lens, tables, widths)]
        rows += [self._padding(width)] * (batch - len(rows))
        graph.inputs.copy_(torch.tensor(rows, dtype=torch.long))
        num_layers = len(self.model.model.layers)
        for layer in range(num_layers):
            hooks.before_layer(layer)
        graph.replay()
        for layer in range(num_layers):
            hooks.after_layer(layer)
        return graph.out[: len(input_ids)]
