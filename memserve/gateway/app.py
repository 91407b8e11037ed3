"""The gateway's OpenAI-compatible HTTP layer (aiohttp).

``create_app`` wires the endpoints to an ``EngineClient``. Every request is handled
inside an error middleware, so nothing a client sends can take the process down: bad
input becomes an OpenAI error object with the right status, an engine failure a 500
(or an SSE error event once a stream has started). What aiohttp cannot even parse is
answered the same way by the connection layer (``connection.py``).

Request bodies are read as JSON when the Content-Type is JSON (``application/json``,
``application/*+json``) or what HTTP tools send when the user set none: nothing at all,
``application/x-www-form-urlencoded`` (``curl -d``, Python's urllib) or
``application/octet-stream`` (raw-bytes defaults). Any other declared type (``text/plain``,
``multipart/form-data``, ...) says the body is something else and gets 415: it is never
what an API client means, and ``text/plain`` is how an HTML form forges a JSON body from
another web site. A body must arrive within ``body_timeout_s`` (408 otherwise).

An engine request is aborted whenever its HTTP request ends before the engine finished
it: a stop string was hit, the client disconnected (the handler is cancelled when the
runner has ``handler_cancellation=True``, or a write or transport check fails otherwise),
or an error occurred."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

import orjson
from aiohttp import web

from memserve.gateway.anthropic_api import add_messages_routes, anthropic_errors
from memserve.gateway.auth import KEY_ID, KEY_SALT, AuthConfig, auth_middleware, tenant_salt
from memserve.gateway.engine_protocol import (
    EngineClient,
    EngineUnavailable,
    RequestEngine,
    RequestRejected,
)
from memserve.gateway.errors import APIError, bad_request
from memserve.gateway.lora_adapters import AdapterRegistry, ServedAdapter
from memserve.gateway.lora_api import AdapterChanger, add_lora_routes
from memserve.gateway.logprobs import LoggedToken, TokenLog, TokenStrings
from memserve.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from memserve.gateway.metrics import GatewayMetrics
from memserve.gateway.parallel_choices import choice_engines
from memserve.gateway.prompt_encoder import DEFAULT_PROCESSES, PromptEncoder
from memserve.gateway.protocol import (
    ChatCompletionRequest,
    GenerationRequest,
    check_logit_bias,
    check_prompt_ids,
    parse_chat_request,
    parse_completion_request,
    resolve_max_tokens,
    resolve_slo,
)
from memserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from memserve.gateway.reasoning import ReasoningParser
from memserve.gateway.response_store import ResponseStore
from memserve.gateway.responses import (
    ChatFormat,
    CompletionFormat,
    LogprobsRenderer,
    ResponseFormat,
    Usage,
)
from memserve.gateway.responses_api import add_responses_routes
from memserve.gateway.stats import add_stats_routes, health_status
from memserve.gateway.tokenize_api import (
    parse_detokenize_request,
    parse_tokenize_request,
)
from memserve.gateway.tool_calls import chat_format, template_inputs
from memserve.gateway.tool_parsers import AUTO as TOOL_PARSER_AUTO
from memserve.gateway.tool_parsers import ToolCallParser
from memserve.gateway.tool_parsers import tool_call_parser as tool_parser
from memserve.gateway.web_ui import add_web_routes
from memserve.ipc.messages import RequestOutput
from memserve.text.detokenizer import IncrementalDetokenizer
from memserve.text.tokenizer import ChatTemplateError, Tokenizer
from memserve.text.truncation import (
    DEFAULT_TRUNCATION,
    CannotTruncate,
    common_prefix,
    common_suffix,
    head_messages,
    overflows,
    prompt_limit,
    tail_messages,
    truncate,
)

PIN_HEADER = "x-memserve-cache-pin"  # says a cache_control pin was not taken
log = logging.getLogger("memserve.gateway")

MiB = 1024 * 1024
# nginx's status for "client closed the request"; only ever seen in metrics.
CLIENT_CLOSED_REQUEST = 499


# Read as JSON besides JSON types: what curl -d, urllib and raw-bytes clients send by default.
_JSON_CONTENT_TYPES = {"application/json", "application/x-www-form-urlencoded", "application/octet-stream"}


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def _read_json(request: web.Request, timeout_s: float) -> dict:
    content_type = request.content_type  # application/octet-stream when absent
    if content_type not in _JSON_CONTENT_TYPES and not content_type.endswith("+json"):
        raise APIError(415, f"Content-Type {content_type} is not supported: send the body as JSON with "
                       "Content-Type: application/json")
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)  # raises 413 past client_max_size
    except asyncio.TimeoutError:
        # Fail the body stream too, so aiohttp closes the connection after the 408
        # instead of waiting on the stalled body any longer.
        request.content.set_exception(asyncio.TimeoutError())
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except web.RequestPayloadError as e:  # a body that is not what its headers say (bad gzip, ...)
        raise bad_request(f"unreadable request body: {getattr(e.__cause__, 'message', None) or e}") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, (RequestRejected, EngineUnavailable)):
        wait = exc.retry_after_s
        headers = {"Retry-After": str(math.ceil(wait))} if wait is not None else None
        if isinstance(exc, RequestRejected):
            return APIError(429, str(exc), code="slo_unattainable", headers=headers)
        return APIError(503, str(exc), headers=headers)
    return APIError(500, f"engine error: {exc}")


class _Generation:
    """One request's trip through the engine: detokenises, applies stop strings, keeps
    usage and metrics, and aborts the engine request if it ends before the engine did."""

    def __init__(self, engine: RequestEngine, tokenizer: Tokenizer, metrics: GatewayMetrics, request_id: str,
                 prompt_ids: list[int], request: GenerationRequest, max_tokens: int, arrival: float,
                 echo: str | None = None) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._request_id = request_id
        self._prompt_ids = prompt_ids
        self._request = request
        # max_tokens 0 (echo only) scores the prompt: one token is generated and dropped, as vLLM.
        self._drop_output = max_tokens == 0
        self._params = request.sampling_params(max(max_tokens, 1), tokenizer.eos_token_ids)
        self._arrival = arrival
        self._echo = echo  # the prompt text that leads the output, until it is sent
        self._log = TokenLog()
        self.usage = Usage(prompt_tokens=len(prompt_ids), pinned_tokens=min(request.pin_tokens, len(prompt_ids)))
        self.finish_reason: str | None = None
        self.pin_refused: str | None = None  # why the engine served it without its cache_control pin
        self.stop_string: str | None = None  # the stop string that ended it

    def take_logged(self) -> list[LoggedToken]:
        """The tokens (with logprobs) of the text deltas returned since the last call;
        empty unless logprobs were asked for."""
        return self._log.take()

    def _text_of(self, out: RequestOutput, detokenizer: IncrementalDetokenizer) -> str:
        """One engine output's text delta (the echoed prompt leads the first), logging
        its consumed tokens' logprobs when they came."""
        text = ""
        if self._echo is not None:
            text, self._echo = self._echo, None
            if out.prompt_logprobs is not None:
                self._log.add_prompt(self._prompt_ids, out.prompt_logprobs)
        if self._drop_output:
            return text
        consumed = detokenizer.num_tokens
        text += detokenizer.add_tokens(out.new_token_ids)
        if out.logprobs is not None:
            self._log.add(out.new_token_ids[:detokenizer.num_tokens - consumed], out.logprobs)
        return text

    async def text_deltas(self) -> AsyncGenerator[str, None]:
        """One text delta (possibly empty) per engine output; ``finish_reason`` is set
        before the last one. Engine failures are raised as ``APIError``."""
        detokenizer = IncrementalDetokenizer(self._tokenizer, self._prompt_ids, self._request.stop)
        outputs = self._engine.generate(self._request_id, self._prompt_ids, self._params,
                                        self._request.session_id, self._request.slo, streaming=self._request.stream)
        engine_done = False
        first_token_at: float | None = None
        last_token_at = 0.0
        max_gap = 0.0  # the longest wait between two outputs with tokens (the TBT SLO's measure)
        try:
            try:
                async for out in outputs:
                    engine_done = out.finished
                    if out.error_status is not None:  # the engine refused the request as such (4xx)
                        raise APIError(out.error_status, out.error or "refused")
                    if out.error is not None or out.finish_reason == "error":
                        raise APIError(500, f"engine error: {out.error or 'unknown'}")
                    self.usage.cached_tokens = max(self.usage.cached_tokens, out.num_cached_tokens)
                    if out.pin_refused and not self.pin_refused:  # served unpinned: nothing was written under it
                        self.pin_refused, self.usage.pinned_tokens = out.pin_refused, 0
                    if out.new_token_ids:
                        now = time.monotonic()
                        if first_token_at is None:
                            first_token_at = now
                            self._metrics.observe_first_token(first_token_at - self._arrival)
                        else:
                            max_gap = max(max_gap, now - last_token_at)
                        last_token_at = now
                    text = self._text_of(out, detokenizer)
                    if detokenizer.stopped:
                        self.finish_reason, self.stop_string = "stop", detokenizer.stop_string
                    elif out.finished:
                        text += detokenizer.flush()
                        self.finish_reason = "length" if self._drop_output else out.finish_reason
                    yield text
                    if self.finish_reason is not None:
                        break
            except (APIError, asyncio.CancelledError):
                raise
            except Exception as e:
                error = _engine_error(e)
                if error.status == 500:
                    log.exception("engine failed on request %s", self._request_id)
                raise error from e
            if self.finish_reason is None:
                raise APIError(500, "the engine stream ended before the request finished")
        finally:
            if not engine_done:
                await self._engine.abort(self._request_id)
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()
            self.usage.completion_tokens = detokenizer.num_tokens
            self._metrics.observe_tokens(self.usage.prompt_tokens, self.usage.completion_tokens)
            if self.finish_reason is not None and first_token_at is not None:
                self._metrics.observe_finished(first_token_at - self._arrival, time.monotonic() - self._arrival,
                                               self.usage.completion_tokens)
                self._metrics.observe_slo(self._request.slo, first_token_at - self._arrival, max_gap)


@dataclass
class _Choice:
    """One choice of a response: its index, the generation behind it, and the renderer
    of its logprobs (None when the request asked for none)."""

    index: int
    generation: _Generation
    render_logprobs: LogprobsRenderer | None
    logged: list[LoggedToken] = field(default_factory=list)  # received, not rendered yet

    def take_logprobs(self, whole: bool = False) -> dict | None:
        """The ``logprobs`` of the tokens logged since the last call: None when none
        were asked for, or (unless ``whole``: a complete response always has them) when
        no token came since."""
        if self.render_logprobs is None or not (self.logged or whole):
            return None
        logged, self.logged = self.logged, []
        return self.render_logprobs(logged)


# (choice, text delta or None once the choice is done, the delta's logged tokens)
_Event = tuple[_Choice, str | None, list[LoggedToken]]


class _ChoiceEvents:
    """The text deltas of several choices, merged in arrival order (``next``). A failure
    of any choice is raised to the reader; leaving the context stops them all (aborting
    their engine requests)."""

    def __init__(self, choices: list[_Choice]) -> None:
        self._choices = choices
        self._queue: asyncio.Queue[tuple[_Choice, str | None, list[LoggedToken], Exception | None]] = \
            asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._running = len(choices)

    @property
    def all_done(self) -> bool:
        return self._running == 0

    async def __aenter__(self) -> _ChoiceEvents:
        self._tasks = [asyncio.create_task(self._pump(choice)) for choice in self._choices]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, choice: _Choice) -> None:
        try:
            async with aclosing(choice.generation.text_deltas()) as deltas:
                async for text in deltas:  # a delta's tokens travel with it: the reader may lag
                    self._queue.put_nowait((choice, text, choice.generation.take_logged(), None))
        except Exception as e:  # APIError from the generation; anything else becomes a 500 upstream
            self._queue.put_nowait((choice, None, [], e))
        else:
            self._queue.put_nowait((choice, None, [], None))

    async def next(self) -> _Event:
        choice, text, logged, error = await self._queue.get()
        if error is not None:
            raise error
        if text is None:
            self._running -= 1
        return choice, text, logged


async def _chain(early: list[_Event], events: _ChoiceEvents) -> AsyncIterator[_Event]:
    for event in early:
        yield event
    while not events.all_done:
        yield await events.next()


def _pin_headers(choices: list[_Choice]) -> dict[str, str]:
    """``x-memserve-cache-pin: refused; <why>`` when the engine served the request without
    the cache_control pin it asked for (a cap was passed, or pinning is off)."""
    refused = next((c.generation.pin_refused for c in choices if c.generation.pin_refused), None)
    return {PIN_HEADER: f"refused; {refused}"} if refused else {}


def _total_usage(choices: list[_Choice]) -> Usage:
    usages = [choice.generation.usage for choice in choices]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages),
                 pinned_tokens=max(u.pinned_tokens for u in usages))  # one pin, shared by the choices


async def _send_event(response: web.StreamResponse, fmt: ResponseFormat, obj: dict) -> None:
    await response.write(fmt.sse(obj))


@dataclass(frozen=True)
class ChatParsers:
    """How chat output text is read: tool calls (``--tool-call-parser``) and reasoning
    (``--reasoning-parser``; None: the text is all content)."""

    tools: ToolCallParser
    reasoning: ReasoningParser | None


class _OpenAIServer:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, encoder: PromptEncoder, model_name: str,
                 metrics: GatewayMetrics, body_timeout_s: float, slo_defaults: dict[str, float],
                 truncation: str = DEFAULT_TRUNCATION, block_size: int = 16,
                 parsers: ChatParsers | None = None, adapters: AdapterRegistry | None = None) -> None:
        self._engine = engine
        self._parsers = parsers or ChatParsers(tool_parser(TOOL_PARSER_AUTO, tokenizer.chat_template), None)
        self._truncation = truncation
        self._block_size = block_size
        self._slo_defaults = slo_defaults
        self._tokenizer = tokenizer
        self._encoder = encoder
        self._model_name = model_name
        self._adapters = adapters or AdapterRegistry()  # LoRA adapters: a request names one as its model
        self._metrics = metrics
        self._body_timeout_s = body_timeout_s
        self._created = int(time.time())
        self._token_strings = TokenStrings(tokenizer)

    def _check_model(self, model: str | None) -> ServedAdapter | None:
        """The LoRA adapter ``model`` names (None: the served model; a missing ``model``
        means it, as in vLLM); 404 for any other name."""
        adapter = self._adapters.get(model)
        if adapter is not None:
            return adapter
        if model is not None and model != self._model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return None

    def _use_model(self, req: GenerationRequest) -> None:
        """Run ``req`` through the adapter its ``model`` names, if it names one."""
        adapter = self._check_model(req.model)
        req.lora_name, req.lora_digest = (adapter.name, adapter.digest) if adapter else (None, "")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Each prompt of a batch is its own engine request and its own choice, in order."""
        arrival = time.monotonic()
        req = parse_completion_request(await _read_json(request, self._body_timeout_s))
        self._use_model(req)
        prompts = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                prompts.append(await self._encoder.encode(prompt, self._engine.max_model_len))
            else:
                prompts.append(prompt)
        echoes = None
        if req.echo:
            echoes = [p if isinstance(p, str) else self._tokenizer.decode(ids, skip_special_tokens=False)
                      for p, ids in zip(req.prompts, prompts)]
        return await self._generate(request, CompletionFormat, req, prompts, "prompt", arrival, echoes)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        req = parse_chat_request(await _read_json(request, self._body_timeout_s))
        return await self.run_chat(request, req, arrival)

    async def run_chat(self, request: web.Request, req: ChatCompletionRequest, arrival: float,
                       answer_as: Callable[[type[ChatFormat]], type[ResponseFormat]] | None = None
                       ) -> web.StreamResponse:
        """The chat pipeline from a parsed request; ``answer_as`` turns the chat response
        format into another API's (the Responses and Messages APIs run this pipeline too)."""
        prompt_ids, messages, tools = await self._render_chat(req)
        prompt_ids = await self._fit_window(req, messages, tools, prompt_ids)
        if req.cache_pin is not None:
            head = await self._encoder.encode_chat(messages[: req.cache_pin.message_index + 1],
                                                   self._engine.max_model_len, tools, add_generation_prompt=False,
                                                   template_kwargs=req.template_kwargs)
            req.pin_tokens, req.pin_ttl_s = common_prefix(head, prompt_ids), req.cache_pin.ttl_s
        fmt = chat_format(req.tool_choice, self._parsers.tools, self._parsers.reasoning)
        return await self._generate(request, answer_as(fmt) if answer_as else fmt, req, [prompt_ids], "messages",
                                    arrival)

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """A parsed chat request's prompt token ids, before any truncation (Anthropic's
        count_tokens counts them)."""
        return (await self._render_chat(req))[0]

    async def _render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], list[dict], list[dict] | None]:
        """(prompt token ids, the messages and the tools the template rendered them from)."""
        self._use_model(req)
        messages, tools = template_inputs(req.messages, req.tool_choice, self._tokenizer.supports_tools)
        try:
            prompt_ids = await self._encoder.encode_chat(messages, self._engine.max_model_len, tools,
                                                         template_kwargs=req.template_kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        return prompt_ids, messages, tools

    async def _fit_window(self, req: ChatCompletionRequest, messages: list[dict], tools: list[dict] | None,

                          prompt_ids: list[int]) -> list[int]:
        """A conversation over the context window loses whole blocks of its oldest turns
        (``--truncation``, text/truncation.py); with ``error`` it gets the usual 400."""
        max_model_len = self._engine.max_model_len
        if self._truncation == "error" or not overflows(len(prompt_ids), max_model_len, req.max_tokens):
            return prompt_ids
        try:
            head = await self._encoder.encode_chat(head_messages(messages), max_model_len, tools,
                                                   template_kwargs=req.template_kwargs)
        except ChatTemplateError:
            head = []  # a template that refuses an empty turn: keep no head
        try:
            tail = await self._encoder.encode_chat(tail_messages(messages), max_model_len, tools,
                                                   template_kwargs=req.template_kwargs)
        except ChatTemplateError:
            tail = prompt_ids  # the last message cannot be told apart: nothing may be dropped
        try:
            cut = truncate(prompt_ids, common_prefix(head, prompt_ids), common_suffix(tail, prompt_ids),
                           prompt_limit(max_model_len, req.max_tokens), self._block_size)
        except CannotTruncate as e:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, and {e}.",
                           "messages", "context_length_exceeded") from None
        if self._truncation == "kv-shift":
            req.dropped_at, req.dropped_token_ids = cut.dropped_at, cut.dropped_ids
        return cut.prompt_ids

    async def _generate(self, request: web.Request, format_cls: type[ResponseFormat], req: GenerationRequest,
                        prompts: list[list[int]], prompt_param: str, arrival: float,
                        echoes: list[str] | None = None) -> web.StreamResponse:
        for prompt_ids in prompts:
            check_prompt_ids(prompt_ids, self._tokenizer.vocab_size, prompt_param)
        check_logit_bias(req.logit_bias, self._tokenizer.vocab_size)
        # A session names itself in the body (``session_id``) or, for clients that cannot add
        # body fields, in the ``x-session-id`` header; the session router keys on it.
        req.session_id = req.session_id or request.headers.get("x-session-id") or None
        # --cache-salt-from-key: the body's cache_salt only splits its API key's (gateway/auth.py).
        req.cache_salt = tenant_salt(request.get(KEY_SALT), req.cache_salt)
        req.pin_owner = request.get(KEY_ID, "")
        req.slo = resolve_slo(req.slo, request.headers, self._slo_defaults)
        budgets = [resolve_max_tokens(req.max_tokens, len(ids), self._engine.max_model_len, prompt_param)
                   for ids in prompts]
        fmt = format_cls(format_cls.id_prefix + uuid.uuid4().hex, req.lora_name or self._model_name, int(time.time()))
        choices = []
        for i, (prompt_ids, max_tokens) in enumerate(zip(prompts, budgets)):
            request_id = fmt.id if len(prompts) == 1 else f"{fmt.id}-{i}"
            # n > 1: one engine request per prompt, its choices indexed prompt-major as OpenAI.
            for j, engine in enumerate(choice_engines(self._engine, req.n)):
                generation = _Generation(engine, self._tokenizer, self._metrics, request_id, prompt_ids, req,
                                         max_tokens, arrival, echoes[i] if echoes else None)
                if j:
                    generation.usage.prompt_tokens = 0  # the prompt counts once, as OpenAI's usage does
                renderer = fmt.logprobs_renderer(self._token_strings) if req.logprobs is not None else None
                choices.append(_Choice(i * req.n + j, generation, renderer))
        if req.stream:
            return await self._stream(request, fmt, choices, req.include_usage)
        return await self._complete(request, fmt, choices)

    async def _complete(self, request: web.Request, fmt: ResponseFormat, choices: list[_Choice]) -> web.Response:
        texts: list[list[str]] = [[] for _ in choices]
        async with _ChoiceEvents(choices) as events:
            while not events.all_done:
                choice, text, logged = await events.next()
                choice.logged += logged
                if text is not None:
                    texts[choice.index].append(text)
                else:
                    fmt.ended(choice.index, choice.generation.stop_string)
                if _client_gone(request):
                    return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")
        body = [fmt.choice(c.index, "".join(texts[c.index]), c.generation.finish_reason, c.take_logprobs(True))
                for c in choices]
        response = _json(fmt.response(body, _total_usage(choices)))
        response.headers.update(_pin_headers(choices))
        return response

    async def _stream(self, request: web.Request, fmt: ResponseFormat, choices: list[_Choice],
                      include_usage: bool) -> web.StreamResponse:
        """Headers go out only after every choice's first engine output, so a request the
        engine refuses still gets a plain HTTP error status."""
        async with _ChoiceEvents(choices) as events:
            early: list[_Event] = []
            while len({event[0].index for event in early}) < len(choices):
                early.append(await events.next())
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   **_pin_headers(choices)})
            await response.prepare(request)
            try:
                await self._write_events(response, fmt, choices, early, events, include_usage)
            except ConnectionResetError:
                log.info("client disconnected from %s", fmt.id)  # leaving _ChoiceEvents aborts the engine requests
        return response

    async def _write_events(self, response: web.StreamResponse, fmt: ResponseFormat, choices: list[_Choice],
                            early: list[_Event], events: _ChoiceEvents,
                            include_usage: bool) -> None:
        fmt.started(_total_usage(choices))
        for choice in choices:
            opening = fmt.opening_chunk(choice.index)
            if opening is not None:
                await _send_event(response, fmt, opening)
        try:
            async for choice, text, logged in _chain(early, events):
                choice.logged += logged
                if text is None:  # the choice is done: its last chunk carries its finish_reason
                    fmt.ended(choice.index, choice.generation.stop_string)
                    chunk = fmt.chunk("", choice.generation.finish_reason, choice.take_logprobs(), choice.index)
                elif text:
                    chunk = fmt.chunk(text, None, choice.take_logprobs(), choice.index)
                else:
                    continue
                await _send_event(response, fmt, chunk)
            if include_usage:
                await _send_event(response, fmt, fmt.usage_chunk(_total_usage(choices)))
        except APIError as e:
            await _send_event(response, fmt, e.body())
        await response.write(fmt.sse_end())

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_tokenize_request(await _read_json(request, self._body_timeout_s))
        self._check_model(req.model)
        try:
            if req.prompt is not None:
                tokens = await self._encoder.encode(req.prompt, self._engine.max_model_len, req.add_special_tokens)
            else:
                assert req.messages is not None  # parse_tokenize_request gives exactly one of the two
                tokens = await self._encoder.encode_chat(req.messages, self._engine.max_model_len,
                                                         add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        body = {"count": len(tokens), "max_model_len": self._engine.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = [self._token_strings.text(t) for t in tokens]
        return _json(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse_detokenize_request(await _read_json(request, self._body_timeout_s), self._tokenizer.vocab_size)
        self._check_model(req.model)
        return _json({"prompt": self._tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def models(self, request: web.Request) -> web.Response:
        """The served model, then each LoRA adapter with it as its ``parent`` (vLLM's listing)."""
        base = {"object": "model", "created": self._created, "owned_by": "memserve",
                "max_model_len": self._engine.max_model_len}
        return _json({"object": "list", "data": [{"id": self._model_name, **base},
                                                 *({"id": name, **base, "parent": self._model_name}
                                                   for name in self._adapters.names())]})

    async def health(self, request: web.Request) -> web.Response:
        """200 when every worker is alive, else 503 naming the dead ones; status
        ``degraded`` (still 200) names workers whose heartbeats are late or whose step is
        stuck. Each worker's load and KV pool figures come along for operators and tests."""
        stats = self._engine.stats()
        workers = [{**w, "alive": bool(w.get("alive"))} for w in stats.get("workers", [])]
        body = {"workers": workers, "spare_workers": stats.get("spare_workers", [])}
        status, detail = health_status(workers)
        if detail is None:
            return _json({"status": status, **body})
        return _json({"status": status, "detail": detail, **body}, status=503 if status == "unhealthy" else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


def _http_exception_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own 404/405/413 and friends, re-shaped as OpenAI error objects."""
    if exc.status in (404, 405):
        message = f"{exc.reason}: {request.method} {request.path}"
    else:
        message = exc.text or exc.reason
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return APIError(exc.status, message, headers=headers).response()


def _error_middleware(metrics: GatewayMetrics) -> Callable:
    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except APIError as e:
            response = e.response()
        except web.HTTPException as e:
            response = _http_exception_response(request, e)
        except asyncio.CancelledError:
            metrics.count_request(endpoint, CLIENT_CLOSED_REQUEST)
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = APIError(500, "internal server error").response()
        metrics.count_request(endpoint, response.status)
        return response

    return middleware


def create_app(engine: EngineClient, tokenizer: Tokenizer, model_name: str, max_body_bytes: int = 4 * MiB,
               body_timeout_s: float = 10.0, tokenizer_processes: int = DEFAULT_PROCESSES,
               slo_defaults: dict[str, float] | None = None, truncation: str = DEFAULT_TRUNCATION,
               block_size: int = 16, web_ui: bool = True,
               auth: AuthConfig | None = None, tool_call_parser: str = TOOL_PARSER_AUTO,
               reasoning_parser: str | None = None, response_store: ResponseStore | None = None,
               adapters: AdapterRegistry | None = None,
               lora_changer: AdapterChanger | None = None) -> web.Application:
    """The OpenAI API over ``engine``. Serve it with ``connection.GatewayRunner(app,
    handler_cancellation=True)`` so that a client disconnect cancels its handler at once
    and malformed HTTP gets error objects too. ``slo_defaults``: the SLOs (``ttft_ms``,
    ``tbt_ms``) of requests that set none. ``truncation``: what becomes of a chat over the
    context window (text/truncation.py); ``block_size``: the workers' KV block size;
    ``web_ui``: serve the chat page (/) and the dashboard (/dashboard); ``tool_call_parser``
    and ``reasoning_parser``: how chat text is read (gateway/tool_parsers.py, reasoning.py);
    ``response_store``: where /v1/responses keeps stored responses (gateway/response_store.py);
    ``adapters``: the LoRA adapters a request may name as its model (--lora-modules);
    ``lora_changer``: where /v1/load_lora_adapter and /v1/unload_lora_adapter change them
    (--allow-runtime-lora-updating; gateway/lora_api.py), None: no such routes."""
    metrics = GatewayMetrics(engine.stats)
    # Anthropic's error objects on /v1/messages* (gateway/anthropic_api.py): outermost, it sees every error.
    middlewares = [anthropic_errors, _error_middleware(metrics)]
    # API keys (gateway/auth.py): ``auth`` with keys protects /v1/*, /tokenize, /detokenize
    # (and /metrics with a metrics key); without, nothing changes.
    if auth is not None and auth.enabled:
        middlewares.append(auth_middleware(auth, metrics.count_key))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    encoder = PromptEncoder(tokenizer, tokenizer_processes)

    async def close_encoder(_: web.Application) -> None:
        encoder.close()

    app.on_cleanup.append(close_encoder)
    server = _OpenAIServer(engine, tokenizer, encoder, model_name, metrics, body_timeout_s, slo_defaults or {},
                           truncation, block_size,
                           ChatParsers(tool_parser(tool_call_parser, tokenizer.chat_template),
                                       REASONING_PARSERS[reasoning_parser] if reasoning_parser else None),
                           adapters)
    app.add_routes([
        web.post("/v1/completions", server.completions),
        web.post("/v1/chat/completions", server.chat_completions),
        web.get("/v1/models", server.models),
        web.post("/tokenize", server.tokenize),
        web.post("/detokenize", server.detokenize),
        web.get("/health", server.health),
        web.get("/metrics", server.metrics),
    ])
    def read_json(request: web.Request) -> Awaitable[dict]:
        return _read_json(request, body_timeout_s)

    # OpenAI's Responses API (/v1/responses) on the chat pipeline: gateway/responses_api.py.
    add_responses_routes(app, server.run_chat, read_json, tokenizer,
                         response_store if response_store is not None else ResponseStore())
    # Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on it too: gateway/anthropic_api.py.
    add_messages_routes(app, server.run_chat, server.chat_prompt, read_json)
    # Stats API (/v1/stats, /v1/stats/stream) and, unless --no-web-ui, the chat and dashboard pages.
    add_stats_routes(app, engine.stats, metrics)
    if lora_changer is not None:
        add_lora_routes(app, lora_changer, model_name, read_json)
    if web_ui:
        add_web_routes(app)
    return app
