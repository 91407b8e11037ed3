"""The messages of the gateway's KV link probe (``gateway/link_probe.py``): a worker is
asked to send blocks of its KV pool to a peer, so that the gateway can time the link
between them as a prefix pull uses it. Registered with the codec on import, as the KV
transfer messages are; the receiver is told to expect the transfer with the usual
``ExpectTransfer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memserve.ipc.messages import register


@dataclass
class ProbeTransfer:
    """Gateway -> worker: send ``num_blocks`` blocks of your KV pool, whatever they hold,
    to ``dst_instance`` under ``ticket`` (the receiver frees them on arrival). Answered
    by ``ProbeDone``."""

    kind: ClassVar[str] = "probe_transfer"
    transfer_id: int
    dst_instance: int
    num_blocks: int
    ticket: str


@dataclass
class ProbeDone:
    """Worker -> gateway: the probe's blocks reached the receiver (``num_bytes`` of KV),
    or ``error``."""

    kind: ClassVar[str] = "probe_done"
    transfer_id: int
    num_bytes: int
    error: str | None = None


register(ProbeTransfer)
register(ProbeDone)
