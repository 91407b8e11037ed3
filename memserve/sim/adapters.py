"""LoRA adapter reads of a simulated worker: its slots are the real runner's bookkeeping
(``workers/engine/adapter_slots.py``), and reading an adapter its slots lack costs the
step that needs it ``load_s`` (the worker's measured read time). What a step's adapter
rows compute beyond the base product is not priced (the cost model is the base model's)."""

from __future__ import annotations

from memserve.workers.engine.adapter_slots import AdapterSlots


class AdapterReads:
    def __init__(self, capacity: int, load_s: float) -> None:
        self.slots: AdapterSlots[str] = AdapterSlots(capacity)
        self.load_s = load_s
        self.loads = 0

    def step_s(self, needed: set[str]) -> float:
        """Seconds the step spends reading in the adapters of ``needed`` it does not hold."""
        missing = 0
        for name in sorted(needed):  # in one order whatever the process's string hashing
            if self.slots.use(name) is None:
                self.slots.place(name, needed)
                missing += 1
        self.loads += missing
        return self.load_s * missing

    def held(self) -> list[str]:
        return sorted(self.slots.keys())
