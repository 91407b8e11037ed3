"""A request in flight between the gateway and its workers, as the engine client and the
disaggregated flow (``pd_flow.py``) both track it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from memserve.ipc.messages import RequestOutput


@dataclass
class RequestStream:
    """A request in flight: where it runs and whether a token reached the caller yet."""

    worker: int
    pinned: bool = False
    started: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Disaggregated (gateway/pd_flow.py): the decode instance taking it over, and whether
    # it can resume elsewhere after tokens were streamed (a death then means a retry).
    peer: int | None = None
    resumable: bool = False


# Put on a stream's queue when its worker died before the first token: send it again.
RETRY = RequestOutput("", [], False, "retry")
