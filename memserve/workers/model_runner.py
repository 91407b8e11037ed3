"""Runs one engine step on the real model: builds the flat batch and attention metadata
from the scheduler's decision, executes the forward pass over the paged KV cache and
samples the next token of every sequence whose known tokens are now all computed."""

from __future__ import annotations

from pathlib import Path

import torch

from memserve.config import EngineConfig
from memserve.workers.kv_pools import KVPools
from memserve.workers.model.attention import AttentionMetadata
from memserve.workers.model.dtype import resolve_dtype
from memserve.workers.model.loader import load_model
from memserve.workers.model.sampler import Sampler
from memserve.workers.scheduler import SchedulerOutput
from memserve.workers.sequence import Sequence


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path) -> None:
        self.device = torch.device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        torch.manual_seed(cfg.seed)
        self.model = load_model(model_dir, self.dtype, self.device)
        self.model_config = self.model.config
        self.block_size = cfg.block_size
        self.layout = cfg.kv_layout
        self.pools = KVPools.create(self.model_config, cfg, self.dtype, self.device)
        self.sampler = Sampler()

    @property
    def num_blocks(self) -> int:
        return self.pools.num_device_blocks

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[Sequence, int]:
        """Run the scheduled tokens; return the sampled token of each sequence that has one."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            end = start + n
            input_ids += seq.all_token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(end)
            tables.append(seq.block_ids)
            if end == seq.num_tokens:
                sample_rows.append(query_start_loc[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device),
            block_size=bs,
            layout=self.layout,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.pools.device,
            meta,
        )
        if not sample_seqs:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        for seq in sample_seqs:
            if seq.params.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        tokens = self.sampler.sample(logits, [s.params for s in sample_seqs], [s.generator for s in sample_seqs])
        return dict(zip(sample_seqs, tokens))
