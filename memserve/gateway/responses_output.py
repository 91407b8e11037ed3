"""What /v1/responses returns: the response object, its output items and, when
streaming, the typed events that build them, in the shapes of OpenAI's Responses API.

A Responses request runs the chat pipeline (``app.py``), whose response format splits
reasoning off and parses tool calls (``reasoning.py``, ``tool_calls.py``).
``ResponsesFormat`` sits on top of that chat format and re-words what it produces: a
whole chat message becomes output items (``reasoning``, then a ``message``, then one
``function_call`` per call), and each streamed chat delta becomes the events that open,
fill and close those items. Since both paths feed the same ``OutputItems``, a stream's
items are exactly those of the same response unstreamed.

Streams are server-sent events with an ``event:`` line naming each event's ``type``,
numbered by ``sequence_number`` in the order written, and with no ``[DONE]``: the last
event is ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut
the output), or ``error`` when the request failed once streaming."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from memserve.gateway.response_store import ResponseStore
from memserve.gateway.responses import ChatFormat, Usage, typed_events

_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_item(kind: str) -> dict:
    """An assistant message or a reasoning item, before its text part is added."""
    if kind == "message":
        return {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
    return {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}


def _text_part(kind: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": ""}


class OutputItems:
    """One response's output items as its chat deltas arrive (``feed``), and the stream
    events each delta makes. Items come one at a time: a delta of another kind (reasoning,
    content, a new tool call) closes the item open before it (``close``)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.reasoning = ""  # all reasoning text, for usage's reasoning_tokens
        self._open: dict | None = None

    def feed(self, delta: dict) -> list[dict]:
        """The events of one chat delta (or of a whole chat message): its
        ``reasoning_content``, ``content`` and ``tool_calls``, in that order."""
        events: list[dict] = []
        if delta.get("reasoning_content"):
            self.reasoning += delta["reasoning_content"]
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """Ends the open item (``status``: "incomplete" when the output was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            done = {"type": _TEXT_EVENTS[item["type"]] + ".done", **where, "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": item})
        return events

    def _add(self, item: dict) -> list[dict]:
        """Opens ``item``; the event carries a copy, as the item fills after it is sent."""
        events = self.close()
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": {**item, **({"content": []} if "content" in item else {})}})
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        item = self._open
        if item is None or item["type"] != kind:
            item = _text_item(kind)
            events += self._add(item)
            part = _text_part(kind)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
        item["content"][0]["text"] += text
        delta = {"type": _TEXT_EVENTS[kind] + ".delta", "item_id": item["id"], "output_index": len(self.items) - 1,
                 "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return events + [delta]

    def _call(self, call: dict) -> list[dict]:
        """A chat tool call (or a streamed fragment of one: the first has its id and name,
        later ones only more arguments) as a ``function_call`` item."""
        events: list[dict] = []
        function = call.get("function") or {}
        if call.get("id"):
            events += self._add({"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                                 "call_id": call["id"], "name": function.get("name") or "", "arguments": ""})
        item = self._open
        arguments = function.get("arguments") or ""
        if arguments and item is not None and item["type"] == "function_call":
            item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "delta": arguments})
        return events


def usage_object(usage: Usage, reasoning_tokens: int) -> dict:
    """The Responses API's usage; memserve has no billed cache writes (always 0)."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def response_object(response_id: str, created_at: int, model: str, echo: dict, status: str, output: list[dict],
                    usage: dict | None) -> dict:
    """A response object; ``echo`` holds the request fields it repeats (instructions,
    tools, tool_choice, temperature, ...)."""
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "usage": usage, **echo}


@dataclass
class ResponseTurn:
    """What the response of one request needs besides its output: the request fields it
    repeats, the conversation it continues, and where it is stored (``store``: None when
    the request said ``store: false``)."""

    echo: dict
    conversation: list[dict]  # the previous response's conversation, then this request's input items
    store: ResponseStore | None
    owner: str  # the API key's id
    count_tokens: Callable[[str], int]

    def save(self, response: dict, output: list[dict]) -> None:
        if self.store is not None:
            self.store.put(self.owner, response, self.conversation + output)


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesFormat(ChatFormat):
    """The Responses API over a chat format (``responses_format`` puts it first in the
    class's bases, so ``super()`` reaches the request's tool-call and reasoning parsing).
    Stream chunks are batches of events (``{"events": [...]}``); ``sse`` writes them."""

    id_prefix = "resp_"
    turn: ResponseTurn

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._items = OutputItems()
        self._sequence = 0
        self._finish_reason: str | None = None

    def response(self, choices: list[dict], usage: Usage) -> dict:
        message, finish_reason = choices[0]["message"], choices[0]["finish_reason"]
        self._items.feed(message)
        self._items.close(_item_status(finish_reason))
        return self._finished(finish_reason, usage)

    def opening_chunk(self, index: int = 0) -> dict:
        snapshot = self._object("in_progress", None)
        return {"events": [{"type": "response.created", "response": snapshot},
                           {"type": "response.in_progress", "response": snapshot}]}

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
        choice = super().chunk(text, finish_reason, logprobs, index)["choices"][0]
        events = self._items.feed(choice["delta"])
        if choice["finish_reason"] is not None:
            self._finish_reason = choice["finish_reason"]
            events += self._items.close(_item_status(self._finish_reason))
        return {"events": events}

    def usage_chunk(self, usage: Usage) -> dict:
        response = self._finished(self._finish_reason, usage)
        return {"events": [{"type": "response." + response["status"], "response": response}]}

    def sse(self, obj: dict) -> bytes:
        """A batch of events, or an error body (a failure once streaming) as an ``error`` event."""
        if "error" in obj:
            error = obj["error"]
            events = [{"type": "error", "code": error.get("code"), "message": error.get("message"),
                       "param": error.get("param")}]
        else:
            events = obj["events"]
        for event in events:
            event["sequence_number"] = self._sequence
            self._sequence += 1
        return typed_events(events)

    def sse_end(self) -> bytes:
        return b""

    def _object(self, status: str, usage: dict | None) -> dict:
        return response_object(self.id, self.created, self.model, self.turn.echo, status, list(self._items.items),
                               usage)

    def _finished(self, finish_reason: str | None, usage: Usage) -> dict:
        """The complete response, stored unless the request said ``store: false``."""
        reasoning_tokens = self.turn.count_tokens(self._items.reasoning) if self._items.reasoning else 0
        response = self._object(_item_status(finish_reason), usage_object(usage, reasoning_tokens))
        self.turn.save(response, response["output"])
        return response


def responses_format(chat_format: type[ChatFormat], turn: ResponseTurn) -> type[ResponsesFormat]:
    """The response format of one Responses request, over the chat format its tools and
    the server's parsers call for."""
    return type("ResponsesFormat", (ResponsesFormat, chat_format), {"turn": turn})
