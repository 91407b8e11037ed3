"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is a chat request said another way, so it runs the chat pipeline
(``app.py``: the chat template, context-window truncation, cache_control pins, tool
calls, reasoning, the engine); ``anthropic_protocol.py`` translates its body into a chat
request and ``anthropic_format.py`` the chat format's output into a message or its
events. ``count_tokens`` renders the same prompt and generates nothing.

Every error on these paths is Anthropic's error object (``{"type": "error", "error":
{"type", "message"}}``) with the status it comes with: ``anthropic_errors`` re-words
what the layers below answer (a body that is not JSON, an unknown model, a bad API key,
an engine failure) once they have answered it. Anthropic's headers need nothing:
``x-api-key`` is read with the API keys (``auth.py``); ``anthropic-version`` and
``anthropic-beta`` are accepted whatever they say."""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from memserve.gateway.anthropic_format import anthropic_format, error_body, from_openai_error
from memserve.gateway.anthropic_protocol import parse_messages_request
from memserve.gateway.protocol import ChatCompletionRequest
from memserve.gateway.responses_api import ReadBody, RunChat

log = logging.getLogger("memserve.gateway")

PATH = "/v1/messages"
# A parsed chat request's prompt token ids, as the chat pipeline renders them.
ChatPrompt = Callable[[ChatCompletionRequest], Awaitable[list[int]]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def _anthropic_error(response: web.Response) -> web.Response:
    """An error response of the layers below, as Anthropic's error object."""
    try:
        body = orjson.loads(response.body) if isinstance(response.body, bytes) else None
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = from_openai_error(body, response.status)
    else:
        error = error_body(response.status, response.reason or "error")
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
    return web.Response(status=response.status, body=orjson.dumps(error), content_type="application/json",
                        headers=headers)


@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Re-words the error responses on /v1/messages*; the outermost middleware, so that
    it sees them all, whichever layer answered (a stream's errors are its own events)."""
    response = await handler(request)
    if response.status < 400 or not isinstance(response, web.Response) or not is_messages_path(request.path):
        return response
    return _anthropic_error(response)


class MessagesAPI:
    """The endpoints, over the chat pipeline (``run_chat``, ``chat_prompt``)."""

    def __init__(self, run_chat: RunChat, chat_prompt: ChatPrompt, read_body: ReadBody) -> None:
        self._run_chat = run_chat
        self._chat_prompt = chat_prompt
        self._read_body = read_body

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        parsed = parse_messages_request(await self._read_body(request))
        if parsed.user_id is not None:
            log.debug("%s %s user_id=%s", request.method, request.path, parsed.user_id)
        return await self._run_chat(request, parsed.chat, arrival, anthropic_format)

    async def count_tokens(self, request: web.Request) -> web.Response:
        parsed = parse_messages_request(await self._read_body(request), count_only=True)
        prompt_ids = await self._chat_prompt(parsed.chat)
        return web.Response(body=orjson.dumps({"input_tokens": len(prompt_ids)}), content_type="application/json")


def add_messages_routes(app: web.Application, run_chat: RunChat, chat_prompt: ChatPrompt, read_body: ReadBody) -> None:
    api = MessagesAPI(run_chat, chat_prompt, read_body)
    app.add_routes([web.post(PATH, api.create), web.post(PATH + "/count_tokens", api.count_tokens)])
