"""``cache_control`` on chat messages: per-request retention of a conversation's prefix.

The shape hosted chat APIs use: ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (``ttl``
defaults to ``5m``), on a message or on one of its text parts. It pins the prompt up to
and including that message (a part's marker pins its whole message) for the TTL; with
several markers the last one counts, since its prefix holds the others'. The worker
keeps the pinned blocks cached on some tier for the TTL within ``--max-pinned-fraction``
(``kvcache/pinning.py``) and one API key's share of it; past either cap the request is
served unpinned, with an ``x-memserve-cache-pin`` header saying why.

The gateway turns the message index into a token count: the conversation rendered up to
that message, without a generation prompt, is a prefix of the whole prompt's tokens for
the chat templates we serve; where a template renders a message differently once
others follow it (or truncation cut the conversation), the shared prefix is pinned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memserve.gateway.errors import bad_request

TTLS_S = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"


@dataclass(frozen=True)
class CachePin:
    message_index: int  # the prompt is pinned up to and including this message
    ttl_s: float


def parse_cache_control(messages: Any) -> CachePin | None:
    """The last ``cache_control`` marker of the raw ``messages``, validated (400 on a bad
    one); None when there is none. Call after the messages themselves were validated."""
    pin = None
    for i, message in enumerate(messages):
        parts = message.get("content") if isinstance(message.get("content"), list) else []
        markers = [(f"messages[{i}].cache_control", message.get("cache_control"))]
        markers += [(f"messages[{i}].content[{j}].cache_control", part.get("cache_control"))
                    for j, part in enumerate(parts)]
        for param, marker in markers:
            if marker is not None:
                pin = CachePin(i, marker_ttl_s(marker, param))
    return pin


def marker_ttl_s(marker: Any, param: str) -> float:
    """The TTL in seconds of one ``cache_control`` marker; 400 naming ``param`` when malformed."""
    ttl = marker.get("ttl", DEFAULT_TTL) if isinstance(marker, dict) else None
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral" or not isinstance(ttl, str) or \
            ttl not in TTLS_S or set(marker) - {"type", "ttl"}:
        raise bad_request(f"'{param}' must be {{\"type\": \"ephemeral\"}} with an optional \"ttl\" of "
                          f"{' or '.join(repr(t) for t in TTLS_S)}", param)
    return TTLS_S[ttl]
