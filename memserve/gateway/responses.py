"""OpenAI response shapes for /v1/completions and /v1/chat/completions: whole
responses, stream chunks and usage, as OpenAI's published schemas define them
(``tests/e2e/test_openai_schema.py`` validates every shape against them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import orjson

from memserve.gateway.logprobs import (
    CompletionLogprobs,
    LoggedToken,
    TokenStrings,
    chat_logprobs,
)

# Renders one choice's logged tokens as its ``logprobs`` object (stateful per choice).
LogprobsRenderer = Callable[[list[LoggedToken]], dict]


def typed_events(events: list[dict]) -> bytes:
    """Server-sent events whose ``event:`` line names each one's ``type``, as the streams
    of the Responses and Messages APIs have them (chat streams have ``data:`` lines only)."""
    return b"".join(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
                    for event in events)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    pinned_tokens: int = 0  # the prompt's head a cache_control pin holds (0: no pin, or the engine refused it)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class ResponseFormat:
    """Builds one endpoint's JSON objects; subclasses differ only in object names and
    in how a choice carries its text."""

    id_prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, created: int) -> None:
        self.id = request_id
        self.model = model
        self.created = created

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, choices: list[dict], usage: Usage) -> dict:
        """A whole response of ``choice(...)`` objects."""
        body = self._envelope(self.object_name, choices)
        body["usage"] = usage.to_dict()
        return body

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, **self._full_choice(text, finish_reason), "logprobs": logprobs}

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
        choice = {"index": index, **self._chunk_choice(text, finish_reason), "logprobs": logprobs}
        return self._envelope(self.chunk_object_name, [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage.to_dict()
        return body

    def opening_chunk(self, index: int = 0) -> dict | None:
        """Sent before any text of a choice (chat announces the assistant role)."""
        return None

    def sse(self, obj: dict) -> bytes:
        """How a stream writes one object built here (a chunk), or an error body."""
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def sse_end(self) -> bytes:
        """What ends a stream."""
        return b"data: [DONE]\n\n"

    def started(self, usage: Usage) -> None:
        """Told the prompt's usage once the engine's first outputs came, before a stream's
        opening chunks (Anthropic's message_start reports it)."""

    def ended(self, index: int, stop_string: str | None) -> None:
        """Told which stop string ended choice ``index`` (None: none did), before its
        last chunk or its choice is built (Anthropic's stop_sequence names it)."""

    def logprobs_renderer(self, strings: TokenStrings) -> LogprobsRenderer:
        raise NotImplementedError

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def logprobs_renderer(self, strings: TokenStrings) -> LogprobsRenderer:
        return CompletionLogprobs(strings).render

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"text": text, "finish_reason": finish_reason}

    _chunk_choice = _full_choice


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs_renderer(self, strings: TokenStrings) -> LogprobsRenderer:
        return lambda tokens: chat_logprobs(tokens, strings)

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"message": {"role": "assistant", "content": text, "refusal": None}, "finish_reason": finish_reason}

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if text else {}
        return {"delta": delta, "finish_reason": finish_reason}

    def opening_chunk(self, index: int = 0) -> dict:
        return self._envelope(self.chunk_object_name, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}])
