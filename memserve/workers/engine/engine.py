"""The engine of one worker: scheduler -> runner -> token deltas.

It is assembled from parts: a runner (the real model, or the simulator's cost-model
runner) and a clock are injected; the MemPool (KV bookkeeping), the KV cache manager,
the scheduling policy and the eviction policy are built from the configuration. It
knows nothing about sockets; ``worker.py`` drives it, and ``build_engine`` assembles
the real one from a model folder."""

from __future__ import annotations

import logging
import time
from typing import Callable

from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.ipc.messages import AddRequest, RequestOutput
from memserve.kvcache.address import Tier
from memserve.kvcache.events import KVEvent
from memserve.kvcache.eviction import SchedulerAware, make_eviction_policy
from memserve.kvcache.mempool import MemPool
from memserve.kvcache.prefetch import LookAhead
from memserve.kvcache.retention import Retention
from memserve.workers.engine.kv_connector import MemPoolKVConnector
from memserve.workers.engine.kv_manager import KVCacheManager
from memserve.workers.engine.ngram_proposer import NgramConfig, NgramProposer
from memserve.workers.engine.parallel_sampling import name_first_choice
from memserve.workers.engine.policies import make_schedule_policy
from memserve.workers.engine.runner import Runner
from memserve.workers.engine.scheduler import Scheduler, SchedulerConfig
from memserve.workers.engine.sequence import Sequence
from memserve.workers.engine.step_plan import BlockCopy, StepPlan, StepResult
from memserve.workers.engine.truncated_prefix import reuse_truncated

log = logging.getLogger("memserve.worker")


class Engine:
    def __init__(self, cfg: EngineConfig, runner: Runner, eos_token_ids: set[int], instance_id: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.runner = runner
        self.clock = clock
        self.eos_token_ids = eos_token_ids
        model_len = runner.max_position_embeddings
        pool_len = runner.num_blocks * cfg.block_size
        wanted = min(cfg.max_model_len or model_len, model_len)
        self.max_model_len = min(wanted, pool_len)
        if pool_len < wanted:
            log.warning("the KV pool holds %d tokens: serving a context of %d tokens, not %d", pool_len, pool_len,
                        wanted)
        tiers = {Tier.DEVICE: runner.num_blocks}
        if cfg.num_host_blocks:
            tiers[Tier.HOST] = cfg.num_host_blocks
        # The real runner brings a disk tier (``--disk-cache-dir``) and a background saver;
        # without them (simulator, scripted runners) saves are synchronous and exact.
        # (The simulator's runner keeps a disk tier of bookkeeping only: ``num_disk_blocks``.)
        disk = runner.disk
        disk_blocks = disk.num_blocks if disk is not None else runner.num_disk_blocks
        if disk_blocks:
            tiers[Tier.DISK] = disk_blocks
        eviction = make_eviction_policy(cfg.eviction_policy)
        self.mempool = MemPool(instance_id, tiers, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                               mover=runner.mover, clock=clock, eviction=eviction,
                               saver=runner.saver, disk=disk, save_watermark=cfg.save_watermark,
                               step_blocks=-(-cfg.max_num_batched_tokens // cfg.block_size),
                               max_pinned_fraction=cfg.max_pinned_fraction,
                               max_pinned_fraction_per_key=cfg.max_pinned_fraction_per_key)
        # Scheduler-aware eviction ranks by the waiting queue, which also drives prefetching.
        self.lookahead = LookAhead(self.mempool, eviction) if isinstance(eviction, SchedulerAware) else None
        self.retention = Retention(self.mempool, cfg.cache_ttl_s, clock) if cfg.cache_ttl_s else None
        self.policy_cost = load_cost_model(cfg.cost_model) if cfg.cost_model else None
        self.scheduler = self.make_scheduler(self.mempool, cfg.enable_prefix_caching)
        self.kv_connector = self.scheduler.kv.connector  # what PD senders, receivers and pushes use
        self.num_steps = 0
        self._arrivals = 0  # requests added: part of the waiting queue's version (look-ahead window)

    def make_scheduler(self, mempool: MemPool, enable_prefix_caching: bool,
                       max_num_batched_tokens: int | None = None) -> Scheduler:
        """A scheduler over ``mempool`` with this engine's limits (warm-up makes its own)."""
        cfg = self.cfg
        limits = SchedulerConfig(cfg.max_num_seqs, max_num_batched_tokens or cfg.max_num_batched_tokens,
                                 self.max_model_len, cfg.long_prefill_token_threshold, cfg.hold_shared_prefills,
                                 cfg.max_loras if cfg.enable_lora else 0)
        proposer = NgramProposer(NgramConfig.from_dict(cfg.speculative_config)) if cfg.speculative_config else None
        return Scheduler(KVCacheManager(mempool, MemPoolKVConnector(mempool, self.runner), enable_prefix_caching,
                                        self.retention),
                         make_schedule_policy(cfg.schedule_policy, cfg.schedule_policy_options, self.policy_cost),
                         limits, self.eos_token_ids, self.clock, proposer)

    def add_request(self, req: AddRequest, arrival_time: float | None = None) -> RequestOutput | None:
        """Queue a request; ``arrival_time`` on this engine's clock (default: now)."""
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params,
                       self.clock() if arrival_time is None else arrival_time, req.session_id,
                       priority=req.priority, slo_ttft_ms=req.slo_ttft_ms, slo_tbt_ms=req.slo_tbt_ms,
                       predicted_output_tokens=req.predicted_output_tokens,
                       output_token_ids=list(req.output_token_ids))
        name_first_choice(seq)
        if req.params.pin_tokens:
            # Pins are best effort, as hosted caches are: a refused one serves the request unpinned.
            seq.pin_refused = self._pin(seq)
        if req.params.dropped_token_ids:
            reuse_truncated(self.mempool, seq.prompt_token_ids, req.params.dropped_at, req.params.dropped_token_ids,
                            self.runner.shift_blocks, req.params.kv_salt)
        self._arrivals += 1
        return self.scheduler.add(seq)

    def _pin(self, seq: Sequence) -> str | None:
        """Pin the prompt's blocks up to ``pin_tokens`` (``cache_control``) for its TTL;
        why not, when pinning is off or a cap would be passed."""
        pins = self.mempool.pins
        if pins is None:
            return "cache_control pinning is off on this server (--max-pinned-fraction 0)"
        num_blocks = min(seq.params.pin_tokens, seq.num_prompt_tokens) // self.cfg.block_size
        hashes = seq.full_block_hashes(self.cfg.block_size, num_blocks)
        return pins.pin(hashes, seq.params.pin_ttl_s, seq.params.pin_owner)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return RequestOutput(seq.choice_of or request_id, [], True, "abort", seq.num_prompt_tokens,
                             seq.num_cached_tokens, index=seq.choice_index)

    @property
    def has_work(self) -> bool:
        """Requests to step, or saves in flight to commit (their blocks free up then)."""
        return self.scheduler.has_work or self.mempool.saver.pending() > 0

    def step(self) -> list[RequestOutput]:
        self.mempool.poll_saves()  # finished saves free their source blocks for this step
        lost = self._poll_loads()
        plan = self.scheduler.schedule()
        self._run_copies(plan.copies)
        if not (plan.chunks or plan.loads or plan.finished_ids or plan.preempted_ids):
            self._tier_upkeep()
            return lost
        failed: list[RequestOutput] = []
        try:
            result = self.runner.execute(plan)
        except Exception:
            log.exception("engine step of %d requests failed; running them one by one", len(plan.chunks))
            plan, result, failed = self._isolate_failures(plan)
        if plan.chunks:
            self.num_steps += 1
        lost += self._poll_loads()  # loads this step streamed under its prefills are in: commit them first
        outputs = self.scheduler.update(plan, result) + failed + lost
        self._run_copies(self.scheduler.take_copies())
        self._tier_upkeep()
        return outputs

    def _run_copies(self, copies: list[BlockCopy]) -> None:
        """Run the copies the scheduler queued, before any of their blocks is written
        again (the step computes after them), then drop what they held."""
        for c in copies:
            self.runner.mover.copy_blocks(c.src_tier, c.src_blocks, c.dst_tier, c.dst_blocks)
            if c.hold:
                self.mempool.free_mem(c.hold)

    def _poll_loads(self) -> list[RequestOutput]:
        """Commit the runner's finished loads; fail the requests whose load failed (only
        them: their blocks are freed); let those whose load may stream under their
        prefill (layer-wise preloading) run. Returns the failed requests' outputs."""
        loaded = self.runner.finished_loads()
        if loaded:
            self.scheduler.finish_loads(loaded)
        lost: list[RequestOutput] = []
        for rid, error in self.runner.failed_loads().items():
            if self.scheduler.kv.fail_load(rid):
                lost.append(self._fail(rid, f"loading its cached KV failed: {error!r}"))
        self.scheduler.stream_loads(self.runner.streamable_loads())
        return lost

    def _tier_upkeep(self) -> None:
        """Between steps: drop expired conversations, move the look-ahead window (ranks
        for eviction, prefetches from disk), then demote ahead of need. All off this
        thread: nothing here waits for a copy."""
        self.sweep_expired()
        if self.lookahead is not None:
            policy = self.scheduler.policy
            head = policy.peek()
            version = (self._arrivals, len(policy), head.request_id if head is not None else None)
            self.lookahead.update(self.scheduler.kv.queued_prefixes(policy), version)
        self.mempool.kick_saves()

    def sweep_expired(self) -> int:
        """Drop the cached conversations past their TTL (``--cache-ttl``) when a sweep is
        due; the worker also calls it while idle. Returns how many blocks went."""
        if self.mempool.pins is not None:
            self.mempool.pins.sweep()
        return self.retention.sweep() if self.retention is not None else 0

    def _isolate_failures(self, plan: StepPlan) -> tuple[StepPlan, StepResult, list[RequestOutput]]:
        """Re-run a failed step one request at a time, so that one request's bad input
        fails only that request. The KV a failed run wrote is overwritten by the rerun
        (same tokens, same slots); no scheduler state has moved yet."""
        kept = StepPlan(preempted_ids=plan.preempted_ids)
        result = StepResult()
        failed: list[RequestOutput] = []
        for chunk in plan.chunks:
            try:
                result.merge(self.runner.execute(plan.only(chunk)))
                kept.chunks.append(chunk)
            except Exception as exc:
                log.error("request %s fails the engine step on its own: %r", chunk.request_id, exc)
                failed.append(self._fail(chunk.request_id, f"the engine step failed on this request: {exc!r}"))
        return kept, result, failed

    def _fail(self, request_id: str, error: str) -> RequestOutput:
        """End a request the engine holds with ``error``; its blocks are freed."""
        out = self.abort(request_id)
        if out is None:
            raise KeyError(f"request {request_id} is not in the engine")
        out.finish_reason, out.error = "error", error
        return out

    def drain_kv_events(self) -> list[KVEvent]:
        return self.mempool.drain_events()

    def close(self) -> None:
        """Let the saves in flight finish (a block file is whole or absent), then stop."""
        self.mempool.close()

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "mempool": self.mempool.stats(), "num_steps": self.num_steps}
