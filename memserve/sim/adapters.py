"""LoRA adapter slots of a simulated worker, as ``workers/model/lora.py`` keeps them: the
``capacity`` most recently used adapters held ready, another read in (``load_s``, the
worker's measured read time) before the step that needs it, in place of the least
recently used one the step does not need; a step that needs more than ``capacity``
widens them, as the real slots do. What a step's adapter rows compute beyond the base
product is not priced (the cost model is the base model's)."""

from __future__ import annotations

from collections import OrderedDict


class AdapterSlots:
    def __init__(self, capacity: int, load_s: float) -> None:
        self.capacity, self.load_s = max(1, capacity), load_s
        self.slots: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.loads = 0

    def step_s(self, needed: set[str]) -> float:
        """Seconds the step spends reading in the adapters of ``needed`` it does not hold."""
        missing = [name for name in needed if name not in self.slots]
        for name in needed & self.slots.keys():
            self.slots.move_to_end(name)
        self.capacity = max(self.capacity, len(needed))
        for name in missing:
            if len(self.slots) >= self.capacity:
                idle = next(n for n in self.slots if n not in needed)
                del self.slots[idle]
            self.slots[name] = None
        self.loads += len(missing)
        return self.load_s * len(missing)

    def held(self) -> list[str]:
        return sorted(self.slots)
