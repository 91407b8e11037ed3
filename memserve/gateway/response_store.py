"""Stored responses of the Responses API (``store: true``), for ``GET``/``DELETE
/v1/responses/{id}`` and for ``previous_response_id`` to continue a conversation.

The store lives in the gateway's memory and is bounded both in number (the oldest
response goes first) and in age (a response older than ``ttl_s`` is gone), so a client
that never deletes what it stored cannot grow the gateway without bound. Every response
belongs to the API key that created it (its ``key_id``; "" when the server has no keys):
another key is told it does not exist, exactly as for an id never stored, so an id
leaks nothing across keys.

A stored conversation is its items in order: the input items of every turn so far and
each turn's output items. A continued turn's list begins with the very same item objects
as the one it continues, so a long chain of turns shares its items rather than copying them."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the key_id of the API key that created it
    response: dict  # the response object, as it was returned
    conversation: list[dict]  # the items a request naming it continues from
    stored_at: float  # the store's clock


class ResponseStore:
    """Responses by id, at most ``max_responses`` of them and none older than ``ttl_s``
    seconds (``max_responses`` 0: nothing is kept). ``clock`` is monotonic seconds."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_responses < 0 or ttl_s <= 0:
            raise ValueError("a response store needs max_responses >= 0 and ttl_s > 0")
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._responses)

    def put(self, owner: str, response: dict, conversation: list[dict]) -> None:
        """Keep ``response`` (under its ``id``), evicting the oldest past the bound."""
        self._expire()
        if self.max_responses == 0:
            return
        self._responses[response["id"]] = StoredResponse(owner, response, conversation, self._clock())
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response if it exists, has not expired and belongs to ``owner``."""
        self._expire()
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        """Whether ``owner``'s response was there to delete."""
        if self.get(owner, response_id) is None:
            return False
        del self._responses[response_id]
        return True

    def _expire(self) -> None:
        """Every response has the same lifetime, so the expired ones are the oldest."""
        deadline = self._clock() - self.ttl_s
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if oldest.stored_at > deadline:
                break
            self._responses.popitem(last=False)
