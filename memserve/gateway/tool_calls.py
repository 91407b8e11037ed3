"""Tool calls: ``tools`` + ``tool_choice`` in, ``message.tool_calls`` out.

``required`` and a named function work with any model: the output is constrained by a
grammar (``structured_output.py``) to, respectively, a JSON array of
``{"name", "parameters"}`` objects (as vLLM does) and the named function's arguments.
``auto`` lets the model decide, which only a model whose chat template describes the
tools can: the tools go to the template and calls come back in the model family's form,
read by ``--tool-call-parser`` (``tool_parsers.py``: Hermes' ``<tool_call>`` tags,
Llama 3.1's JSON, Mistral's ``[TOOL_CALLS]``). A template without tool support gets a
400 for ``auto``.
``none`` leaves the tools out of the prompt and the output as text.

Whatever the mode, a choice that called tools has ``content: null`` (unless the model
wrote text before its calls), ``tool_calls`` with ``call_...`` ids and arguments as a JSON
string, and ``finish_reason: "tool_calls"`` when generation stopped by itself. Streams
carry ``delta.tool_calls`` as OpenAI sends them: the first delta of a call has its id,
type and name, later ones argument fragments (named functions stream their arguments as
generated; ``required`` and ``auto`` calls come whole once complete)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from memserve.gateway.errors import bad_request
from memserve.gateway.reasoning import ReasoningChatFormat, ReasoningParser
from memserve.gateway.responses import ChatFormat
from memserve.gateway.structured_output import json_schema_grammar
from memserve.gateway.tool_parsers import ToolCallParser

MAX_TOOLS = 128  # OpenAI's cap
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# The arguments of a function declared without parameters.
NO_PARAMETERS: dict = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolChoice:
    """A request's validated tools and what it asks of them."""

    mode: str  # "none" | "auto" | "required" | "function"
    tools: list[dict]  # fixed-shape copies, as the chat template sees them
    function: str | None = None  # the forced function (mode "function")
    grammar: str | None = None  # the output's grammar (modes "required" and "function")

    @property
    def template_tools(self) -> list[dict] | None:
        return None if self.mode == "none" else self.tools


def _tool(value: Any, index: int) -> dict:
    param = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type", "function") != "function" \
            or not isinstance(value.get("function"), dict):
        raise bad_request(f"'{param}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
    function = value["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'", f"{param}.function.name")
    copy: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise bad_request(f"'{param}.function.description' must be a string", f"{param}.function.description")
        copy["description"] = function["description"]
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise bad_request(f"'{param}.function.strict' must be a boolean", f"{param}.function.strict")
    parameters = function.get("parameters")
    if parameters is not None:
        json_schema_grammar(parameters, f"{param}.function.parameters")  # validated (and cached) now
    copy["parameters"] = NO_PARAMETERS if parameters is None else parameters
    return {"type": "function", "function": copy}


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' can hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    tools = [_tool(tool, i) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("'tools' names a function more than once", "tools")
    return tools


def _mode(body: dict, names: list[str]) -> tuple[str, str | None]:
    """(mode, forced function) of ``tool_choice``; absent: "auto" with tools, else "none"."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        mode, function = choice, None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        mode, function = "function", choice["function"]["name"]
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": string}}", "tool_choice")
    if mode != "none" and not names:
        raise bad_request("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if function is not None and function not in names:
        raise bad_request(f"'tool_choice' names function '{function}', which is not in 'tools'", "tool_choice")
    return mode, function


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """The request's tools and tool_choice, validated; None when it has no tools."""
    tools = _tools(body)
    mode, function = _mode(body, [t["function"]["name"] for t in tools])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:
        return None
    grammar = None
    if mode == "required":
        grammar = json_schema_grammar(_required_schema(tools, parallel), "tools")
    elif mode == "function":
        forced = next(t for t in tools if t["function"]["name"] == function)
        grammar = json_schema_grammar(forced["function"]["parameters"], "tools")
    return ToolChoice(mode, tools, function, grammar)


def template_inputs(messages: list[dict], choice: ToolChoice | None,
                    template_supports_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools the chat template renders. A template without tool
    support gets no tools, and, as it renders only ``content``, earlier calls join their
    assistant turn's content in Hermes' form, so that the model still sees what it called."""
    if choice is not None and choice.mode == "auto" and not template_supports_tools:
        raise bad_request("tool_choice 'auto' needs a chat template that describes tools, and this model's has no "
                          "tool support; use tool_choice 'required' or a named function, which constrain the "
                          "output to the tools' schemas", "tool_choice")
    if template_supports_tools:
        return messages, choice.template_tools if choice is not None else None
    if not any("tool_calls" in m for m in messages):
        return messages, None
    rendered = []
    for message in messages:
        if "tool_calls" in message:
            calls = "\n".join(f"{TOOL_CALL_START}\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                + f"\n{TOOL_CALL_END}" for c in message["tool_calls"])
            message = {**message, "content": "\n".join(filter(None, (message["content"], calls)))}
            del message["tool_calls"]
        rendered.append(message)
    return rendered, None


# ----------------------------------------------------------------------------- output


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name,
                                                                                   "arguments": arguments}}


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _required_calls(text: str) -> list[dict] | None:
    try:
        items = json.loads(text)
        return [_call(item["name"], _arguments(item["parameters"])) for item in items]
    except (ValueError, TypeError, KeyError):
        return None


def _auto_calls(parser: ToolCallParser, text: str) -> tuple[str, list[dict]] | None:
    """(content before the calls, calls), or None when the text holds no valid call."""
    start = parser.start(text)
    if start < 0:
        return None
    try:
        calls = [_call(name, _arguments(arguments)) for name, arguments in parser.calls(text[start:])]
    except ValueError:
        return None
    return text[:start].strip(), calls


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class _ChoiceStream:
    """One streamed choice's text, turned into content and tool-call deltas."""

    choice: ToolChoice
    parser: ToolCallParser
    held: str = ""  # text not sent yet
    in_calls: bool = False  # auto mode: the calls began
    sent_text: bool = False  # content went out: a parser whose calls open the output finds none now
    call: dict | None = None  # function mode: the call whose arguments stream
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> dict:
        mode = self.choice.mode
        if mode == "function":
            if not text:
                return {}
            if self.call is None:
                self.call = _call(self.choice.function or "", text)
                return {"tool_calls": [{"index": 0, **self.call}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        self.held += text
        if mode == "required" or self.in_calls:
            return {}
        if self.sent_text and self.parser.at_start_only:
            content, self.held = self.held, ""
            return {"content": content} if content else {}
        start = self.parser.start(self.held)
        if start >= 0:
            self.in_calls = True
            content, self.held = self.held[:start], self.held[start:]
        else:  # keep back what may be the beginning of the calls
            keep = self.parser.may_start(self.held)
            content, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent_text = self.sent_text or bool(content)
        return {"content": content} if content else {}

    def finish(self, reason: str | None) -> tuple[dict, str | None]:
        mode, held, self.held = self.choice.mode, self.held, ""
        if mode == "function":
            delta = {} if self.call is not None else {"tool_calls": [{"index": 0, **_call(self.choice.function or "",
                                                                                           "")}]}
            return delta, _finish_reason(reason, True)
        calls = _required_calls(held) if mode == "required" else (_auto_calls(self.parser, held) or ("", None))[1]
        if not calls:
            return ({"content": held} if held else {}), reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, _finish_reason(reason, True)


def parse_message(choice: ToolChoice, parser: ToolCallParser, text: str,
                  reason: str | None) -> tuple[dict, str | None]:
    """The message fields (content, tool_calls) of one whole generated text, and its
    finish reason."""
    calls: list[dict] | None = None
    content: str | None = text
    if choice.mode == "function":
        content, calls = None, [_call(choice.function or "", text)]
    elif choice.mode == "required":
        calls = _required_calls(text)
        content = None if calls else text
    elif choice.mode == "auto":
        parsed = _auto_calls(parser, text)
        if parsed is not None:
            content, calls = parsed[0] or None, parsed[1]
    if not calls:
        return {"content": content}, reason
    return {"content": content, "tool_calls": calls}, _finish_reason(reason, True)


class ToolCallChatFormat(ChatFormat):
    """Chat responses and chunks of a request with tools: the text of each choice
    becomes content and tool calls as the request's ``tool_choice`` has them."""

    tool_choice: ToolChoice
    tool_parser: ToolCallParser

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[int, _ChoiceStream] = {}

    def choice(self, *args: Any, **kwargs: Any) -> dict:
        choice = super().choice(*args, **kwargs)
        message = choice["message"]
        fields, choice["finish_reason"] = parse_message(self.tool_choice, self.tool_parser, message["content"] or "",
                                                        choice["finish_reason"])
        message.update(fields)
        return choice

    def chunk(self, *args: Any, **kwargs: Any) -> dict:
        chunk = super().chunk(*args, **kwargs)
        for choice in chunk["choices"]:
            stream = self._streams.setdefault(choice["index"], _ChoiceStream(self.tool_choice, self.tool_parser))
            delta = choice["delta"]
            delta.update(stream.feed(delta.pop("content", None) or ""))
            if choice["finish_reason"] is not None:
                rest, choice["finish_reason"] = stream.finish(choice["finish_reason"])
                for key, value in rest.items():
                    delta[key] = delta.get(key, type(value)()) + value
        return chunk


def chat_format(choice: ToolChoice | None, parser: ToolCallParser,
                reasoning: ReasoningParser | None = None) -> type[ChatFormat]:
    """The response format of a chat request: plain, or one that first splits the
    model's reasoning off (``reasoning``) and then parses tool calls from the rest (a
    subclass that knows the request's ``tool_choice`` and the server's parsers)."""
    bases: tuple[type[ChatFormat], ...] = ()
    if choice is not None and choice.mode != "none":
        bases += (ToolCallChatFormat,)
    if reasoning is not None:
        bases += (ReasoningChatFormat,)
    if not bases:
        return ChatFormat
    return type("ParsedChatFormat", bases, {"tool_choice": choice, "tool_parser": parser, "reasoning": reasoning})
