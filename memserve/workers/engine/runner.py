"""What the engine needs from a model runner. ``model_runner.ModelRunner`` runs the real
model on the KV tensors; the simulator's runner advances a virtual clock by the cost
model instead. Both execute the same ``StepPlan``s from the same scheduler."""

from __future__ import annotations

from typing import Protocol

from memserve.kvcache.mempool import BlockMover
from memserve.workers.engine.step_plan import KVLoad, StepPlan, StepResult


class Runner(Protocol):
    num_blocks: int  # device KV blocks
    vocab_size: int
    max_position_embeddings: int
    mover: BlockMover  # copies blocks between tiers and reads/writes them for transfers

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; forget the plan's finished requests first."""
        ...

    def start_loads(self, loads: list[KVLoad]) -> None:
        """Start copying KV into device blocks, off the caller's thread."""
        ...

    def finished_loads(self) -> list[str]:
        """Request ids whose loads completed since the last call."""
        ...

    def failed_loads(self) -> dict[str, BaseException]:
        """Request ids whose load failed since the last call, with the error."""
        ...

    def streamable_loads(self) -> list[str]:
        """Request ids whose prefill may run while their load is still arriving."""
        ...

    def shift_blocks(self, src_blocks: list[int], dst_blocks: list[int], delta_positions: int) -> None:
        """Copy KV blocks into ``dst_blocks`` re-rotated ``delta_positions`` earlier (a
        truncated conversation reuses its cache after the dropped turns)."""
        ...
