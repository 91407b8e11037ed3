"""Which LoRA adapters a worker holds ready in its slots: pure bookkeeping, run by the
real runner (``workers/model/lora.py``, which puts the weights on the layers) and by the
simulator (``sim/adapters.py``, which prices the reads) alike.

- A held adapter used again becomes the most recently used.
- One not held takes a free slot, else the slot of the least recently used adapter not
  in ``keep`` (the step's own, and those that could not be read again), which is evicted;
  when every held adapter is kept the slots widen by one. The scheduler admits no more
  adapters at once than the slots (``--max-loras``), so this is the safety net that keeps
  a step from failing for lack of slots, not the rule.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class AdapterSlots(Generic[K]):
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._held: OrderedDict[K, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._free = list(range(self.capacity))[::-1]

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def keys(self) -> list[K]:
        return list(self._held)

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    def use(self, key: K) -> int | None:
        """``key``'s slot if it is held (it becomes the most recently used), else None."""
        if key not in self._held:
            return None
        self._held.move_to_end(key)
        return self._held[key]

    def place(self, key: K, keep: Collection[K] = ()) -> tuple[int, K | None]:
        """A slot for ``key``, not held, and the adapter evicted from it (None: it was free)."""
        evicted = None
        if not self._free:
            evicted = next((k for k in self._held if k not in keep), None)
            if evicted is None:
                self._free.append(self.capacity)
                self.capacity += 1
            else:
                self._free.append(self._held.pop(evicted))
        slot = self._free.pop()
        self._held[key] = slot
        return slot, evicted

    def drop(self, key: K) -> int:
        """Free ``key``'s slot; returns it."""
        slot = self._held.pop(key)
        self._free.append(slot)
        return slot
