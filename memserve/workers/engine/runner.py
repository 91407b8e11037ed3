"""What the engine needs from a model runner. ``workers/model_runner.ModelRunner`` runs
the real model on the KV tensors; the simulator's runner advances a virtual clock by the
cost model instead. Both execute the same ``StepPlan``s from the same scheduler, and both
are the worker side of the KV connector (``kv_connector.KVConnectorWorker``): they start
loads, report them and run per-layer hooks."""

from __future__ import annotations

from typing import Protocol

from memserve.kvcache.disk_store import DiskStore
from memserve.kvcache.mover import BlockMover
from memserve.kvcache.saver import Saver
from memserve.workers.engine.kv_connector import KVConnectorWorker
from memserve.workers.engine.step_plan import StepPlan, StepResult


class Runner(KVConnectorWorker, Protocol):
    vocab_size: int
    max_position_embeddings: int
    mover: BlockMover  # copies blocks between tiers and reads/writes them for transfers
    # Lower tiers. The real runner's disk store; None where saves are synchronous and
    # exact (simulator, scripted runners). ``num_disk_blocks``: a disk tier of bookkeeping
    # only, without a store (the simulator's), else 0.
    disk: DiskStore | None
    num_disk_blocks: int

    # Read-only, so that a runner may derive them (the real one's from its pools) or
    # narrow them (a runner that always has a saver).
    @property
    def num_blocks(self) -> int:
        """Device KV blocks."""
        ...

    @property
    def saver(self) -> Saver | None:
        """The background saver down the tiers; None where saves are synchronous."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; forget the plan's finished requests first."""
        ...

    def shift_blocks(self, src_blocks: list[int], dst_blocks: list[int], delta_positions: int) -> None:
        """Copy KV blocks into ``dst_blocks`` re-rotated ``delta_positions`` earlier (a
        truncated conversation reuses its cache after the dropped turns)."""
        ...
