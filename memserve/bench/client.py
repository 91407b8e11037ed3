"""A streaming OpenAI-API client that timestamps every chunk of output.

It speaks only the public HTTP API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``) with aiohttp and parses Server-Sent Events itself, so the arrival of
every chunk is measured at the socket rather than after an SDK's buffering, and any
OpenAI-compatible server can be measured.

``dialect`` says which extension fields the server accepts:

- ``memserve`` (also right for vLLM and SGLang, which accept or ignore them):
  ``session_id``, ``slo_ttft_ms``, ``slo_tbt_ms`` and, for fixed output lengths,
  ``ignore_eos``.
- ``openai``: standard fields only; a fixed output length is only a ``max_tokens`` cap.
- ``transformers`` (``transformers serve``, which rejects unknown fields with 422):
  standard fields; a fixed output length is sent as a ``generation_config`` with
  ``min_new_tokens = max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import aiohttp

from memserve.workload.records import RequestRecord
from memserve.workload.replay import session_adapter

DIALECTS = ("memserve", "openai", "transformers")
ENDPOINTS = ("chat", "completions")


class BenchError(Exception):
    """A failure worth one clear line to the user (unreachable server, wrong model...)."""


class ModelListUnavailable(BenchError):
    """The server answered, but not with a model list (some servers, such as
    ``transformers serve`` without a Hugging Face cache, fail ``/v1/models``)."""


def normalize_base_url(url: str) -> str:
    """Accept ``http://host:port``, with or without a trailing ``/v1``."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def error_message(body: str) -> str:
    """The human part of an error body: OpenAI's ``error.message``, FastAPI's ``detail``,
    or the text itself, on one line."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            body = str(err["message"])
        elif isinstance(err, str):
            body = err
        elif data.get("detail"):
            body = str(data["detail"])
        elif data.get("message"):
            body = str(data["message"])
    return " ".join(body.split())[:300]


def completion_prompt(messages: list[dict]) -> str:
    """A plain-text transcript for ``/v1/completions`` (no chat template available there)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


class SSEDecoder:
    """Incremental Server-Sent Events parser: feed bytes, get complete ``data`` payloads."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            nl = self._buffer.find(b"\n")
            if nl < 0:
                return events
            line = self._buffer[:nl].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[nl + 1 :]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def close(self) -> list[str]:
        """Flush a last event that was not followed by a blank line."""
        events = self.feed(b"\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # comments (":...") and other fields (event:, id:, retry:) are not used


@dataclass
class RequestSpec:
    """One request of a session, as the runner asks for it."""

    session_id: str
    turn: int
    messages: list[dict]
    max_tokens: int
    fixed_output_len: bool = False
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None


@dataclass
class OpenAIClient:
    base_url: str
    model: str
    endpoint: str = "chat"
    dialect: str = "memserve"
    temperature: float | None = 0.0
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)
    # vLLM bench's --lora-modules: each conversation runs through one of these models (LoRA
    # adapters), the same for all its turns (its KV is that adapter's); empty: ``model``.
    lora_modules: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)  # the run's time origin
    _http: aiohttp.ClientSession | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {self.dialect!r}; choose from {', '.join(DIALECTS)}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose from {', '.join(ENDPOINTS)}")
        self.base_url = normalize_base_url(self.base_url)

    async def __aenter__(self) -> "OpenAIClient":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        connector = aiohttp.TCPConnector(limit=0)  # concurrency is the runner's decision
        self._http = aiohttp.ClientSession(headers=headers, connector=connector)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def list_models(self, timeout_s: float = 10.0) -> list[str]:
        """GET /v1/models; raises :class:`BenchError` with one line if that fails."""
        url = f"{self.base_url}/v1/models"
        try:
            async with self._session().get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise ModelListUnavailable(f"{url} answered HTTP {resp.status}: {error_message(body)}")
        except aiohttp.ClientConnectorError as e:
            raise BenchError(f"cannot reach the server at {self.base_url}: {e.os_error or e}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise BenchError(f"cannot reach the server at {self.base_url}: {type(e).__name__} {e}") from None
        try:
            return [str(m["id"]) for m in json.loads(body).get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            raise ModelListUnavailable(f"{url} did not return an OpenAI model list") from None

    def model_of(self, session_id: str) -> str:
        """The model a conversation's requests name: one of ``lora_modules``, spread evenly
        by a hash of the session id (``session_adapter``), else ``model``."""
        return session_adapter(session_id, self.lora_modules) or self.model

    def body(self, spec: RequestSpec) -> dict:
        body: dict = {"model": self.model_of(spec.session_id), "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = spec.messages
        else:
            body["prompt"] = completion_prompt(spec.messages)
        body["max_tokens"] = spec.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.dialect == "memserve":
            body["session_id"] = spec.session_id
            if spec.slo_ttft_ms is not None:
                body["slo_ttft_ms"] = spec.slo_ttft_ms
            if spec.slo_tbt_ms is not None:
                body["slo_tbt_ms"] = spec.slo_tbt_ms
            if spec.fixed_output_len:
                body["ignore_eos"] = True
        elif self.dialect == "transformers" and spec.fixed_output_len:
            body["generation_config"] = json.dumps(
                {
                    "max_new_tokens": spec.max_tokens,
                    "min_new_tokens": spec.max_tokens,
                    "do_sample": bool(self.temperature),
                }
            )
        body.update(self.extra_body)
        return body

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Send one streaming request and measure it; never raises for server or network
        failures (they end up in the record's ``status``), only for cancellation."""
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        record = RequestRecord(
            session_id=spec.session_id,
            turn=spec.turn,
            start=self.now(),
            slo_ttft_ms=spec.slo_ttft_ms,
            slo_tbt_ms=spec.slo_tbt_ms,
        )
        try:
            async with self._session().post(
                self.base_url + path,
                json=self.body(spec),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10.0),
            ) as resp:
                if resp.status != 200:
                    record.status = str(resp.status)
                    record.error = error_message(await resp.text())
                else:
                    await self._read_stream(resp, record)
        except aiohttp.ClientConnectorError as e:
            record.status, record.error = "connection", str(e.os_error or e)
        except asyncio.TimeoutError:
            record.status, record.error = "timeout", f"no complete answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as e:
            record.status, record.error = "disconnected", f"{type(e).__name__}: {e}"
        record.end = self.now()
        return record

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncGenerator[tuple[float, str], None]:
        """(arrival time, data payload) of each SSE event, as bytes come off the socket."""
        decoder = SSEDecoder()
        async for raw in resp.content.iter_any():
            arrived = self.now()
            for data in decoder.feed(raw):
                yield arrived, data
        for data in decoder.close():
            yield self.now(), data

    async def _read_stream(self, resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
        text_parts: list[str] = []
        counted = 0  # output tokens attributed to chunks so far
        async with aclosing(self._events(resp)) as events:
            async for arrived, data in events:
                if data.strip() == "[DONE]":
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    record.status, record.error = "bad_stream", f"not JSON: {data[:100]}"
                    return
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    record.status, record.error = "stream_error", error_message(json.dumps(chunk))
                    return
                usage = chunk.get("usage") or None
                text = _chunk_text(chunk)
                if text:
                    reported = usage.get("completion_tokens") if usage else None
                    tokens = max(1, reported - counted) if reported is not None else 1
                    counted += tokens
                    record.chunk_times.append(arrived)
                    record.chunk_tokens.append(tokens)
                    text_parts.append(text)
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                    record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = details["cached_tokens"]
        record.output_text = "".join(text_parts)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("use OpenAIClient inside 'async with'")
        return self._http


def _chunk_text(chunk: dict) -> str:
    """Output text of a chat (``delta.content`` / ``reasoning_content``) or completions
    (``text``) chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("reasoning_content") or "") + (delta.get("content") or "")
    return choice.get("text") or ""
