"""The engine of one worker: scheduler -> model runner -> sampler -> token deltas.

It wires the MemPool (KV bookkeeping), the scheduler (policy) and the runner (tensors)
together and knows nothing about sockets; ``worker.py`` drives it."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, RequestOutput
from memserve.kvcache.address import Tier
from memserve.kvcache.events import KVEvent
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.workers.model_runner import ModelRunner
from memserve.workers.scheduler import Scheduler, SchedulerOutput
from memserve.workers.sequence import Sequence

log = logging.getLogger("memserve.worker")


def eos_token_ids(model_dir: Path) -> set[int]:
    """EOS ids as Hugging Face ``generate`` sees them: generation_config, else config."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
                break
    return ids


class Engine:
    def __init__(self, cfg: EngineConfig, model_dir: Path, instance_id: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg, model_dir)
        model_len = self.runner.model_config.max_position_embeddings
        pool_len = self.runner.num_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or model_len, model_len, pool_len)
        if self.max_model_len == pool_len < min(cfg.max_model_len or model_len, model_len):
            log.warning("the KV pool holds %d tokens: serving a context of %d tokens, not %d", pool_len, pool_len,
                        min(cfg.max_model_len or model_len, model_len))
        tiers = {Tier.DEVICE: self.runner.num_blocks}
        if cfg.num_host_blocks:
            tiers[Tier.HOST] = cfg.num_host_blocks
        self.mempool = MemPool(instance_id, tiers, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                               mover=self.runner.pools, clock=clock)
        self.eos_token_ids = eos_token_ids(model_dir)
        self.clock = clock
        self.scheduler = self.make_scheduler(self.mempool, cfg.enable_prefix_caching)
        self.num_steps = 0

    def make_scheduler(self, mempool: MemPool, enable_prefix_caching: bool,
                       max_num_batched_tokens: int | None = None) -> Scheduler:
        """A scheduler over ``mempool`` with this engine's limits (warm-up makes its own)."""
        cfg = self.cfg
        return Scheduler(
            mempool,
            num_blocks=self.runner.num_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            enable_prefix_caching=enable_prefix_caching,
            clock=self.clock,
        )

    def add_request(self, req: AddRequest) -> RequestOutput | None:
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params, self.clock(), req.session_id)
        return self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return RequestOutput(request_id, [], True, "abort", seq.num_prompt_tokens, seq.num_cached_tokens)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out:
            return []
        failed: list[RequestOutput] = []
        try:
            sampled = self.runner.execute(out)
        except Exception:
            log.exception("engine step of %d sequences failed; running them one by one", len(out.scheduled))
            out, sampled, failed = self._isolate_failures(out)
        self.num_steps += 1
        return self.scheduler.update(out, sampled) + failed

    def _isolate_failures(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[Sequence, int],
                                                               list[RequestOutput]]:
        """Re-run a failed step one sequence at a time, so that one request's bad input
        fails only that request. The KV a failed run wrote is overwritten by the rerun
        (same tokens, same slots); no scheduler state has moved yet."""
        kept = SchedulerOutput(preempted=out.preempted)
        sampled: dict[Sequence, int] = {}
        failed: list[RequestOutput] = []
        for seq, num_new in out.scheduled:
            try:
                sampled.update(self.runner.execute(SchedulerOutput([(seq, num_new)])))
                kept.scheduled.append((seq, num_new))
            except Exception as exc:
                log.error("request %s fails the engine step on its own: %r", seq.request_id, exc)
                failure = self.abort(seq.request_id)
                failure.finish_reason, failure.error = "error", f"the engine step failed on this request: {exc!r}"
                failed.append(failure)
        return kept, sampled, failed

    def push_prefix(self, token_ids: list[int], dst_instance: int, ticket: str) -> int:
        """Send the cached prefix of ``token_ids`` to another instance, which indexes it as
        its own historical KV, under the ``ticket`` it expects. Returns the number of
        blocks sent."""
        bs = self.cfg.block_size
        addrs = self.mempool.match(token_ids, take_ref=True)
        if not addrs:
            return 0
        try:
            self.mempool.transfer_with_insert(dst_instance, token_ids[: len(addrs) * bs], addrs,
                                              flags=KVFlags.RELEASE, ticket=ticket)
        finally:
            self.mempool.free_mem(addrs)
        return len(addrs)

    def drain_kv_events(self) -> list[KVEvent]:
        return self.mempool.drain_events()

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "mempool": self.mempool.stats(), "num_steps": self.num_steps}
