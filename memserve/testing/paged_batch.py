"""A step's batch over a paged KV pool, for the attention tests and benchmarks: sequences
of (new tokens, context after the step) whose blocks are scattered over a pool in a
random order, as a MemPool hands them out after some churn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memserve.workers.model.attention import AttentionMetadata


@dataclass
class PagedBatch:
    query_start_loc: list[int]  # [S + 1]
    block_tables: torch.Tensor  # [S, widest + 1] long, on the CPU
    slots: torch.Tensor  # [new tokens] long: where each new token's K/V goes
    context_lens: list[int]
    num_blocks: int  # a pool holding every block of the tables, and a few more

    def metadata(self, block_size: int, layout: str, backend: str, device: torch.device) -> AttentionMetadata:
        """The runner's metadata for this batch, its tensors on ``device``."""
        return AttentionMetadata(self.slots.to(device), self.query_start_loc, self.context_lens,
                                 self.block_tables.to(device), block_size, layout, cpu_attention="torch",
                                 cpu_prefill="sdpa", attention_backend=backend)


def paged_batch(gen: torch.Generator, specs: list[tuple[int, int]], block_size: int) -> PagedBatch:
    """The batch of sequences of (new tokens, context) over shuffled block ids."""
    widths = [-(-ctx // block_size) for _, ctx in specs]
    ids = torch.randperm(sum(widths) + 4, generator=gen)
    tables = torch.zeros(len(specs), max(widths) + 1, dtype=torch.long)
    slots, starts, used = [], [0], 0
    for s, ((q_len, ctx), width) in enumerate(zip(specs, widths)):
        tables[s, :width] = ids[used: used + width]
        used += width
        slots += [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(ctx - q_len, ctx)]
        starts.append(starts[-1] + q_len)
    return PagedBatch(starts, tables, torch.tensor(slots), [ctx for _, ctx in specs], int(ids.max()) + 5)
