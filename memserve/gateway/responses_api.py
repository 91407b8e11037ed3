"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request is a chat request said another way, so it runs the chat pipeline
(``app.py``: the chat template, context-window truncation, tool calls, reasoning,
structured output, the engine) and only its input and output are translated: ``input``
items and ``instructions`` become chat messages here, and ``responses_output.py`` turns
the chat format's output into output items and stream events.

``previous_response_id`` continues a stored response (``response_store.py``): its
conversation (every earlier input and output item) comes before this request's input,
rendered by the same template into the same tokens as before, so the prefix cache serves
the earlier turns' KV (``usage.input_tokens_details.cached_tokens``). As OpenAI has it,
``instructions`` (and ``tools``) belong to one request and are not carried over.

Fields that change what OpenAI would return and that memserve does not implement
(``background``, ``conversation``, ``prompt``, ``include``, ``top_logprobs``, tools other
than functions, non-text content) get a 400 naming them; validation errors of the chat
pipeline name the Responses fields (``input``, ``max_output_tokens``, ``text.format``)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson
from aiohttp import web

from memserve.gateway.auth import KEY_ID
from memserve.gateway.errors import APIError, bad_request
from memserve.gateway.protocol import ChatCompletionRequest, parse_chat_request
from memserve.gateway.response_store import ResponseStore, StoredResponse
from memserve.gateway.responses import ChatFormat, ResponseFormat
from memserve.gateway.responses_output import ResponseTurn, responses_format
from memserve.text.tokenizer import Tokenizer

# Accepted only at their "off" value: field -> predicate that the value is off.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: v in (None, False),
    "conversation": lambda v: v is None,
    "prompt": lambda v: v is None,
    "include": lambda v: not v,
    "top_logprobs": lambda v: v in (None, 0),
}
# memserve's extension fields, passed on to the chat pipeline as they are.
_EXTENSIONS = ("seed", "top_k", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos", "session_id",
               "slo_ttft_ms", "slo_tbt_ms", "priority", "cache_ttl_s", "cache_salt", "chat_template_kwargs")
_ROLES = ("user", "system", "developer", "assistant")
MAX_METADATA = 16  # OpenAI's caps on metadata: entries, key and value characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
# How the chat pipeline's errors name fields, and the Responses fields they are.
_CHAT_PARAMS = ((re.compile(r"\bmessages\b[\w.\[\]]*"), "input"),
                (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
                (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"),
                (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"))


def _rename(text: str) -> str:
    for pattern, name in _CHAT_PARAMS:
        text = pattern.sub(name, text)
    return text


def responses_error(error: APIError) -> APIError:
    """A chat pipeline error, as the Responses request's fields are named."""
    return APIError(error.status, _rename(error.message), error.param and _rename(error.param), error.code,
                    error.headers)


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string", param)
    return value


def _optional_string(body: dict, name: str) -> str | None:
    return None if body.get(name) is None else _string(body[name], name)


# ----------------------------------------------------------------------------- input


def _text_of(content: Any, param: str) -> str:
    """A string, or text parts (``input_text``, ``output_text``) joined by newlines, as
    the chat endpoint joins its text parts; no other content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"'{param}[{j}]' must be {{\"type\": \"input_text\" or \"output_text\", \"text\": "
                              f"string}}; content of type {kind!r} is not supported by this server", f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _reasoning_text(item: dict, param: str) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts), else its ``summary``."""
    texts: list[str] = []
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise bad_request(f"'{param}.{key}' must be an array of {{\"type\", \"text\": string}} parts",
                              f"{param}.{key}")
        texts = texts or [p["text"] for p in parts]
    return "\n".join(texts)


def _item(value: Any, index: int) -> dict:
    """One input item as it is kept: a fixed-shape copy holding only what is rendered."""
    param = f"input[{index}]"
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object", param)
    kind = value.get("type", "message")
    if kind == "message":
        role = value.get("role")
        if role not in _ROLES:
            raise bad_request(f"'{param}.role' must be one of {', '.join(_ROLES)}", f"{param}.role")
        part = "output_text" if role == "assistant" else "input_text"
        return {"type": "message", "role": role,
                "content": [{"type": part, "text": _text_of(value.get("content"), f"{param}.content")}]}
    if kind == "function_call":
        return {"type": kind, **{k: _string(value.get(k), f"{param}.{k}") for k in ("call_id", "name", "arguments")}}
    if kind == "function_call_output":
        return {"type": kind, "call_id": _string(value.get("call_id"), f"{param}.call_id"),
                "output": _text_of(value.get("output"), f"{param}.output")}
    if kind == "reasoning":
        return {"type": kind, "summary": [],
                "content": [{"type": "reasoning_text", "text": _reasoning_text(value, param)}]}
    raise bad_request(f"input items of type {kind!r} are not supported by this server: it takes message, "
                      "function_call, function_call_output and reasoning items", f"{param}.type")


def input_items(body: dict) -> list[dict]:
    """``input``: a string (one user message) or a list of items."""
    value = body.get("input")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or an array of input items", "input")
    return [_item(item, i) for i, item in enumerate(value)]


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The chat messages of a conversation's items: ``developer`` messages are system
    messages, a ``function_call`` joins the assistant turn before it (or makes one), its
    output is a ``tool`` message, and a reasoning item goes with the assistant turn
    after it (``reasoning_content``)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    reasoning: str | None = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = "\n".join(part["text"] for part in item["content"])
            continue
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": "\n".join(part["text"] for part in item["content"])})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


# ----------------------------------------------------------------------------- other fields


def _function_tools(body: dict) -> tuple[list[dict], list[dict] | None]:
    """(``tools`` as the response repeats them, as the chat pipeline takes them); the chat
    pipeline validates names and parameter schemas."""
    tools = body.get("tools")
    if tools is None:
        return [], None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    echoed, chat = [], []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools of type {kind!r} are not supported by this server; it serves function tools "
                              "({\"type\": \"function\", \"name\", \"parameters\", ...})", f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        echoed.append({"type": "function", "description": None, "parameters": None, "strict": None, **function})
        chat.append({"type": "function", "function": function})
    return echoed, chat


def _tool_choice(body: dict) -> Any:
    """``tool_choice`` as the chat pipeline takes it, which checks it against the tools."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    hosted = f"; tool_choice of type {kind!r} is not supported by this server" if kind not in (None, "function") \
        else ""
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": string}"
                      + hosted, "tool_choice")


def _text_format(body: dict) -> tuple[dict, dict | None]:
    """(``text`` as the response repeats it, the chat ``response_format``): plain text,
    ``json_object`` or ``json_schema`` (enforced by llguidance, as on the chat endpoint)."""
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' other than 'medium' is not supported by this server", "text.verbosity")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"format": {"type": kind}, "verbosity": "medium"}, {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"format": {"type": kind, **schema}, "verbosity": "medium"}, {"type": kind, "json_schema": schema}
    raise bad_request("'text.format' must be an object whose 'type' is 'text', 'json_object' or 'json_schema'",
                      "text.format")


def _metadata(body: dict) -> dict:
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= MAX_METADATA_KEY and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()):
        raise bad_request(f"'metadata' must map at most {MAX_METADATA} keys of up to {MAX_METADATA_KEY} characters "
                          f"to strings of up to {MAX_METADATA_VALUE}", "metadata")
    return metadata


def _max_output_tokens(body: dict) -> int | None:
    value = body.get("max_output_tokens")
    if value is not None and (type(value) is not int or value < 1):
        raise bad_request("'max_output_tokens' must be a positive integer", "max_output_tokens")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def _reasoning(body: dict) -> dict:
    """``reasoning`` is accepted and repeated; a reasoning model reasons as its template has it."""
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", "reasoning")
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


# ----------------------------------------------------------------------------- request


@dataclass
class ResponsesRequest:
    chat: ChatCompletionRequest  # what the chat pipeline runs
    conversation: list[dict]  # the continued conversation's items, then this request's input items
    echo: dict  # the request fields the response object repeats
    store: bool


def _chat_body(body: dict, messages: list[dict], response_format: dict | None) -> dict:
    chat = {key: body[key] for key in _EXTENSIONS if key in body}
    chat.update(model=body.get("model"), messages=messages, max_completion_tokens=_max_output_tokens(body),
                temperature=body.get("temperature"), top_p=body.get("top_p"), response_format=response_format,
                parallel_tool_calls=_boolean(body, "parallel_tool_calls", True), tool_choice=_tool_choice(body))
    cache_key = _optional_string(body, "prompt_cache_key")
    if cache_key is not None and "session_id" not in chat:
        chat["session_id"] = cache_key  # the session router keeps a conversation together
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        chat["stream_options"] = {"include_usage": True} if body["stream"] is True else None
    return chat


def _echo(body: dict, chat: ChatCompletionRequest, tools: list[dict], text: dict, store: bool) -> dict:
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise bad_request("'truncation' must be 'auto' or 'disabled'", "truncation")
    choice = body.get("tool_choice") or "auto"
    return {"background": False, "instructions": _optional_string(body, "instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None, "metadata": _metadata(body),
            "parallel_tool_calls": _boolean(body, "parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": _reasoning(body),
            "service_tier": "default", "store": store, "temperature": chat.temperature, "text": text,
            "tool_choice": choice, "tools": tools, "top_logprobs": 0, "top_p": chat.top_p, "truncation": truncation,
            "user": _optional_string(body, "user"), "prompt_cache_key": _optional_string(body, "prompt_cache_key"),
            "safety_identifier": _optional_string(body, "safety_identifier")}


def parse_responses_request(body: dict, previous: list[dict]) -> ResponsesRequest:
    """A validated Responses request; ``previous`` is the conversation it continues."""
    for name, is_off in _UNSUPPORTED.items():
        if not is_off(body.get(name)):
            raise bad_request(f"'{name}' is not supported by this server", name)
    conversation = previous + input_items(body)
    messages = chat_messages(_optional_string(body, "instructions"), conversation)
    if not messages:
        raise bad_request("'input' must not be empty", "input")
    tools, chat_tools = _function_tools(body)
    text, response_format = _text_format(body)
    chat_body = _chat_body(body, messages, response_format)
    chat_body["tools"] = chat_tools
    try:
        chat = parse_chat_request(chat_body)
    except APIError as e:
        raise responses_error(e) from None
    store = _boolean(body, "store", True)
    return ResponsesRequest(chat, conversation, _echo(body, chat, tools, text, store), store)


# ----------------------------------------------------------------------------- endpoints

# The chat pipeline from a parsed request: (HTTP request, chat request, arrival time, a
# function that turns the request's chat response format into the format to answer with).
RunChat = Callable[[web.Request, ChatCompletionRequest, float, Callable[[type[ChatFormat]], type[ResponseFormat]]],
                   Awaitable[web.StreamResponse]]
ReadBody = Callable[[web.Request], Awaitable[dict]]


def _json(obj: object) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


class ResponsesAPI:
    """The endpoints, over the chat pipeline (``run_chat``) and a ``ResponseStore``.
    Stored responses belong to the API key that made them (``KEY_ID``)."""

    def __init__(self, run_chat: RunChat, read_body: ReadBody, tokenizer: Tokenizer, store: ResponseStore) -> None:
        self._run_chat = run_chat
        self._read_body = read_body
        self._tokenizer = tokenizer
        self._store = store

    def _count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def _previous(self, response_id: Any, owner: str) -> StoredResponse | None:
        if response_id is None:
            return None
        stored = self._store.get(owner, _string(response_id, "previous_response_id"))
        if stored is None:
            raise APIError(404, f"Previous response with id '{response_id}' not found.", "previous_response_id",
                           "previous_response_not_found")
        return stored

    def _stored(self, request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        stored = self._store.get(request.get(KEY_ID, ""), response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return stored

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._read_body(request)
        owner = request.get(KEY_ID, "")
        previous = self._previous(body.get("previous_response_id"), owner)
        parsed = parse_responses_request(body, previous.conversation if previous is not None else [])
        turn = ResponseTurn(parsed.echo, parsed.conversation, self._store if parsed.store else None, owner,
                            self._count_tokens)
        try:
            return await self._run_chat(request, parsed.chat, arrival, lambda chat: responses_format(chat, turn))
        except APIError as e:
            raise responses_error(e) from None

    async def retrieve(self, request: web.Request) -> web.Response:
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("streaming a stored response again is not supported by this server", "stream")
        return _json(self._stored(request).response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = self._stored(request).response["id"]
        self._store.delete(request.get(KEY_ID, ""), response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})


def add_responses_routes(app: web.Application, run_chat: RunChat, read_body: ReadBody, tokenizer: Tokenizer,
                         store: ResponseStore) -> None:
    api = ResponsesAPI(run_chat, read_body, tokenizer, store)
    app.add_routes([web.post("/v1/responses", api.create),
                    web.get("/v1/responses/{response_id}", api.retrieve),
                    web.delete("/v1/responses/{response_id}", api.delete)])
