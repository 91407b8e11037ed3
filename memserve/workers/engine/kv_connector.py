"""One interface for KV that moves between tiers and instances without stopping the
engine (after vLLM's KV connector, ``kv_transfer/kv_connector/v1/base.py``): tier loads
and layer-wise preloads, prefill-to-decode handoffs by request and by layer, KV a decode
instance returns to its prefill instance, eq. 2 prefix pulls, and swap-outs.

Scheduler side (``KVConnector``, an abstract base, torch-free, one per engine; today's
implementation, ``MemPoolKVConnector``, keeps the KV in this instance's MemPool tiers and
moves it through the worker side below; another store, a remote cache or another
transport, is another subclass and leaves the engine untouched):
- *Tokens found elsewhere.* KV another instance sent for a request (``adopt``) is that
  request's computed prefix at admission (``take_adopted``), before any lookup in this
  instance's cache. A prefix in a slower tier is matched by the MemPool and loaded into
  device blocks reserved at admission (``KVCacheManager.admit`` queues a ``KVLoad``).
- *Delay free.* A request retained for a handoff (``retain``) keeps its blocks when it
  leaves (``request_finished`` says so) until the sender takes them (``take_retained``).
- *Blocks for senders and receivers.* ``hold_prefix``, ``hold_device_prefix``,
  ``alloc`` and ``free`` hold and release the blocks a transfer reads or fills;
  ``block_nbytes`` and ``num_layers`` size its frames. The PD sender and receiver and
  the worker's prefix pushes and link probes go through these, never through the
  scheduler, the MemPool or its mover, or the runner's tensors (the transfer endpoint
  that carries the bytes is the one part that reads and fills the pools).

Worker side (``KVConnectorWorker``, implemented by the runner): start loads and report
which finished, failed or may stream under their prefill; per step, layer hooks that wait
for layer i's KV (``before_layer``: layer-wise preloading) and save or send layer i once
computed (``after_layer``: by-layer handoffs), registered with ``add_step_hooks``;
``read_layer`` reads one layer of blocks for a send.

Copies the scheduler decides (a swap-out's device-to-host copy, a fork's copy-on-write of
a partly filled block) travel in the step plan (``StepPlan.copies``) and run before the
step computes: never inside ``schedule()`` or ``update()``.

Invariant: every block the connector holds (adopted or retained) is released exactly
once: taken over by an admission, taken by the sender, or freed when its request ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from memserve.kvcache.address import Tier, addr_tier
from memserve.kvcache.mempool import MemPool
from memserve.workers.engine.layer_hooks import LayerHooks
from memserve.workers.engine.step_plan import KVLoad, StepPlan


@dataclass
class ComputedPrefix:
    """A request's cached prefix, held: device blocks first, then slower-tier ones."""

    device: list[int] = field(default_factory=list)
    slow: list[int] = field(default_factory=list)
    num_tokens: int | None = None  # tokens the blocks hold, when the last one is partly filled


class KVConnectorWorker(Protocol):
    """The worker side: what the runner does with KV that moves."""

    num_layers: int

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

    def add_step_hooks(self, make: Callable[[StepPlan], LayerHooks | None]) -> None:
        """Have ``make(plan)`` give each step's layer hooks (wait for layer i, save layer i)."""
        ...

    def read_layer(self, blocks: list[int], layer: int) -> memoryview:
        """Layer ``layer`` of device blocks ``blocks``, copied out for a send."""
        ...


class KVConnector(ABC):
    """The scheduler side; see the module docstring. Every block a method returns or
    takes is a MemPool address (``kvcache/address.py``) held by one reference."""

    @abstractmethod
    def adopt(self, request_id: str, addrs: list[int], num_tokens: int) -> None:
        """Held device blocks holding the first ``num_tokens`` tokens of a request not yet
        admitted (KV sent by a prefill instance): its admission takes them over as its
        computed prefix; the request owns their references from then on."""

    @abstractmethod
    def has_adopted(self, request_id: str) -> bool:
        """Whether KV was adopted for the request and not yet taken or freed."""

    @abstractmethod
    def take_adopted(self, request_id: str) -> ComputedPrefix | None:
        """The adopted KV of a request being admitted (its references pass to the caller)."""

    @abstractmethod
    def release_adopted(self, keep: str) -> bool:
        """Free the adopted KV of the most recently resumed waiting request other than
        ``keep`` (that request will recompute, from cache where the blocks stay indexed);
        False when there is none. For a queue whose head cannot get blocks while requests
        behind it hold theirs and nothing runs: without it, nothing would ever move."""

    @abstractmethod
    def retain(self, request_id: str) -> None:
        """When the request leaves, keep its blocks for a handoff."""

    @abstractmethod
    def request_finished(self, request_id: str, finished: bool, addrs: list[int]) -> bool:
        """A request leaves holding ``addrs``: True when the connector keeps them (a
        finished request retained for a handoff), False when the caller frees them. A
        request that leaves unfinished (aborted, preempted) frees its adopted KV here."""

    @abstractmethod
    def take_retained(self, request_id: str) -> list[int]:
        """The blocks kept for the request (its references pass to the caller)."""

    @abstractmethod
    def hold_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """The cached prefix of ``token_ids`` in any tier, one reference taken on each block
        (``salt``: the request's ``cache_salt``, which names its blocks)."""

    @abstractmethod
    def hold_device_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """The device-resident part of the cached prefix of ``token_ids``, held (the
        slower-tier rest is let go: a receiver writes only device blocks)."""

    @abstractmethod
    def alloc(self, num_blocks: int) -> list[int]:
        """``num_blocks`` device blocks, whatever they hold, held (a link probe sends them).
        Raises ``MemPoolError`` when there is no room."""

    @abstractmethod
    def free(self, addrs: list[int]) -> None:
        """Drop the references a transfer held."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    @abstractmethod
    def block_nbytes(self) -> int:
        """Bytes of one block: every layer's K and V."""

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Layers a block holds (a by-layer send has one frame each)."""

    @abstractmethod
    def add_step_hooks(self, make: Callable[[StepPlan], LayerHooks | None]) -> None:
        """Have ``make(plan)`` give each step's layer hooks (wait for layer i, save layer i)."""

    @abstractmethod
    def read_layer(self, blocks: list[int], layer: int) -> memoryview:
        """Layer ``layer`` of device blocks ``blocks``, copied out for a send."""


class MemPoolKVConnector(KVConnector):
    """KV kept in this instance's MemPool tiers, moved by the runner (``worker``)."""

    def __init__(self, mempool: MemPool, worker: KVConnectorWorker) -> None:
        self.mempool = mempool
        self.worker = worker
        self._adopted: dict[str, ComputedPrefix] = {}
        self._retain: set[str] = set()
        self._retained: dict[str, list[int]] = {}

    # ------------------------------------------------------- tokens found elsewhere
    def adopt(self, request_id: str, addrs: list[int], num_tokens: int) -> None:
        self._adopted[request_id] = ComputedPrefix(list(addrs), num_tokens=num_tokens)

    def has_adopted(self, request_id: str) -> bool:
        return request_id in self._adopted

    def take_adopted(self, request_id: str) -> ComputedPrefix | None:
        return self._adopted.pop(request_id, None)

    def release_adopted(self, keep: str) -> bool:
        victim = next((rid for rid in reversed(self._adopted) if rid != keep), None)
        if victim is None:
            return False
        self.mempool.free_mem(self._adopted.pop(victim).device)
        return True

    # ------------------------------------------------------------------ delay free
    def retain(self, request_id: str) -> None:
        self._retain.add(request_id)

    def request_finished(self, request_id: str, finished: bool, addrs: list[int]) -> bool:
        adopted = self._adopted.pop(request_id, None)
        if adopted is not None:
            self.mempool.free_mem(adopted.device)
        if request_id in self._retain and finished:
            self._retain.discard(request_id)
            self._retained[request_id] = addrs
            return True
        return False

    def take_retained(self, request_id: str) -> list[int]:
        self._retain.discard(request_id)
        return self._retained.pop(request_id, [])

    # ------------------------------------------------- blocks for senders, receivers
    def hold_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        return self.mempool.match(token_ids, take_ref=True, salt=salt)

    def hold_device_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        hit = self.hold_prefix(token_ids, salt)
        device = next((i for i, a in enumerate(hit) if addr_tier(a) != Tier.DEVICE), len(hit))
        if device < len(hit):
            self.mempool.free_mem(hit[device:])
        return hit[:device]

    def alloc(self, num_blocks: int) -> list[int]:
        return self.mempool.alloc_mem(num_blocks)

    def free(self, addrs: list[int]) -> None:
        self.mempool.free_mem(addrs)

    @property
    def block_size(self) -> int:
        return self.mempool.block_size

    @property
    def block_nbytes(self) -> int:
        mover = self.mempool.mover
        if mover is None:
            raise RuntimeError("this MemPool has no block mover: it moves no bytes")
        return mover.block_nbytes

    @property
    def num_layers(self) -> int:
        return self.worker.num_layers

    # ------------------------------------------------------------------ worker side
    def add_step_hooks(self, make: Callable[[StepPlan], LayerHooks | None]) -> None:
        self.worker.add_step_hooks(make)

    def read_layer(self, blocks: list[int], layer: int) -> memoryview:
        return self.worker.read_layer(blocks, layer)
