"""The gateway's OpenAI HTTP layer against a scripted fake engine: response shapes,
streaming, usage, stop strings, every bad-input case, engine failures, client
disconnects, metrics, health, the official ``openai`` client, and a torch-free import."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web
from helpers.fake_engine import (
    MESSAGES,
    MODEL,
    REPLY,
    FakeEngine,
    async_test,
    post,
    serve,
)
from prometheus_client.parser import text_string_to_metric_families

from memserve.gateway.app import create_app
from memserve.gateway.engine_protocol import EngineUnavailable, RequestRejected
from memserve.ipc.messages import SamplingParams
from memserve.text.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def serve_on_port(engine: FakeEngine, tokenizer: Tokenizer, handler_cancellation: bool) -> AsyncIterator[str]:
    """The app on a real loopback port, as ``memserve up`` runs it; yields the base URL."""
    runner = web.AppRunner(create_app(engine, tokenizer, MODEL), handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def expected_usage(prompt_tokens: int, completion_tokens: int, cached: int = 3) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


# ----------------------------------------------------------------------------- completions


@async_test
async def test_completion_non_stream(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, body = await post(client, "/v1/completions", {
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9,
            "top_k": 20, "seed": 7, "stop_token_ids": [42], "session_id": "conv-1", "slo_ttft_ms": 300,
            "slo_tbt_ms": 50, "priority": 2, "user": "ignored"})
    assert status == 200
    prompt_ids = tokenizer.encode("Once upon a time")
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert abs(body["created"] - time.time()) < 60
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == expected_usage(len(prompt_ids), len(engine.outputs))
    request = engine.requests[0]
    assert request["request_id"] == body["id"] and request["prompt_token_ids"] == prompt_ids
    assert request["params"] == SamplingParams(max_tokens=50, temperature=0.5, top_p=0.9, top_k=20, seed=7,
                                               stop_token_ids=[42, *tokenizer.eos_token_ids], ignore_eos=False)
    assert request["session_id"] == "conv-1"
    assert request["slo"] == {"ttft_ms": 300.0, "tbt_ms": 50.0, "priority": 2}
    assert engine.aborted == []  # the engine finished the request itself


@async_test
async def test_completion_defaults_and_token_id_prompt(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        assert (await post(client, "/v1/completions", {"prompt": [5, 6, 7]}))[0] == 200
        assert (await post(client, "/v1/completions", {"prompt": [[5, 6, 7]], "max_tokens": None,
                                                       "ignore_eos": True}))[0] == 200
    absent, null = engine.requests
    assert absent["prompt_token_ids"] == [5, 6, 7] and absent["slo"] is None and absent["session_id"] is None
    assert absent["params"].max_tokens == 16  # OpenAI's and vLLM's legacy default
    assert null["params"].max_tokens == 256 - 3  # explicit null: the rest of the context window
    assert null["params"].ignore_eos and null["params"].stop_token_ids == []


@async_test
async def test_completion_stream_with_usage(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, events = await post(client, "/v1/completions", {
            "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    *chunks, final, usage_chunk, _ = events
    assert all(c["object"] == "text_completion" and c["id"] == final["id"] for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert len(chunks) > 5  # really streamed, not one blob
    assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["text"] == ""
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == expected_usage(len(tokenizer.encode("Hi")), len(engine.outputs))


@async_test
async def test_completion_stream_without_usage_and_length_finish(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.finish_reason = "length"
    async with serve(engine, tokenizer) as client:
        _, events = await post(client, "/v1/completions", {"prompt": "Hi", "stream": True})
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


# ----------------------------------------------------------------------------- chat


@async_test
async def test_chat_non_stream(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 30, "max_tokens": 99})
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY, "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    prompt_ids = tokenizer.encode_chat(MESSAGES)
    assert engine.requests[0]["prompt_token_ids"] == prompt_ids
    assert engine.requests[0]["params"].max_tokens == 30  # max_completion_tokens wins
    assert body["usage"] == expected_usage(len(prompt_ids), len(engine.outputs))


@async_test
async def test_chat_text_parts_equal_string_content(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Greet"}, {"type": "text", "text": "me"}]}]
    async with serve(engine, tokenizer) as client:
        assert (await post(client, "/v1/chat/completions", {"messages": parts}))[0] == 200
    assert engine.requests[0]["prompt_token_ids"] == tokenizer.encode_chat([{"role": "user", "content": "Greet\nme"}])
    assert engine.requests[0]["params"].max_tokens == 256 - len(engine.requests[0]["prompt_token_ids"])


@async_test
async def test_chat_stream(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        _, events = await post(client, "/v1/chat/completions", {
            "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    opening, *content, final, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in events[:-1])
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == REPLY
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert final["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(engine.outputs)


# ----------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_stop_string_truncates_and_aborts(tokenizer: Tokenizer, stream: bool) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        _, result = await post(client, "/v1/completions", {
            "prompt": "Hi", "stop": ["xyz", "end is"], "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})})
    if stream:
        chunks = [e for e in result[:-1] if e["choices"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish, usage = chunks[-1]["choices"][0]["finish_reason"], result[-2]["usage"]
    else:
        text, finish, usage = result["choices"][0]["text"], result["choices"][0]["finish_reason"], result["usage"]
    assert text == "Hello! 😀 你好. The "
    assert finish == "stop"
    assert engine.aborted == [engine.requests[0]["request_id"]]
    consumed = next(n for n in range(1, len(engine.outputs) + 1)
                    if "end is" in tokenizer.decode([t for o in engine.outputs[:n] for t in o]))
    assert usage["completion_tokens"] == consumed < len(engine.outputs)


@async_test
async def test_stop_string_in_chat(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        _, body = await post(client, "/v1/chat/completions", {"messages": MESSAGES, "stop": "你好"})
    assert body["choices"][0]["message"]["content"] == "Hello! 😀 "
    assert engine.aborted == [body["id"]]


# ----------------------------------------------------------------------------- bad input

BAD_REQUESTS = [
    # (path, raw body or JSON object, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 300}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 256}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "slo_ttft_ms": 0}, 400, "slo_ttft_ms"),
    ("/v1/completions", {"prompt": "hi", "session_id": 12}, 400, "session_id"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
@async_test
async def test_bad_request_then_normal_request(tokenizer: Tokenizer, path: str, body, status: int,
                                               param: str | None) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with client.post(path, data=data, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param
        assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        if status == 404:
            assert error["code"] == "model_not_found"
        assert engine.requests == []  # rejected before reaching the engine
        assert (await post(client, "/v1/completions", {"prompt": "hi"}))[0] == 200


@async_test
async def test_context_length_error_explains_budget(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        status, body = await post(client, "/v1/completions", {"prompt": [1] * 200, "max_tokens": 100})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "256" in body["error"]["message"] and "300" in body["error"]["message"]


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                                ("POST", "/v1/models", 405), ("DELETE", "/health", 405)])
@async_test
async def test_routing_errors_are_error_objects(tokenizer: Tokenizer, method: str, path: str, status: int) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        async with client.request(method, path) as resp:
            assert resp.status == status
            assert (await resp.json())["error"]["type"] == {404: "NotFoundError", 405: "MethodNotAllowedError"}[status]
            if status == 405:
                assert "Allow" in resp.headers
        assert (await post(client, "/v1/completions", {"prompt": "hi"}))[0] == 200


@async_test
async def test_oversized_body_is_413(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer, max_body_bytes=1024) as client:
        async with client.post("/v1/completions", data=orjson.dumps({"prompt": "x" * 2000})) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["type"] == "RequestEntityTooLargeError"
        assert (await post(client, "/v1/completions", {"prompt": "hi"}))[0] == 200


# ----------------------------------------------------------------------------- engine failures


@pytest.mark.parametrize("exception,status", [(RequestRejected("cannot meet TTFT SLO", 2.5), 429),
                                              (EngineUnavailable("no live worker"), 503),
                                              (RuntimeError("boom"), 500)])
@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_engine_refusal_maps_to_status(tokenizer: Tokenizer, exception: Exception, status: int,
                                             stream: bool) -> None:
    engine = FakeEngine(tokenizer)
    engine.exception = exception
    async with serve(engine, tokenizer) as client:
        async with client.post("/v1/completions", json={"prompt": "hi", "stream": stream}) as resp:
            assert resp.status == status
            assert str(exception) in (await resp.json())["error"]["message"]
            if status == 429:
                assert resp.headers["Retry-After"] == "3"
        engine.exception = None
        assert (await post(client, "/v1/completions", {"prompt": "hi"}))[0] == 200


@async_test
async def test_engine_error_output(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.error = "CUDA out of memory"
    async with serve(engine, tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 500
        assert body["error"]["type"] == "InternalServerError" and "CUDA out of memory" in body["error"]["message"]
        status, events = await post(client, "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
        assert status == 200  # headers were already sent: the error arrives as an event
        assert "CUDA out of memory" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        engine.error = None
        assert (await post(client, "/v1/chat/completions", {"messages": MESSAGES}))[0] == 200
    assert engine.aborted == []  # the engine ended those requests itself


# ----------------------------------------------------------------------------- disconnects


@pytest.mark.parametrize("handler_cancellation", [True, False])
@pytest.mark.parametrize("stream", [True, False])
@async_test
async def test_client_disconnect_aborts_engine_request(tokenizer: Tokenizer, handler_cancellation: bool,
                                                       stream: bool) -> None:
    """Noticed through cancellation of the handler, or (without it) through a failed
    write or a closed transport between engine outputs."""
    engine = FakeEngine(tokenizer)
    engine.outputs = engine.outputs[:-1] * 40
    engine.delay_s = 0.02
    async with serve_on_port(engine, tokenizer, handler_cancellation) as url:
        async with aiohttp.ClientSession() as session:
            if stream:
                async with session.post(url + "/v1/completions", json={"prompt": "hi", "stream": True}) as resp:
                    assert (await resp.content.readline()).startswith(b"data: ")
                    resp.close()  # drop the connection mid-stream
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await session.post(url + "/v1/completions", json={"prompt": "hi"},
                                       timeout=aiohttp.ClientTimeout(total=0.2))
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
    assert engine.aborted == [engine.requests[0]["request_id"]]


# ----------------------------------------------------------------------------- models, health, metrics


@async_test
async def test_models(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        async with client.get("/v1/models") as resp:
            body = await resp.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(MODEL, "model", 256)]


@async_test
async def test_health(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        async with client.get("/health") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        engine.workers[1].alive = False
        async with client.get("/health") as resp:
            body = await resp.json()
            assert resp.status == 503 and "[1]" in body["detail"]
            assert [(w["instance_id"], w["alive"]) for w in body["workers"]] == [(0, True), (1, False)]
            assert body["workers"][0]["free_blocks"] == {"device": 100, "host": 400}
        engine.workers = []
        async with client.get("/health") as resp:
            assert resp.status == 503


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@async_test
async def test_metrics(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        await post(client, "/v1/completions", {"prompt": "Hi"})
        await post(client, "/v1/completions", {"prompt": "Hi", "n": 17})
        await post(client, "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
        async with client.get("/metrics") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            metrics = samples(await resp.text())

    def value(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    assert value("memserve_requests_total", endpoint="/v1/completions", status="200") == 1
    assert value("memserve_requests_total", endpoint="/v1/completions", status="400") == 1
    assert value("memserve_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    prompt_tokens = len(tokenizer.encode("Hi")) + len(tokenizer.encode_chat(MESSAGES))
    assert value("memserve_prompt_tokens_total") == prompt_tokens
    assert value("memserve_generation_tokens_total") == 2 * len(engine.outputs)
    assert value("memserve_time_to_first_token_seconds_count") == 2
    assert value("memserve_e2e_request_latency_seconds_count") == 2
    assert value("memserve_time_per_output_token_seconds_count") == 2
    assert value("memserve_free_blocks", instance="0", tier="host") == 400
    assert value("memserve_free_blocks", instance="1", tier="device") == 128
    assert value("memserve_num_requests_running", instance="0") == 2
    assert value("memserve_num_requests_waiting", instance="0") == 1
    assert value("memserve_cache_hit_rate", instance="0") == 0.25
    assert value("memserve_cached_tokens_total", instance="0") == 48
    assert value("memserve_shared_prefill_holds_total", instance="0") == 3
    assert value("memserve_spec_decode_num_draft_tokens_total", instance="0") == 40
    assert value("memserve_spec_decode_num_accepted_tokens_total", instance="0") == 25
    assert value("memserve_spec_decode_num_draft_tokens_total", instance="1") == 0
    assert value("memserve_worker_alive", instance="1") == 1


@async_test
async def test_metrics_survive_failing_engine_stats(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.stats = lambda: 1 / 0  # type: ignore[method-assign]
    async with serve(engine, tokenizer) as client:
        async with client.get("/metrics") as resp:
            assert resp.status == 200 and "memserve_requests_total" in await resp.text()


# ----------------------------------------------------------------------------- real clients, imports


@async_test
async def test_openai_client(tokenizer: Tokenizer) -> None:
    import openai

    engine = FakeEngine(tokenizer)
    async with serve_on_port(engine, tokenizer, handler_cancellation=True) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        completion = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=40,
                                                     extra_body={"session_id": "s-1", "slo_ttft_ms": 250})
        assert completion.choices[0].text == REPLY and completion.choices[0].finish_reason == "stop"
        assert completion.usage.prompt_tokens_details.cached_tokens == 3
        assert engine.requests[-1]["session_id"] == "s-1" and engine.requests[-1]["slo"] == {"ttft_ms": 250.0}

        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert chat.choices[0].message.content == REPLY and chat.usage.completion_tokens == len(engine.outputs)

        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
        assert chunks[-1].usage.total_tokens == len(tokenizer.encode_chat(MESSAGES)) + len(engine.outputs)

        text_stream = await client.completions.create(model=MODEL, prompt="Hi", stream=True)
        assert "".join([c.choices[0].text async for c in text_stream]) == REPLY

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="Hi")
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
        await client.close()


def test_gateway_never_imports_torch(tokenizer_folder: Path) -> None:
    code = (
        "import sys, types\n"
        "from memserve.gateway.app import create_app\n"
        "from memserve.text.tokenizer import Tokenizer\n"
        f"tokenizer = Tokenizer.from_folder({str(tokenizer_folder)!r})\n"
        "engine = types.SimpleNamespace(max_model_len=64, stats=lambda: {'workers': []})\n"
        "create_app(engine, tokenizer, 'm')\n"
        "tokenizer.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
