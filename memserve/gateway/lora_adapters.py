"""The LoRA adapters the gateway serves: a request names one as its ``model``.

They start as ``--lora-modules`` and change at run time (``lora_api.py``). Each is kept
with the digest of its files (``model_files/adapter_digest.py``), which requests carry
to the workers: it names the adapter's KV blocks (``kvcache/hashing.adapter_salt``) in
the gateway's mirrors as in the workers, and tells a worker which weights the request
was admitted under. A worker started again after a failure knows only its start
adapters; ``changes`` is what it must be told.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Protocol

from memserve.gateway.cluster import Cluster
from memserve.ipc.adapters import AdapterSet, SetAdapter
from memserve.model_files.adapter_digest import adapter_digest

log = logging.getLogger(__name__)
SET_TIMEOUT_S = 120.0  # a worker reads the adapter's files between two steps


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    digest: str


class AdapterRegistry:
    """Adapter name -> ``ServedAdapter``, in the order they were added."""

    def __init__(self, modules: dict[str, str] | None = None) -> None:
        """``modules``: ``--lora-modules`` (name -> folder); a folder that is not an adapter
        is refused here, naming the file it lacks."""
        self.start = {name: ServedAdapter(name, path, adapter_digest(path)) for name, path in (modules or {}).items()}
        self.served = dict(self.start)

    def get(self, name: str | None) -> ServedAdapter | None:
        return self.served.get(name) if name is not None else None

    def names(self) -> list[str]:
        return list(self.served)

    def set(self, name: str, adapter: ServedAdapter | None) -> None:
        """Serve ``adapter`` as ``name`` (None: serve ``name`` no more)."""
        if adapter is None:
            self.served.pop(name, None)
        else:
            self.served[name] = adapter

    def changes(self) -> list[tuple[str, ServedAdapter | None]]:
        """What a worker started with ``--lora-modules`` must be told to serve what is
        served now: adapters added or replaced, then those no longer served (None)."""
        added = [(name, a) for name, a in self.served.items() if self.start.get(name) != a]
        removed: list[tuple[str, ServedAdapter | None]] = [(name, None) for name in self.start
                                                           if name not in self.served]
        return [*added, *removed]


class AdapterRefused(Exception):
    """A worker would not serve the adapter; the message says why."""


class WorkerAsker(Protocol):
    """What telling the workers needs of the engine client."""

    cluster: Cluster

    @property
    def transfer_ids(self) -> Iterator[int]:
        ...

    async def ask(self, worker: int, msg: Any, timeout_s: float) -> Any:
        ...


class WorkerAdapters:
    """Changes the adapters every live worker serves, together (``lora_api.AdapterChanger``)."""

    def __init__(self, client: WorkerAsker, registry: AdapterRegistry) -> None:
        self.client, self.registry = client, registry

    def served_adapters(self) -> list[str]:
        return self.registry.names()

    async def set_adapter(self, name: str, path: str | None) -> None:
        """Serve ``name`` from ``path`` on every live worker (None: no more). A worker's
        refusal undoes a load on the others and raises ``AdapterRefused`` with its reason;
        a worker that dies meanwhile is told again when it comes back (``rejoin``)."""
        adapter = ServedAdapter(name, path, adapter_digest(path)) if path is not None else None
        workers = [h.instance_id for h in self.client.cluster.workers.values() if h.alive]
        errors = await asyncio.gather(*(self._tell(w, name, adapter) for w in workers))
        refused = [f"worker {w}: {e}" for w, e in zip(workers, errors) if e]
        if refused and adapter is not None:
            await asyncio.gather(*(self._tell(w, name, None) for w, e in zip(workers, errors) if not e))
            raise AdapterRefused("; ".join(refused))
        self.registry.set(name, adapter)

    async def rejoin(self, instance: int) -> None:
        """Bring a worker started again up to the adapters served now."""
        for name, adapter in self.registry.changes():
            error = await self._tell(instance, name, adapter)
            if error:
                log.error("worker %d cannot serve LoRA adapter %r: %s", instance, name, error)

    async def _tell(self, worker: int, name: str, adapter: ServedAdapter | None) -> str | None:
        """The worker's refusal, or None; a worker that died meanwhile refuses nothing."""
        msg = SetAdapter(next(self.client.transfer_ids), name, adapter.path if adapter else None,
                         adapter.digest if adapter else "")
        try:
            reply: AdapterSet = await self.client.ask(worker, msg, SET_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError) as exc:
            if not self.client.cluster.workers[worker].alive:
                return None
            return f"no answer ({type(exc).__name__})"
        return reply.error
