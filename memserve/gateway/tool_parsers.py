"""How a model family writes tool calls in its text, for ``tool_choice: "auto"``
(``--tool-call-parser``, named as vLLM names its parsers):

- ``hermes`` (Qwen2.5/3, Hermes, SmolLM3, ...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one tag a call, after any text;
- ``llama3_json`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}``,
  calls separated by ``;``, optionally after ``<|python_tag|>``;
- ``mistral`` (Mistral, Mixtral): ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``,
  after any text.

``auto`` picks by the chat template: the parser whose marker the template writes, else
``hermes``. A parser finds where the calls start (``start``) and reads them
(``calls``); text before the start is the message's content. Output that does not parse
as calls stays content: a model that did not follow its format loses nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

AUTO = "auto"

Call = tuple[str, Any]  # (function name, arguments as the model wrote them)


@dataclass(frozen=True)
class ToolCallParser:
    name: str
    markers: tuple[str, ...]  # what opens the calls
    at_start_only: bool  # the calls can only open the output (after whitespace)
    read: Callable[[str], list[Call]]  # the text from the marker on -> calls; raises ValueError

    def start(self, text: str) -> int:
        """Where the calls begin in ``text``; -1 when they do not (yet)."""
        if self.at_start_only:
            body = text.lstrip()
            return len(text) - len(body) if any(body.startswith(m) for m in self.markers) else -1
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found, default=-1)

    def may_start(self, text: str) -> int:
        """How many characters at the end of ``text`` might begin a marker (held back
        while streaming); for ``at_start_only``, all of it until the output decides."""
        if self.at_start_only:
            body = text.lstrip()
            return len(text) if any(m.startswith(body) for m in self.markers) else 0
        return max((n for m in self.markers for n in range(min(len(text), len(m) - 1), 0, -1)
                    if m.startswith(text[-n:])), default=0)

    def calls(self, text: str) -> list[Call]:
        """The calls in ``text`` (from ``start`` on); ValueError when they do not parse."""
        try:
            calls = self.read(text)
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(str(exc)) from exc
        if not calls or not all(isinstance(name, str) for name, _ in calls):
            raise ValueError("no call")
        return calls


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _json_objects(text: str, separators: str) -> list[Any]:
    """The JSON values written one after another in ``text``, between ``separators``."""
    decoder, i = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def _read_hermes(text: str) -> list[Call]:
    found = [json.loads(body) for body in _HERMES_CALL.findall(text)]
    return [(item["name"], item.get("arguments", {})) for item in found]


def _read_llama3(text: str) -> list[Call]:
    body = text.lstrip().removeprefix("<|python_tag|>")
    return [(item["name"], item.get("parameters", item.get("arguments", {}))) for item in _json_objects(body, ";")]


def _read_mistral(text: str) -> list[Call]:
    body = text[text.index("[TOOL_CALLS]") + len("[TOOL_CALLS]"):]
    items = [item for value in _json_objects(body, "") for item in (value if isinstance(value, list) else [value])]
    return [(item["name"], item.get("arguments", {})) for item in items]


PARSERS = {
    "hermes": ToolCallParser("hermes", ("<tool_call>",), False, _read_hermes),
    "llama3_json": ToolCallParser("llama3_json", ("<|python_tag|>", '{"name"'), True, _read_llama3),
    "mistral": ToolCallParser("mistral", ("[TOOL_CALLS]",), False, _read_mistral),
}
# What a chat template writes when it teaches its model the format (checked in this order).
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("<tool_call>", "hermes"))


def tool_call_parser(name: str, chat_template: str | None) -> ToolCallParser:
    """The parser named by ``--tool-call-parser``; ``auto``: the one the template writes."""
    if name != AUTO:
        return PARSERS[name]
    template = chat_template or ""
    return PARSERS[next((parser for marker, parser in _TEMPLATE_MARKERS if marker in template), "hermes")]
