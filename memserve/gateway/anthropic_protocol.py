"""Anthropic Messages API requests (``/v1/messages``, ``/v1/messages/count_tokens``), read
into the chat pipeline's own request.

A Messages body says what an OpenAI chat body says, in other words, so it is translated
into that chat body and parsed by ``parse_chat_request`` (``protocol.py``): both endpoints
then validate, render, pin and sample alike. ``system`` (a string or text blocks) becomes
a leading system message; a user turn's ``tool_result`` blocks become ``tool`` messages
ahead of its text (``is_error`` results read ``Error: ...``, as a chat template has no
field for it); an assistant turn's ``tool_use`` blocks become its ``tool_calls`` and its
``thinking`` blocks its ``reasoning_content`` (what templates such as Qwen3's render);
``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``) become OpenAI's (``auto``, ``required``, a named function,
``none``); ``stop_sequences`` becomes ``stop``; ``thinking`` sets the template's
``enable_thinking``.

``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) may mark a system block,
a content block or a tool definition; the chat message holding the block carries the
marker on (``cache_control.py``: the prompt is pinned through that message). Tools are
rendered with the system prompt, so a tool's marker pins through the system message,
and pins nothing without one. The top-level ``cache_control`` (automatic caching) marks
the last message, so the whole prompt is pinned.

What a text model cannot serve (image and document blocks, server tools) and a final
assistant turn to continue (prefill) get 400 naming them; fields Anthropic has that
change nothing here (``metadata``, ``service_tier``, ...) are accepted and ignored. memserve's
own body fields (``session_id``, ``slo_ttft_ms``, ``cache_salt``, ...) pass on as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from memserve.gateway.cache_control import DEFAULT_TTL, marker_ttl_s
from memserve.gateway.errors import bad_request
from memserve.gateway.protocol import ChatCompletionRequest, parse_chat_request

# memserve's extension fields, passed on to the chat pipeline as they are.
_EXTENSIONS = ("seed", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos", "session_id",
               "slo_ttft_ms", "slo_tbt_ms", "priority", "cache_ttl_s", "cache_salt", "chat_template_kwargs")
_SAMPLING = ("temperature", "top_p", "top_k")
# Anthropic's tool_choice types and the chat tool_choice each one is.
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}
_UNSUPPORTED_BLOCKS = {"image": "image", "document": "document (PDF or text file)",
                       "search_result": "search result", "container_upload": "container upload"}


@dataclass
class MessagesRequest:
    """A parsed Messages request: the chat request it is, and who the client says the
    end user is (``metadata.user_id``, for the log)."""

    chat: ChatCompletionRequest
    user_id: str | None


def _marker(block: dict, param: str) -> dict | None:
    """A block's ``cache_control``, validated and normalised; None when it has none."""
    marker = block.get("cache_control")
    if marker is None:
        return None
    marker_ttl_s(marker, f"{param}.cache_control" if param else "cache_control")
    return {"type": "ephemeral", "ttl": marker.get("ttl", DEFAULT_TTL)}


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"'{param}' must be an object with a string 'type'", param)
    kind = block["type"]
    if kind in _UNSUPPORTED_BLOCKS:
        raise bad_request(f"'{param}': {_UNSUPPORTED_BLOCKS[kind]} content is not supported by this server, "
                          "which serves a text-only model; send text blocks", param)
    return kind


def _string(block: dict, key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{param}.{key}' must be a string", f"{param}.{key}")
    return value


def _texts(content: Any, param: str) -> tuple[str, dict | None]:
    """A string, or text blocks joined by newlines (as chat text parts are), and the last
    marker among the blocks."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of text blocks", param)
    texts, marker = [], None
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        if _block_type(block, where) != "text":
            raise bad_request(f"'{where}' must be a text block", where)
        texts.append(_string(block, "text", where))
        marker = _marker(block, where) or marker
    return "\n".join(texts), marker


def _tool_result(block: dict, param: str) -> dict:
    text = _texts(block.get("content") or "", f"{param}.content")[0]
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", param), "content": text}


def _tool_call(block: dict, param: str) -> dict:
    """A ``tool_use`` block as a chat tool call; its ``input`` is the arguments' JSON
    (orjson refuses a value nested past its limit: 400, not a stack overflow)."""
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise bad_request(f"'{param}.input' must be an object", f"{param}.input")
    try:
        text = orjson.dumps(arguments).decode()
    except orjson.JSONEncodeError as e:
        raise bad_request(f"'{param}.input' cannot be encoded: {e}", f"{param}.input") from None
    return {"id": _string(block, "id", param), "type": "function",
            "function": {"name": _string(block, "name", param), "arguments": text}}


@dataclass
class _Turn:
    """One Messages turn, collected block by block into the chat messages it becomes."""

    role: str
    texts: list[str]
    results: list[dict]  # tool messages (user turns)
    calls: list[dict]  # tool calls (assistant turns)
    thoughts: list[str]  # reasoning (assistant turns)
    marker: dict | None = None  # the last cache_control of the turn's text, calls or thoughts

    def add(self, block: Any, param: str) -> None:
        kind = _block_type(block, param)
        allowed = {"user": ("text", "tool_result"),
                   "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}[self.role]
        if kind not in allowed:
            raise bad_request(f"'{param}': a {self.role} message cannot hold '{kind}' blocks; it may hold "
                              f"{', '.join(allowed)}", param)
        marker = _marker(block, param)
        if kind == "tool_result":
            self.results.append(_tool_result(block, param))
            if marker is not None:
                self.results[-1]["cache_control"] = marker
            return
        if kind == "text":
            self.texts.append(_string(block, "text", param))
        elif kind == "tool_use":
            self.calls.append(_tool_call(block, param))
        elif kind == "thinking":
            self.thoughts.append(_string(block, "thinking", param))
        self.marker = marker or self.marker  # redacted thinking cannot be read back: only its marker counts

    def messages(self) -> list[dict]:
        """Tool results first (they answer the previous turn's calls), then the turn itself,
        unless it held nothing but results."""
        if self.results and not (self.texts or self.marker):
            return self.results
        message: dict[str, Any] = {"role": self.role, "content": "\n".join(self.texts)}
        if self.calls:
            message["tool_calls"] = self.calls
        if self.thoughts:
            message["reasoning_content"] = "\n".join(self.thoughts)
        if self.marker is not None:
            message["cache_control"] = self.marker
        return [*self.results, message]


def _turn(message: Any, index: int) -> list[dict]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad_request(f"'{param}.role' must be 'user' or 'assistant' (the system prompt is the top-level "
                          "'system' field)", f"{param}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{param}.content' must be a string or an array of content blocks", f"{param}.content")
    turn = _Turn(message["role"], [], [], [], [])
    for j, block in enumerate(content):
        turn.add(block, f"{param}.content[{j}]")
    return turn.messages()


def _system(body: dict) -> list[dict]:
    if body.get("system") is None:
        return []
    text, marker = _texts(body["system"], "system")
    message: dict[str, Any] = {"role": "system", "content": text}
    if marker is not None:
        message["cache_control"] = marker
    return [message]


def chat_messages(body: dict, tools_marker: dict | None) -> list[dict]:
    """The chat messages of ``system`` and ``messages``, cache markers included; a tool
    definition's marker (``tools_marker``) goes on the system message."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    messages = _system(body)
    for i, message in enumerate(raw):
        messages += _turn(message, i)
    if raw[-1].get("role") == "assistant":
        raise bad_request("a final assistant message (prefill, to be continued) is not supported by this server; "
                          "end with a user message", f"messages[{len(raw) - 1}]")
    if tools_marker is not None and messages[0]["role"] == "system" and "cache_control" not in messages[0]:
        messages[0]["cache_control"] = tools_marker
    if body.get("cache_control") is not None:  # automatic caching: through the last block
        messages[-1]["cache_control"] = _marker(body, "")
    return messages


def _tool(tool: Any, index: int) -> tuple[dict, dict | None]:
    param = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_request(f"'{param}' must be an object", param)
    if tool.get("type") not in (None, "custom"):
        raise bad_request(f"'{param}': tools of type '{tool['type']}' (server tools) are not supported by this "
                          "server; define client tools with 'name', 'description' and 'input_schema'", param)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}.input_schema' must be a JSON schema object", f"{param}.input_schema")
    function: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}, _marker(tool, param)


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """(the chat ``tool_choice``, ``parallel_tool_calls``) of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not choice.get("disable_parallel_tool_use", False) if isinstance(choice, dict) else True
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                      "{\"type\": \"tool\", \"name\": string}", "tool_choice")


def _tools(body: dict, chat: dict) -> dict | None:
    """Puts ``tools`` and ``tool_choice`` into the chat body; returns the last tool marker."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    marker = None
    if tools:
        converted = [_tool(tool, i) for i, tool in enumerate(tools)]
        chat["tools"] = [tool for tool, _ in converted]
        marker = next((m for _, m in reversed(converted) if m is not None), None)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    chat["parallel_tool_calls"] = parallel
    return marker


def _max_tokens(body: dict) -> int:
    value = body.get("max_tokens")
    if value is None:
        raise bad_request("'max_tokens' is required", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'max_tokens' must be an integer of at least 1, got {value!r}", "max_tokens")
    return value


def _template_kwargs(body: dict) -> dict | None:
    """``chat_template_kwargs`` with ``enable_thinking`` from ``thinking`` (unless set)."""
    kwargs = body.get("chat_template_kwargs")
    thinking = body.get("thinking")
    if thinking is None:
        return kwargs
    if not isinstance(thinking, dict) or thinking.get("type") not in _THINKING:
        raise bad_request(f"'thinking.type' must be one of {', '.join(_THINKING)}", "thinking")
    if not isinstance(kwargs, dict):
        return {"enable_thinking": _THINKING[thinking["type"]]} if kwargs is None else kwargs
    return {"enable_thinking": _THINKING[thinking["type"]], **kwargs}


def _user_id(body: dict) -> str | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("user_id", ""), (str, type(None))):
        raise bad_request("'metadata' must be an object with an optional string 'user_id'", "metadata")
    return metadata.get("user_id")


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad_request("'stop_sequences' must be an array of non-empty strings", "stop_sequences")
    return stop or None


def _chat_body(body: dict, count_only: bool) -> dict:
    """The OpenAI chat body of a Messages body (``count_only``: a count_tokens body, which
    has no ``max_tokens`` and is not generated)."""
    if not isinstance(body.get("model"), str):
        raise bad_request("'model' is required (a string)", "model")
    chat: dict[str, Any] = {"model": body["model"]}
    tools_marker = _tools(body, chat)
    chat["messages"] = chat_messages(body, tools_marker)
    chat.update({name: body[name] for name in (*_SAMPLING, *_EXTENSIONS) if body.get(name) is not None})
    chat["chat_template_kwargs"] = _template_kwargs(body)
    chat["stop"] = _stop(body)
    if not count_only:
        chat["max_tokens"] = _max_tokens(body)
        if body.get("stream") is not None:
            chat["stream"] = body["stream"]
        if body.get("stream") is True:  # the closing message_delta carries the usage
            chat["stream_options"] = {"include_usage": True}
    return chat


def parse_messages_request(body: dict, count_only: bool = False) -> MessagesRequest:
    """A Messages body, validated, as the chat request it is (``count_only``: the body of
    ``/v1/messages/count_tokens``)."""
    user_id = _user_id(body)
    return MessagesRequest(parse_chat_request(_chat_body(body, count_only)), user_id)
