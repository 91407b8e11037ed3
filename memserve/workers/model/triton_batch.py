"""A step's batch as the Triton kernel's arguments (``--attention-backend triton``).

The kernel (triton_attention.py) attends every query row of a step in one launch per
layer: prefill chunks, decode rows and a decode's speculative verify rows are all
sequences of some number of new tokens, causal against their cached context. What it
needs beyond the layer's q and K/V views is the same for every layer of a step: where
each sequence's rows start, its context length and its block table, as int32 tensors on
the device. ``TritonBatch`` holds them, built once per step with the attention plan, so
that no layer copies or converts anything; nothing is gathered and nothing is padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TritonBatch:
    """The kernel's per-step arguments, int32 on the device."""

    query_start_loc: torch.Tensor  # [S + 1]: sequence s's rows are query_start_loc[s] up to query_start_loc[s + 1]
    seq_lens: torch.Tensor  # [S]: its context after this step, the new tokens included
    block_tables: torch.Tensor  # [S, W]: its blocks, padded past its context with any block id

    @classmethod
    def build(cls, query_start_loc: list[int], context_lens: list[int], block_tables: torch.Tensor,
              device: torch.device) -> TritonBatch:
        """From the runner's metadata: the host lists go to the device in one copy, the
        block table (on the device already) is narrowed to int32 there."""
        lens = torch.tensor(query_start_loc + context_lens, dtype=torch.int32).to(device, non_blocking=True)
        starts = len(query_start_loc)
        return cls(lens[:starts], lens[starts:], block_tables.to(device=device, dtype=torch.int32))

    @classmethod
    def static(cls, context_lens: torch.Tensor, block_tables: torch.Tensor, row_tokens: int = 1) -> TritonBatch:
        """A batch held in device tensors (``row_tokens`` new tokens per row: context_lens
        [B], block_tables [B, W]), by device ops alone, so that a CUDA graph captures it."""
        rows = context_lens.shape[0]
        starts = torch.arange(0, (rows + 1) * row_tokens, row_tokens, dtype=torch.int32, device=context_lens.device)
        return cls(starts, context_lens.to(torch.int32), block_tables.to(torch.int32))


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TritonBatch,
                           scale: float, window: int, softcap: float) -> torch.Tensor:
    """q [T, heads, dim] (a view into the fused projection will do) attended to the
    layer's K/V views [num_blocks, block_size, kv_heads, dim], the step's new K/V written
    there already; returns [T, heads, dim]. ``window`` 0 and ``softcap`` 0.0: none."""
    # Imported here, not with this module: triton decides as it is imported whether it
    # compiles or interprets, and a worker on another backend never imports it.
    from memserve.workers.model.triton_attention import paged_attention

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    paged_attention(q, k_cache, v_cache, out, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
                    window, softcap)
    return out
