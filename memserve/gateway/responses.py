"""OpenAI response shapes for /v1/completions and /v1/chat/completions: whole
responses, stream chunks and usage, as OpenAI's published schemas define them
(``tests/test_openai_schema.py`` validates every shape against them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

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

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> dict:
        body = self._envelope(self.object_name, [self._full_choice(text, finish_reason)])
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return self._envelope(self.chunk_object_name, [self._chunk_choice(text, finish_reason)])

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage.to_dict()
        return body

    def opening_chunk(self) -> dict | None:
        """Sent before any text (chat announces the assistant role)."""
        return None

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    _chunk_choice = _full_choice


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None,
                "finish_reason": finish_reason}

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening_chunk(self) -> dict:
        return self._envelope(self.chunk_object_name, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}])
