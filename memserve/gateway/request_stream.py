"""A request in flight between the gateway and its workers, as the engine client and the
disaggregated flow (``pd_flow.py``) both track it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from memserve.ipc.messages import RequestOutput


@dataclass
class RequestStream:
    """A request in flight: where it runs and whether it produced a token yet."""

    worker: int
    started: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Disaggregated (gateway/pd_flow.py): the decode instance taking it over.
    peer: int | None = None


# Put on a stream's queue when its worker (or peer) died: the request's own loop moves it
# to a live worker or fails it (gateway/request_retry.py, gateway/pd_flow.py).
RETRY = RequestOutput("", [], False, "retry")
