"""The gateway's HTTP layer against hostile and careless clients, with the scripted
``FakeEngine`` (no model): an explicit null token budget, tool-call history with null
content, the Content-Type policy, deep nesting, malformed HTTP answered with error
objects and one quiet log line, header/body timeouts and the connection cap, prompts
refused by their size, and long prompts tokenised without stalling the event loop.

The same defects against a real `memserve up`: ``tests/e2e/test_hostile_input.py``."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import multiprocessing
import shutil
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web
from helpers.fake_engine import MESSAGES, MODEL, FakeEngine, async_test, post, serve
from helpers.hostile_requests import RAW_HTTP_CASES, raw_http

from memserve.gateway.app import create_app
from memserve.gateway.connection import GatewayRunner
from memserve.gateway.errors import APIError
from memserve.gateway.prompt_encoder import INLINE_MAX_CHARS, PromptEncoder
from memserve.gateway.protocol import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from memserve.gateway.tool_calls import template_inputs
from memserve.text.tokenizer import Tokenizer

ERROR_KEYS = {"message", "type", "param", "code"}



LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(find_spec("uvloop") is None,
                                                                    reason="uvloop is not installed"))]


def on_each_loop(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test on asyncio's loop and on uvloop, which `memserve up` uses when it
    is installed: the connection layer meets the loop's transports directly."""
    @pytest.mark.parametrize("loop", LOOPS)
    @functools.wraps(fn)
    def wrapper(*args: object, loop: str, **kwargs: object) -> None:
        if loop == "uvloop":
            import uvloop

            return uvloop.run(fn(*args, **kwargs))
        return asyncio.run(fn(*args, **kwargs))

    signature = inspect.signature(fn)
    wrapper.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
        *signature.parameters.values(), inspect.Parameter("loop", inspect.Parameter.KEYWORD_ONLY)])
    return wrapper


@asynccontextmanager
async def gateway(engine: FakeEngine, tokenizer: Tokenizer, header_timeout_s: float = 10.0,
                  body_timeout_s: float = 10.0, max_connections: int = 1024) -> AsyncIterator[tuple[str, int]]:
    """The app behind ``GatewayRunner`` on a loopback port, as ``memserve up`` serves it."""
    app = create_app(engine, tokenizer, MODEL, body_timeout_s=body_timeout_s)
    runner = GatewayRunner(app, header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                           max_connections=max_connections, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][:2]
    finally:
        await runner.cleanup()


def assert_error_object(body: bytes | dict, status_type: str) -> dict:
    error = (orjson.loads(body) if isinstance(body, bytes) else body)["error"]
    assert set(error) == ERROR_KEYS and error["message"] and error["type"] == status_type
    return error


# ----------------------------------------------------------------------------- token budget (#5)


@pytest.mark.parametrize("fields,expected", [
    ({"max_completion_tokens": None, "max_tokens": 2}, 2),
    ({"max_completion_tokens": 3, "max_tokens": None}, 3),
    ({"max_tokens": 2, "max_completion_tokens": None}, 2),
    ({"max_completion_tokens": 3, "max_tokens": 9}, 3),
    ({"max_completion_tokens": None, "max_tokens": None}, None),  # both null: the rest of the window
])
@async_test
async def test_null_token_budget_never_overrides_a_given_one(tokenizer: Tokenizer, fields: dict,
                                                            expected: int | None) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, _ = await post(client, "/v1/chat/completions", {"messages": MESSAGES, **fields})
    assert status == 200
    prompt_len = len(engine.requests[0]["prompt_token_ids"])
    assert engine.requests[0]["params"].max_tokens == (expected or engine.max_model_len - prompt_len)


# ----------------------------------------------------------------------------- chat messages (#12, #1)

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}


@async_test
async def test_tool_call_history_with_null_content_is_rendered_as_empty(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant"}]  # absent content, too
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {"messages": messages})
    assert status == 200, body
    empty = [{**m, "content": m.get("content") or ""} for m in messages]
    # A template without tool support sees earlier calls in their turn's content.
    rendered, _ = template_inputs(empty, None, tokenizer.supports_tools)
    assert engine.requests[0]["prompt_token_ids"] == tokenizer.encode_chat(rendered)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", nested(200_000), None),  # 400 KB: segfaulted an orjson without a recursion limit
    ("/v1/completions", b'{"prompt": ' + nested(200_000) + b"}", None),
    ("/v1/completions", b'{"prompt": ' + nested(1000) + b"}", "prompt"),  # parses: orjson allows depth 1024
    ("/v1/completions", b'{"prompt": "hi", "stop": ' + nested(1000) + b"}", "stop"),
    ("/v1/chat/completions", b'{"messages": ' + nested(1000) + b"}", "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + nested(1000) + b"}]}",
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", '
     b'"arguments": ' + nested(1000) + b"}}]}]}", "messages[0].tool_calls"),
])
@async_test
async def test_deep_nesting_is_a_400_error_object(tokenizer: Tokenizer, path: str, body: bytes,
                                                  param: str | None) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        async with client.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            assert assert_error_object(await resp.read(), "BadRequestError")["param"] == param
        assert (await post(client, "/v1/completions", {"prompt": "hi"}))[0] == 200
    assert len(engine.requests) == 1


@async_test
async def test_template_sees_only_fixed_depth_message_fields(tokenizer_folder: Path, tmp_path: Path) -> None:
    """A template may ``tojson`` a whole message; a 1000-deep value must never get there."""
    shutil.copytree(tokenizer_folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m | tojson }}{% endfor %}")
    dumping = Tokenizer.from_folder(tmp_path)
    call = b'{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", "meta": ' + nested(1000)
    body = (b'{"messages": [{"role": "user", "content": "hi", "name": "ann", "meta": ' + nested(1000) + b"}, "
            b'{"role": "assistant", "content": null, "tool_calls": [' + call + b"}}]}]}")
    engine = FakeEngine(dumping)
    async with serve(engine, dumping) as client:
        async with client.post("/v1/chat/completions", data=body) as resp:
            assert resp.status == 200
    expected = [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL | {"id": "c", "function": {
                    "name": "f", "arguments": "{}"}}]}]
    rendered, _ = template_inputs(expected, None, dumping.supports_tools)
    assert engine.requests[0]["prompt_token_ids"] == dumping.encode_chat(rendered)


@pytest.mark.parametrize("field,value", [("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
                                         ("stop_token_ids", [5] * (MAX_STOP_TOKEN_IDS + 1))])
@async_test
async def test_per_token_lists_are_capped(tokenizer: Tokenizer, field: str, value: list) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        status, body = await post(client, "/v1/completions", {"prompt": "hi", field: value[:-1]})
        assert status == 200
        status, body = await post(client, "/v1/completions", {"prompt": "hi", field: value})
    assert status == 400 and body["error"]["param"] == field


# ----------------------------------------------------------------------------- Content-Type (#12)


@pytest.mark.parametrize("content_type,status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200),
    (None, 200),  # requests' data=..., httpx content=...
    ("application/x-www-form-urlencoded", 200),  # curl -d, urllib
    ("application/octet-stream", 200),  # aiohttp data=bytes
    ("text/plain", 415), ("text/plain;charset=UTF-8", 415),  # a browser's fetch or a text/plain form
    ("multipart/form-data; boundary=x", 415), ("application/xml", 415),
])
@async_test
async def test_content_type_policy(tokenizer: Tokenizer, content_type: str | None, status: int) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        headers = {"Content-Type": content_type} if content_type else {}
        async with client.post("/v1/completions", data=orjson.dumps({"prompt": "hi"}), headers=headers,
                               skip_auto_headers=["Content-Type"]) as resp:
            assert resp.status == status
            if status == 415:
                error = assert_error_object(await resp.read(), "UnsupportedMediaTypeError")
                assert "application/json" in error["message"]
    assert len(engine.requests) == (status == 200)


# ----------------------------------------------------------------------------- malformed HTTP (#6)


@pytest.mark.parametrize("name,data,status", RAW_HTTP_CASES, ids=[case[0] for case in RAW_HTTP_CASES])
@on_each_loop
async def test_malformed_http_gets_an_error_object_and_one_quiet_log_line(
        tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture, name: str, data: bytes, status: int) -> None:
    engine = FakeEngine(tokenizer)
    caplog.set_level(logging.DEBUG)
    async with gateway(engine, tokenizer) as (host, port):
        answer = await asyncio.to_thread(raw_http, host, port, data)
        await asyncio.sleep(0.05)  # let the server finish with the connection
        records = [r for r in caplog.records if not r.name.startswith("asyncio")]
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{host}:{port}/v1/completions", json={"prompt": "hi"}) as resp:
                assert resp.status == 200
    assert answer.status == status and answer.content_type == "application/json"
    assert_error_object(answer.body, {400: "BadRequestError", 431: "RequestHeaderFieldsTooLargeError"}[status])
    assert all(r.levelno <= logging.INFO and not r.exc_info for r in records), [r.getMessage() for r in records]
    assert len([r for r in records if r.levelno == logging.INFO]) <= 1
    assert all(len(r.getMessage()) < 300 for r in records)


# ----------------------------------------------------------------------------- slow clients, cap (#10)


def _closed_after(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes ``sock`` (reading what it sends), at most ``limit_s``."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, ConnectionResetError):
        pass
    return time.monotonic() - started


@on_each_loop
async def test_stalled_request_heads_are_closed_after_the_header_timeout(tokenizer: Tokenizer) -> None:
    async with gateway(FakeEngine(tokenizer), tokenizer, header_timeout_s=0.5) as (host, port):
        idle = socket.create_connection((host, port))
        partial = socket.create_connection((host, port))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        trickle = socket.create_connection((host, port))

        async def drip() -> None:  # a byte every 0.1 s does not keep the connection open
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n"[:20]:
                await asyncio.sleep(0.1)
                try:
                    trickle.send(bytes([byte]))
                except OSError:
                    return

        dripping = asyncio.create_task(drip())
        waited = await asyncio.gather(*(asyncio.to_thread(_closed_after, s, 5.0) for s in (idle, partial, trickle)))
        await dripping
        for s in (idle, partial, trickle):
            s.close()
    assert all(w < 2.0 for w in waited), waited


@on_each_loop
async def test_stalled_body_gets_408_and_the_connection_closes(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with gateway(engine, tokenizer, header_timeout_s=5.0, body_timeout_s=0.5) as (host, port):
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        started = time.monotonic()
        sock.settimeout(5.0)
        answer = b""
        while chunk := await asyncio.to_thread(sock.recv, 65536):
            answer += chunk
        elapsed = time.monotonic() - started
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert "0.5 s" in assert_error_object(body, "RequestTimeoutError")["message"]
    assert elapsed < 2.0  # answered at the timeout and closed, not drained for longer
    assert engine.requests == []


@on_each_loop
async def test_connections_over_the_cap_get_503_at_once(tokenizer: Tokenizer) -> None:
    async with gateway(FakeEngine(tokenizer), tokenizer, max_connections=3) as (host, port):
        held = []
        for _ in range(3):  # each connection is registered once it has been answered
            sock = socket.create_connection((host, port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.to_thread(sock.recv, 65536)).startswith(b"HTTP/1.1 200")
            held.append(sock)
        started = time.monotonic()
        over = socket.create_connection((host, port))
        over.settimeout(5.0)
        answer = b""
        while chunk := await asyncio.to_thread(over.recv, 65536):
            answer += chunk
        elapsed = time.monotonic() - started
        over.close()
        held.pop().close()
        await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as session:  # a freed slot serves again
            async with session.get(f"http://{host}:{port}/health") as resp:
                assert resp.status == 200
        for sock in held:
            sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
    assert "3 open connections" in assert_error_object(body, "ServiceUnavailableError")["message"]
    assert elapsed < 1.0


# ----------------------------------------------------------------------------- prompt size, tokenising (#8)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@async_test
async def test_prompt_longer_than_any_that_fits_is_refused_by_its_size(tokenizer: Tokenizer, path: str) -> None:
    engine = FakeEngine(tokenizer)
    limit = engine.max_model_len * tokenizer.max_chars_per_token
    text = "x" * (limit + 1)
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    async with serve(engine, tokenizer) as client:
        status, response = await post(client, path, body)
    assert status == 400 and response["error"]["code"] == "context_length_exceeded"
    assert str(limit) in response["error"]["message"]
    assert engine.requests == []


@pytest.mark.parametrize("text", ["#" * 5000, " " * 5000, ("\n" + " " * 80) * 60, "-" * 64 * 70, "word " * 900,
                                  "\u00e9\U0001f600" * 700, "<|im_start|>" * 300])
def test_no_text_has_more_characters_than_its_tokens_allow(tokenizer: Tokenizer, text: str) -> None:
    """The size bound never refuses a prompt that would fit, even one of the longest tokens."""
    assert len(text) <= len(tokenizer.encode(text)) * tokenizer.max_chars_per_token


@async_test
async def test_long_prompts_are_tokenised_in_processes_without_stalling_the_loop(tokenizer: Tokenizer) -> None:
    """The same ids as inline, and the event loop keeps ticking meanwhile."""
    encoder = PromptEncoder(tokenizer, processes=1)
    text = "The quick brown fox, 1234 \u00e9\u00e8 \U0001f600. " * 8000  # ~300k characters: about a second inline
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}] * 200
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - before - 0.01)

    ticker = asyncio.create_task(tick())
    try:
        await encoder.encode("warm up the pool " * INLINE_MAX_CHARS, 10**6)
        gaps.clear()
        started = time.monotonic()
        ids = await encoder.encode(text, 10**6)
        encoding_s = time.monotonic() - started
        chat_ids = await encoder.encode_chat(conversation, 10**6)
    finally:
        ticker.cancel()
        encoder.close()
    assert ids == tokenizer.encode(text)
    assert chat_ids == tokenizer.encode_chat(conversation)
    assert max(gaps) < max(0.1, encoding_s / 4), (max(gaps), encoding_s)


@async_test
async def test_a_killed_tokenizer_process_costs_one_503_and_is_replaced(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, processes=1)
    short = "word " * (INLINE_MAX_CHARS // 4)  # not short enough to stay inline
    try:
        await encoder.encode(short, 10**6)  # the pool is up
        pending = asyncio.create_task(encoder.encode("word " * 300_000, 10**6))  # seconds of work
        await asyncio.sleep(0.1)
        for process in multiprocessing.active_children():
            process.kill()
        with pytest.raises(APIError) as refused:
            await pending
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert await encoder.encode(short, 10**6) == tokenizer.encode(short)
    finally:
        encoder.close()


ORPHANING_GATEWAY = """
import asyncio, multiprocessing, sys, time
from memserve.gateway.prompt_encoder import INLINE_MAX_CHARS, PromptEncoder
from memserve.text.tokenizer import Tokenizer

async def main():
    encoder = PromptEncoder(Tokenizer.from_folder(sys.argv[1]), processes=2)
    text = "word " * INLINE_MAX_CHARS
    await asyncio.gather(encoder.encode(text, 10**6), encoder.encode(text, 10**6))
    print(*(p.pid for p in multiprocessing.active_children()), flush=True)
    time.sleep(60)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_tokenizer_processes_exit_when_the_gateway_is_killed(tokenizer_folder: Path, tmp_path: Path) -> None:
    script = tmp_path / "gateway.py"
    script.write_text(ORPHANING_GATEWAY)
    gateway_process = subprocess.Popen([sys.executable, str(script), str(tokenizer_folder)], stdout=subprocess.PIPE,
                                       text=True)
    children = [int(pid) for pid in gateway_process.stdout.readline().split()]
    gateway_process.kill()
    gateway_process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in children):
        time.sleep(0.1)
    assert children and not [pid for pid in children if Path(f"/proc/{pid}").exists()]
