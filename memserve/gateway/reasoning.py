"""Reasoning models' thoughts apart from their answer (``--reasoning-parser``, as vLLM
names its parsers): the text between ``<think>`` and ``</think>`` goes to the message's
``reasoning_content`` (``delta.reasoning_content`` when streaming), the rest to
``content``.

- ``qwen3``: the model opens ``<think>`` itself; an output that does not begin with it
  (``enable_thinking: false`` in ``chat_template_kwargs``) is all content.
- ``deepseek_r1``: the chat template opens ``<think>``, so the output begins inside the
  reasoning (an explicit ``<think>`` is dropped); without ``</think>`` it is all reasoning.

The blank lines right after ``</think>`` are dropped, as the templates write them. While
streaming, text that may be the beginning of a tag is held back until it is told apart,
so a tag never reaches the client split or as content."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memserve.gateway.responses import ChatFormat

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the template opened the reasoning: the output begins in it


PARSERS = {"qwen3": ReasoningParser("qwen3", False), "deepseek_r1": ReasoningParser("deepseek_r1", True)}


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` begin ``tag``."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)


@dataclass
class ReasoningStream:
    """One choice's text, split into reasoning and content deltas as it arrives."""

    parser: ReasoningParser
    state: str = "opening"  # opening (not told yet) | reasoning | content
    held: str = ""
    after_end: bool = False  # content begins: drop its leading blank lines
    parts: dict[str, str] = field(default_factory=dict)

    def feed(self, text: str) -> dict[str, str]:
        """The ``reasoning_content`` and ``content`` deltas this text completes."""
        self.parts = {}
        self.held += text
        if self.state == "opening":
            body = self.held.lstrip()
            if body.startswith(START):
                self.state, self.held = "reasoning", body[len(START):]
            elif START.startswith(body):
                return {}  # maybe the tag, not told yet
            else:
                self.state = "reasoning" if self.parser.starts_inside else "content"
        if self.state == "reasoning":
            end = self.held.find(END)
            if end < 0:
                keep = _partial_tag(self.held, END)
                self._emit("reasoning_content", self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return self.parts
            self._emit("reasoning_content", self.held[:end])
            self.state, self.held, self.after_end = "content", self.held[end + len(END):], True
        if self.after_end:
            self.held = self.held.lstrip("\n")
            self.after_end = not self.held
        self._emit("content", self.held)
        self.held = ""
        return self.parts

    def finish(self) -> dict[str, str]:
        """What was held back, once the output ended."""
        self.parts = {}
        held, self.held = self.held, ""
        inside = self.state == "reasoning" or (self.state == "opening" and self.parser.starts_inside)
        if self.state == "opening":
            held = held.lstrip().removeprefix(START)
        self._emit("reasoning_content" if inside else "content", held)
        return self.parts

    def _emit(self, key: str, text: str) -> None:
        if text:
            self.parts[key] = self.parts.get(key, "") + text


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    stream = ReasoningStream(parser)
    parts = stream.feed(text)
    for key, value in stream.finish().items():
        parts[key] = parts.get(key, "") + value
    return parts.get("reasoning_content"), parts.get("content", "")


class ReasoningChatFormat(ChatFormat):
    """Chat responses and chunks with each choice's reasoning in ``reasoning_content``."""

    reasoning: ReasoningParser

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def choice(self, *args: Any, **kwargs: Any) -> dict:
        choice = super().choice(*args, **kwargs)
        message = choice["message"]
        message["reasoning_content"], message["content"] = split_reasoning(self.reasoning, message["content"] or "")
        return choice

    def chunk(self, *args: Any, **kwargs: Any) -> dict:
        chunk = super().chunk(*args, **kwargs)
        for choice in chunk["choices"]:
            stream = self._reasoning_streams.setdefault(choice["index"], ReasoningStream(self.reasoning))
            delta = choice["delta"]
            parts = stream.feed(delta.pop("content", None) or "")
            if choice["finish_reason"] is not None:
                for key, value in stream.finish().items():
                    parts[key] = parts.get(key, "") + value
            delta.update(parts)
        return chunk
