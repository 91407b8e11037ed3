"""What /v1/messages returns, in the shapes of Anthropic's Messages API: the message, its
usage, the server-sent events that build it, and error objects.

A Messages request runs the chat pipeline (``app.py``), whose response format splits
reasoning off and parses tool calls (``reasoning.py``, ``tool_calls.py``).
``AnthropicFormat`` sits on top of that chat format and re-words what it produces: a chat
message becomes content blocks (``thinking``, then ``text``, then one ``tool_use`` per
call), and each streamed chat delta becomes the events that open, fill and close those
blocks. Both paths feed the same ``ContentBlocks``, so a stream builds exactly the blocks
of the same message unstreamed.

Usage follows Anthropic's split of the prompt: ``cache_read_input_tokens`` were found
cached (on any tier), ``cache_creation_input_tokens`` were written under a
``cache_control`` pin (the pinned prefix less what was read; 0 without a pin, or when the
engine refused it), ``input_tokens`` are the rest. A stream's ``message_start`` has them
as the engine's first output told them (``output_tokens`` 0); its closing
``message_delta`` carries the final figures, which clients take over (they are cumulative)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson

from memserve.gateway.errors import error_type
from memserve.gateway.responses import ChatFormat, Usage

# The error ``type`` Anthropic gives each status; others: invalid_request_error (4xx), api_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}
# OpenAI error bodies name their status (errors.error_type); streams get them by that name.
_STATUS_OF_TYPE = {error_type(s.value): s.value for s in HTTPStatus if s.value >= 400}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_BLOCKS = {"reasoning_content": ("thinking", "thinking_delta"), "content": ("text", "text_delta")}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP status."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai_error(body: dict, status: int | None = None) -> dict:
    """Anthropic's error object for an OpenAI one (``errors.error_body``); the status is
    read from its ``type`` when not given."""
    error = body["error"] if isinstance(body.get("error"), dict) else {}
    if status is None:
        status = _STATUS_OF_TYPE.get(str(error.get("type")), 500)
    return error_body(status, str(error.get("message") or HTTPStatus(status).phrase))


def anthropic_usage(usage: Usage) -> dict:
    read = usage.cached_tokens
    created = max(0, usage.pinned_tokens - read)
    return {"input_tokens": max(0, usage.prompt_tokens - read - created), "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict:
    """A call's arguments as ``input``; what is not a JSON object (output cut by
    max_tokens) is an empty one, and stop_reason says why."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _empty_block(kind: str) -> dict:
    """A text or thinking block as it opens (thinking blocks are not signed here)."""
    return {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}


class ContentBlocks:
    """One message's content blocks as its chat deltas arrive (``feed``), and the stream
    events each delta makes. Blocks come one at a time: a delta of another kind (reasoning,
    text, a new tool call) closes the block open before it."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._arguments: dict[int, str] = {}  # a tool_use block's input JSON so far, by block index
        self._open = False

    def feed(self, delta: dict) -> list[dict]:
        """The events of one chat delta (or of a whole chat message): its
        ``reasoning_content``, ``content`` and ``tool_calls``, in that order."""
        events: list[dict] = []
        for key, (kind, delta_type) in _BLOCKS.items():
            if delta.get(key):
                if not self._open or self.blocks[-1]["type"] != kind:
                    events += self._start(_empty_block(kind))
                self.blocks[-1][kind] += delta[key]
                events.append(self._delta({"type": delta_type, kind: delta[key]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self._start({"type": "tool_use", "id": _tool_use_id(call["id"]),
                                       "name": function.get("name") or "", "input": {}})
                self._arguments[len(self.blocks) - 1] = ""
            arguments = function.get("arguments") or ""
            if arguments and self._open and self.blocks[-1]["type"] == "tool_use":
                self._arguments[len(self.blocks) - 1] += arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[dict]:
        """Ends the open block."""
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def content(self) -> list[dict]:
        """The blocks as a whole message has them (tool inputs parsed)."""
        return [{**block, "input": _tool_input(self._arguments[i])} if block["type"] == "tool_use" else dict(block)
                for i, block in enumerate(self.blocks)]

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.blocks.append(block)
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


class AnthropicFormat(ChatFormat):
    """The Messages API over a chat format (``anthropic_format`` puts it first in the
    class's bases, so ``super()`` reaches the request's tool-call and reasoning parsing).
    Stream chunks are batches of events (``{"events": [...]}``); ``sse`` writes them."""

    id_prefix = "msg_"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._blocks = ContentBlocks()
        self._finish_reason: str | None = None
        self._stop_string: str | None = None
        self._usage = Usage(prompt_tokens=0)

    def started(self, usage: Usage) -> None:
        self._usage = usage  # for message_start

    def ended(self, index: int, stop_string: str | None) -> None:
        self._stop_string = stop_string  # stop_reason "stop_sequence" names it

    def response(self, choices: list[dict], usage: Usage) -> dict:
        choice = choices[0]
        self._blocks.feed(choice["message"])
        return self._message(self._blocks.content(), choice["finish_reason"], usage)

    def opening_chunk(self, index: int = 0) -> dict:
        return {"events": [{"type": "message_start", "message": self._message([], None, self._usage)},
                           {"type": "ping"}]}

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
        choice = super().chunk(text, finish_reason, logprobs, index)["choices"][0]
        events = self._blocks.feed(choice["delta"])
        if choice["finish_reason"] is not None:
            self._finish_reason = choice["finish_reason"]
            events += self._blocks.close()
        return {"events": events}

    def usage_chunk(self, usage: Usage) -> dict:
        reason, sequence = self._stop(self._finish_reason)
        return {"events": [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": anthropic_usage(usage)},
                           {"type": "message_stop"}]}

    def sse(self, obj: dict) -> bytes:
        """A batch of events, or an error body (a failure once streaming) as an ``error`` event."""
        events = [from_openai_error(obj)] if "error" in obj else obj["events"]
        return b"".join(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
                        for event in events)

    def sse_end(self) -> bytes:
        return b""

    def _stop(self, finish_reason: str | None) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) of a chat finish reason."""
        if finish_reason is None:
            return None, None
        if finish_reason == "stop" and self._stop_string is not None:
            return "stop_sequence", self._stop_string
        return STOP_REASONS.get(finish_reason, "end_turn"), None

    def _message(self, content: list[dict], finish_reason: str | None, usage: Usage) -> dict:
        reason, sequence = self._stop(finish_reason)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": anthropic_usage(usage)}


def anthropic_format(chat_format: type[ChatFormat]) -> type[AnthropicFormat]:
    """The response format of one Messages request, over the chat format its tools and
    the server's parsers call for."""
    return type("AnthropicFormat", (AnthropicFormat, chat_format), {})
