"""The messages that change which LoRA adapters a worker serves at run time
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; ``gateway/lora_api.py``).
Registered with the codec on import; answered the way transfers are, by ``transfer_id``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memserve.ipc.messages import register


@dataclass
class SetAdapter:
    """Gateway -> worker: serve LoRA adapter ``name`` from the folder ``path`` (its files'
    digest ``digest``) from now on; ``path`` None: serve it no more. Answered by
    ``AdapterSet``."""

    kind: ClassVar[str] = "set_adapter"
    transfer_id: int
    name: str
    path: str | None
    digest: str = ""


@dataclass
class AdapterSet:
    """Worker -> gateway: the adapter is served (or no more), or ``error`` says why not."""

    kind: ClassVar[str] = "adapter_set"
    transfer_id: int
    error: str | None = None


register(SetAdapter)
register(AdapterSet)
