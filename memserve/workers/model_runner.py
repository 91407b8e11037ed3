"""Runs one engine step on the real model: builds the flat batch and attention metadata
from the scheduler's plan, executes the forward pass over the paged KV cache and samples
the next token of every request the plan says to sample. It keeps each request's
sampling parameters and seed from its first plan until the plan that lists it as
finished; it never sees the scheduler's objects.

KV loads (a slower tier's cached prefix) are copied by one background thread: torch
releases the GIL in its copy kernels, so the copy overlaps the steps of other requests.
With layer-wise preloading (``layer_preload.py``) the copy goes layer by layer and the
request's own prefill may run meanwhile, waiting per layer in the forward pass's hooks;
otherwise the scheduler schedules it once its load is done. No block being copied into is
handed to any other request, so steps and loads touch disjoint blocks. Saves of cached
KV down the tiers run on another thread (``saver``); the MemPool pins what they read. On
CUDA each of the two threads copies on a stream of its own (``copy_stream.py``), and a
streamed load's layer is waited for on the device, by its event.

With tensor parallelism (``tensor_parallel_group.py``) this is one rank's runner: its
shard of the model, its heads' share of every KV pool. Rank 0's is given the other ranks
(``followers``): it sends them each step's plan, and the MemPool's block moves go to every
rank (``GroupMover``); its own loads copy only its share, as every rank's do.

On CUDA, decode steps (with their drafts, over the Triton kernel) replay CUDA graphs
captured when the runner starts (``model/decode_graphs.py``; ``--enforce-eager`` turns them
off, and a model that cannot be captured runs without them, logging ``eager_reason``'s
why); steps with longer rows (prefill chunks) run eagerly. On CPU every step runs eagerly."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from memserve.config import EngineConfig
from memserve.ipc.messages import SamplingParams
from memserve.kvcache.address import Tier
from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.mover import BlockMover
from memserve.kvcache.saver import InlineSaver, Saver, ThreadSaver
from memserve.kvcache.tiered_mover import TieredMover
from memserve.model_files.generation import eos_token_ids
from memserve.workers.engine.layer_hooks import NO_HOOKS, ChainedHooks, LayerHooks
from memserve.workers.engine.ngram_proposer import accept_drafts
from memserve.workers.engine.step_plan import KVLoad, NewRequestData, StepPlan, StepResult
from memserve.workers.copy_stream import CopyStream, StreamMover
from memserve.workers.kv_disk import open_disk_store
from memserve.workers.kv_pools import KVPools
from memserve.workers.layer_preload import LayerwisePreloader
from memserve.workers.model import cpu_kernels
from memserve.workers.model.attention import CPU_ATTENTIONS, AttentionMetadata
from memserve.workers.model.attention_backend import resolve_attention_backend
from memserve.workers.model.decode_graphs import DecodeGraphs, eager_reason, graph_row_tokens
from memserve.workers.model.dtype import resolve_dtype
from memserve.workers.model.grammar import GrammarMatchers
from memserve.workers.model.kv_shift import shift_blocks
from memserve.workers.model.loader import load_model
from memserve.workers.model.lora import AdapterError, AdapterKey, LoRAAdapters
from memserve.workers.model.logprobs import (
    PromptLogprobs,
    log_softmax_rows,
    sampled_logprobs,
)
from memserve.workers.model.penalties import TokenHistories
from memserve.workers.model.prefill_probe import resolve_cpu_prefill
from memserve.workers.model.sampler import Sampler, position_uniform
from memserve.workers.model.tensor_parallel import SINGLE, TensorParallel
from memserve.workers.tensor_parallel_disk import GroupDiskStore, HeldLoads
from memserve.workers.tensor_parallel_group import Followers, GroupMover, LayerReads

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path, hooks: LayerHooks = NO_HOOKS, tp: TensorParallel = SINGLE,
                 followers: Followers | None = None) -> None:
        self.device = torch.device(cfg.rank_device(tp.rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # what allocates on "cuda" without an index, and the current stream
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        torch.manual_seed(cfg.seed)
        self.followers = followers
        # A runner with adapters sets them on its layers: its model is its own.
        self.model = load_model(model_dir, self.dtype, self.device, cfg.cpu_gemm, cfg.quantization, tp,
                                load_format=cfg.load_format,
                                shared=not cfg.enable_lora)
        self.model_config = self.model.rank_config  # this rank's heads and widths
        self.vocab_size = self.model_config.vocab_size
        self.max_position_embeddings = self.model_config.max_position_embeddings
        self.block_size = cfg.block_size
        self.layout = cfg.kv_layout
        if cfg.cpu_attention not in CPU_ATTENTIONS:
            raise ValueError(f"unknown CPU attention {cfg.cpu_attention!r}; expected one of {CPU_ATTENTIONS}")
        self.cpu_attention = cfg.cpu_attention
        if self.device.type == "cpu" and self.cpu_attention == "kernel":
            cpu_kernels.available()  # built (once per machine) or loaded now, not in the first step
        self.cpu_prefill = resolve_cpu_prefill(cfg.cpu_prefill_attention, self.model_config, self.dtype, self.device)
        if self.device.type == "cpu":
            log.info("CPU prefill attention: %s (--cpu-prefill-attention %s)", self.cpu_prefill,
                     cfg.cpu_prefill_attention)
        self.attention_backend = resolve_attention_backend(cfg, self.device, self.model_config.head_dim, self.dtype)
        self.num_layers = self.model_config.num_layers
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager and self._graph_capturable(cfg, tp.size)
        self.pools = KVPools.create(self.model_config, cfg, self.dtype, self.device, scratch_block=use_graphs)
        local: BlockMover = self.pools  # this rank's tiers
        self.disk: DiskStore | None = None
        self.num_disk_blocks = 0  # the disk tier, when there is one, is ``disk``'s
        if cfg.disk_cache_dir:
            self.disk = open_disk_store(cfg, model_dir, self.dtype, self.pools.dtype, self.pools.block_nbytes,
                                        tp.rank, followers)
            local = TieredMover(self.pools, self.disk)
        # The MemPool's moves go to every rank; this rank's own loads copy only its share.
        self.mover: BlockMover = GroupMover(local, followers, self.disk) if followers is not None else local
        # Saves down the tiers run on their own thread, like loads, unless asked inline; on
        # CUDA that thread copies on a stream of its own.
        save_mover = StreamMover(self.mover, CopyStream(self.device)) if self.device.type == "cuda" else self.mover
        self.saver: Saver = ThreadSaver(save_mover) if cfg.async_save else InlineSaver(self.mover)
        self.hooks = hooks
        # Hooks that depend on the step's plan (by-layer KV transfer), asked for each step.
        self._step_hooks: list[Callable[[StepPlan], LayerHooks | None]] = []
        self.sampler = Sampler()
        self.prompt_logprobs = PromptLogprobs(self.model.compute_logits)
        self.loras = (LoRAAdapters(self.model, cfg.lora_paths, cfg.max_lora_rank,
                                   max(cfg.max_loras, cfg.max_cpu_loras or 0), self.dtype)
                      if cfg.enable_lora else None)
        self._params: dict[str, SamplingParams] = {}
        # A seeded request's seed and prompt length: its token at sequence position q is
        # drawn with position_uniform(seed, q - prompt length).
        self._seeds: dict[str, tuple[int, int]] = {}
        eos = eos_token_ids(model_dir)
        self._histories = TokenHistories(eos)
        self._grammars = GrammarMatchers(model_dir, self.vocab_size, eos)
        self.preloader = self._preloader(cfg, local)
        self._held_loads = HeldLoads(self.disk) if isinstance(self.disk, GroupDiskStore) else None
        self._failed_loads: dict[str, BaseException] = {}
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            assert self.pools.scratch_block is not None
            max_len = min(cfg.max_model_len or self.max_position_embeddings, self.max_position_embeddings,
                          self.num_blocks * self.block_size)
            self.graphs = DecodeGraphs(self.model, self.pools.device, self.layout, self.block_size,
                                       self.pools.scratch_block, cfg.max_num_seqs, -(-max_len // self.block_size),
                                       self.attention_backend, graph_row_tokens(cfg, self.attention_backend))
            self.graphs.capture()

    def _graph_capturable(self, cfg: EngineConfig, tp_size: int) -> bool:
        """Whether CUDA graphs may capture this model's decode steps; logs why not."""
        reason = eager_reason(self.model, self.attention_backend, self.dtype,
                              torch.cuda.get_device_capability(self.device), tp_size, cfg.enable_lora)
        if reason is not None:
            log.info("decode steps run eagerly, without CUDA graphs: %s", reason)
        return reason is None

    def _preloader(self, cfg: EngineConfig, local: BlockMover) -> LayerwisePreloader:
        """Loads into the device tier, from this rank's own tiers (``local``), on a copy stream."""
        disk = self.disk
        loads = CopyStream(self.device)
        return LayerwisePreloader(
            self.model_config.num_layers,
            # A load's first layer waits for the steps before it; the rest overlap the compute.
            lambda tier, src, dst, layer: loads.run(lambda: self.pools.copy_layer(tier, src, Tier.DEVICE, dst, layer),
                                                    after_compute=layer == 0),
            lambda tier, src, dst: loads.run_sync(lambda: local.copy_blocks(tier, src, Tier.DEVICE, dst)),
            (lambda slots: bool(disk.failed(slots))) if disk is not None else (lambda slots: False),
            layerwise=cfg.layerwise_preload, ahead=cfg.preload_buffer_layers,
            stream_disk=cfg.tensor_parallel_size == 1)

    @property
    def tp(self) -> TensorParallel:
        """This rank's place in its group (the model's)."""
        return self.model.tp

    @property
    def num_blocks(self) -> int:
        return self.pools.num_device_blocks

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the planned tokens; return the sampled token of each request that has one."""
        # Before the plan goes to the other ranks: the hooks name the layers they read.
        hooks = [h for make in self._step_hooks if (h := make(plan)) is not None]
        if self.followers is None:
            return self._execute(plan, hooks)
        self.followers.send("execute", plan)
        try:
            return self._execute(plan, hooks)
        except Exception:
            self.followers.exit_if_one_died()  # a collective failed because a rank is gone: not the requests' fault
            raise

    def _execute(self, plan: StepPlan, extra: list[LayerHooks]) -> StepResult:
        for rid in plan.finished_ids:
            self._params.pop(rid, None)
            self._seeds.pop(rid, None)
            self._histories.forget(rid)
            self._grammars.forget(rid)
            self.prompt_logprobs.forget(rid)
        for new in plan.new_requests:
            self._start(new)
        self.preloader.release(plan.finished_ids + plan.preempted_ids)
        if plan.loads:
            self.start_loads(plan.loads)
        if not plan.chunks:
            return StepResult()
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        sample_positions: list[int] = []  # of the token chosen after each sampled row
        for chunk in plan.chunks:
            start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            table = chunk.block_ids
            self._histories.observe(chunk.request_id, start, chunk.token_ids)
            input_ids += chunk.token_ids
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + end - start)
            context_lens.append(end)
            tables.append(table)
            if chunk.sample:  # the last row, and with drafts the row before each of them
                sample_rows += range(query_start_loc[-1] - 1 - chunk.num_drafts, query_start_loc[-1])
                sample_ids += [chunk.request_id] * (1 + chunk.num_drafts)
                sample_positions += range(end - chunk.num_drafts, end + 1)
        if self.loras is not None:
            self._set_lora_rows(plan, query_start_loc)
        hooks = self._layer_hooks(plan, extra)
        hidden = None
        if self.graphs is not None:  # a step of rows that fit a graph: decodes, with their drafts
            hidden = self.graphs.run(input_ids, positions, slots, query_start_loc, context_lens, tables, hooks)
        if hidden is None:
            width = max(len(t) for t in tables)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                query_start_loc=query_start_loc,
                context_lens=context_lens,
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                                          device=self.device),
                block_size=bs,
                layout=self.layout,
                cpu_attention=self.cpu_attention,
                cpu_prefill=self.cpu_prefill, attention_backend=self.attention_backend,
            )
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.pools.device,
                meta,
                hooks,
            )
        prompt_logprobs = self.prompt_logprobs.step(plan.chunks, query_start_loc, hidden, self._params)
        if not sample_ids:
            return StepResult()
        logits = self.model.compute_logits(hidden[sample_rows])
        params = [self._params[r] for r in sample_ids]
        logprob_rows, log_probs = log_softmax_rows(logits, params)  # raw logits, before the sampler
        # Draft rows are sampled like any other: accept_drafts keeps the drafts equal to them.
        tokens = self.sampler.sample(logits, params, self._uniforms(sample_ids, sample_positions),
                                     self._histories.rows(sample_ids), self._grammars.rows(sample_ids))
        self._grammars.accept(sample_ids, tokens)
        result = StepResult(dict(zip(sample_ids, tokens)),
                            sampled_logprobs(logprob_rows, log_probs, tokens, params, sample_ids), prompt_logprobs)
        accept_drafts(plan.chunks, tokens, result)
        return result

    def _layer_hooks(self, plan: StepPlan, extra: list[LayerHooks]) -> LayerHooks:
        """The step's layer hooks: the runner's, the preloader's (once the step's loads
        have started), the step hooks' (``extra``) and, on ranks 1..N-1, the gathers of
        the layers rank 0 reads (``plan.layer_reads``)."""
        preload = self.preloader.hooks_for(plan)
        reads = [LayerReads(self.join_layer_read, plan.layer_reads)] if self.tp.rank > 0 and plan.layer_reads else []
        chained = [h for h in (preload, *extra, *reads) if h is not None]
        return ChainedHooks([self.hooks, *chained]) if chained else self.hooks

    def _set_lora_rows(self, plan: StepPlan, query_start_loc: list[int]) -> None:
        """Tell the model which of the step's rows run which adapter."""
        assert self.loras is not None
        rows: dict[AdapterKey, list[int]] = {}
        for i, chunk in enumerate(plan.chunks):
            params = self._params[chunk.request_id]
            if params.lora_name is not None:
                key = self.loras.key(params.lora_name, params.lora_digest)
                rows.setdefault(key, []).extend(range(query_start_loc[i], query_start_loc[i + 1]))
        running = {(p.lora_name, p.lora_digest) for p in self._params.values() if p.lora_name and p.lora_digest}
        self.loras.set_rows(rows, query_start_loc[-1], self.device, running)

    def set_adapter(self, name: str, folder: str | None, digest: str = "") -> None:
        """Serve LoRA adapter ``name`` from ``folder`` from now on (None: no more), on every
        rank; raises ``AdapterError`` naming why one cannot be served."""
        if self.loras is None:
            raise AdapterError("LoRA adapters are served only with --enable-lora")
        if folder is None:
            self.loras.stop(name)
        else:
            self.loras.serve(name, folder, digest or None)
        if self.followers is not None:  # rank 0 refused what the others would refuse
            self.followers.run("set_adapter", name, folder, digest, mine=lambda: None)

    def _start(self, new: NewRequestData) -> None:
        """Keep what sampling ``new`` needs in the steps to come."""
        self._params[new.request_id] = new.params
        self._histories.start(new.request_id, new.params, new.prompt_token_ids)
        if new.output_token_ids:
            self._histories.observe(new.request_id, len(new.prompt_token_ids), new.output_token_ids)
        self._grammars.start(new.request_id, new.params.grammar, new.output_token_ids)
        if new.params.seed is not None:
            self._seeds[new.request_id] = (new.params.seed, len(new.prompt_token_ids))

    def _uniforms(self, sample_ids: list[str], positions: list[int]) -> list[float | None]:
        """Each sampled row's uniform number: a seeded request's is keyed by the output
        position it chooses (the same in any step or batch, with or without drafts); None
        for a fresh draw."""
        uniforms: list[float | None] = []
        for rid, position in zip(sample_ids, positions):
            seed = self._seeds.get(rid)
            uniforms.append(None if seed is None else position_uniform(seed[0], position - seed[1]))
        return uniforms

    def add_step_hooks(self, make: Callable[[StepPlan], LayerHooks | None]) -> None:
        """Have ``make(plan)`` give each step's extra layer hooks, called after ``hooks``
        and the preloader's (``make`` runs before the step's loads start)."""
        self._step_hooks.append(make)

    # ------------------------------------------------------------------ loads
    def start_loads(self, loads: list[KVLoad]) -> None:
        for load in loads:
            if self._held_loads is not None:
                self._held_loads.started(load)
            self.preloader.start(load)

    def finished_loads(self) -> list[str]:
        done, failed = self.preloader.finished()
        if self._held_loads is not None:  # loads from disk: done once every rank's is
            done, failed = self._held_loads.settle(done, failed)
        self._failed_loads.update(failed)
        return done

    def failed_loads(self) -> dict[str, BaseException]:
        """Loads whose copy raised, found by ``finished_loads``: the engine fails those
        requests only."""
        failed, self._failed_loads = self._failed_loads, {}
        return failed

    def streamable_loads(self) -> list[str]:
        """Requests whose prefill may run while their load streams in, layer by layer."""
        return self.preloader.streamable()

    # ------------------------------------------------------------ kv-shift
    def read_layer(self, blocks: list[int], layer: int) -> memoryview:
        """Layer ``layer`` of device blocks ``blocks``, copied out for a by-layer send. In
        a tensor-parallel worker every rank calls it in the same step after the same layer
        (rank 0's sends; the others join it, ``join_layer_read``), and rank 0 gets every
        rank's part, rank by rank."""
        return self.pools.read_layer(blocks, layer, self.tp.all_gather if self.tp.size > 1 else None)

    def join_layer_read(self, blocks: list[int], layer: int) -> None:
        """A rank's part in rank 0's ``read_layer`` (the gather alone: no copy to the host)."""
        self.tp.all_gather(self.pools.layer_bytes(blocks, layer))

    def shift_blocks(self, src_blocks: list[int], dst_blocks: list[int], delta_positions: int) -> None:
        """Copy device blocks with their keys moved by ``delta_positions`` (model/kv_shift.py)."""
        if self.followers is not None:
            self.followers.run("shift_blocks", src_blocks, dst_blocks, delta_positions,
                               mine=lambda: self._shift_blocks(src_blocks, dst_blocks, delta_positions))
        else:
            self._shift_blocks(src_blocks, dst_blocks, delta_positions)

    def _shift_blocks(self, src_blocks: list[int], dst_blocks: list[int], delta_positions: int) -> None:
        shift_blocks(self.pools.device, self.layout, self.model.layer_rotaries, src_blocks, dst_blocks,
                     delta_positions)
