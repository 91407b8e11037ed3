"""Anthropic's Messages API (/v1/messages, gateway/anthropic_*.py) through the real HTTP app
with a scripted engine playing the model: the translation into the chat pipeline's
request, messages and their SSE events, stop sequences, tool use, thinking, usage under
cache_control pins (taken or refused), count_tokens, Anthropic's error objects on every
failure, ``x-api-key``, and the official ``anthropic`` SDK."""

from __future__ import annotations

import dataclasses

import anthropic
import orjson
import pytest
from helpers.fake_engine import MESSAGES, MODEL, REPLY, FakeEngine, async_test, post, scripted, serve

from memserve.gateway.anthropic_protocol import parse_messages_request
from memserve.gateway.auth import AuthConfig
from memserve.gateway.engine_protocol import RequestRejected
from memserve.text.tokenizer import Tokenizer

BODY = {"model": MODEL, "max_tokens": 50, "system": "Be brief.", "messages": [{"role": "user", "content": "Greet me"}]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
KEY = "sk-anthropic-test"


def anthropic_events(text: str) -> list[tuple[str, dict]]:
    """An Anthropic SSE body as (event name, data) pairs; each data's type is its name."""
    events = []
    for block in filter(None, text.split("\n\n")):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        name, data = name_line[len("event: "):], orjson.loads(data_line[len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    return events


async def stream(client, body: dict, headers: dict | None = None) -> tuple[int, list[tuple[str, dict]]]:
    async with client.post("/v1/messages", json={**body, "stream": True}, headers=headers) as resp:
        assert resp.content_type == "text/event-stream"
        return resp.status, anthropic_events(await resp.text())


def streamed_text(events: list[tuple[str, dict]], delta_type: str = "text_delta", key: str = "text") -> str:
    return "".join(d["delta"][key] for name, d in events if name == "content_block_delta"
                   and d["delta"]["type"] == delta_type)


def assert_error(status: int, body: dict, want_status: int, want_type: str) -> None:
    assert status == want_status, body
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == want_type and body["error"]["message"], body


# ----------------------------------------------------------------------------- the request


def test_a_conversation_becomes_the_chat_messages_it_means() -> None:
    marker = {"type": "ephemeral", "ttl": "1h"}
    req = parse_messages_request({
        "model": MODEL, "max_tokens": 9, "stop_sequences": ["END"], "temperature": 0, "top_k": 5,
        "metadata": {"user_id": "u-1"}, "tools": [WEATHER], "tool_choice": {"type": "any"},
        "system": [{"type": "text", "text": "Be brief."},
                   {"type": "text", "text": "Be kind.", "cache_control": marker}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ]})
    assert req.user_id == "u-1"
    chat = req.chat
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.cache_pin is not None and (chat.cache_pin.message_index, chat.cache_pin.ttl_s) == (0, 3600.0)
    assert chat.tool_choice is not None and chat.tool_choice.mode == "required"
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (9, ["END"], 0.0, 5)
    assert not chat.stream


@pytest.mark.parametrize("extra, index", [
    ({"cache_control": {"type": "ephemeral"}}, 3),  # automatic caching: through the last message
    ({"tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}], "tool_choice": {"type": "none"}}, 0),
])
def test_cache_markers_of_the_whole_prompt_and_of_tools(extra: dict, index: int) -> None:
    body = {"model": MODEL, "max_tokens": 9, "system": "S", **extra,
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                                       "content": [{"type": "text", "text": "boom"}]}]}]}
    chat = parse_messages_request(body).chat
    assert chat.messages[-1] == {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}
    assert chat.cache_pin is not None and chat.cache_pin.message_index == index


# ----------------------------------------------------------------------------- responses


@async_test
async def test_a_message_is_the_chat_pipelines_answer_in_anthropics_shape(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, body = await post(client, "/v1/messages", BODY)
        chat_status, _ = await post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 50})
        count_status, count = await post(client, "/v1/messages/count_tokens",
                                         {k: v for k, v in BODY.items() if k != "max_tokens"})
    assert status == chat_status == count_status == 200, body
    anthropic_request, chat_request = engine.requests
    assert anthropic_request["prompt_token_ids"] == chat_request["prompt_token_ids"]
    assert anthropic_request["params"] == chat_request["params"]
    prompt = len(chat_request["prompt_token_ids"])
    assert body["id"].startswith("msg_") and anthropic_request["request_id"] == body["id"]
    assert body == {"id": body["id"], "type": "message", "role": "assistant", "model": MODEL,
                    "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": prompt - 3, "output_tokens": len(engine.outputs),
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3}}
    assert count == {"input_tokens": prompt}


@async_test
async def test_the_stream_is_anthropics_event_sequence(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, events = await stream(client, BODY)
    assert status == 200
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and len(names) > 10  # really streamed
    start = events[0][1]["message"]
    prompt = len(engine.requests[0]["prompt_token_ids"])
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": prompt - 3, "output_tokens": 0, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 3}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert streamed_text(events) == REPLY
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {**start["usage"], "output_tokens": len(engine.outputs)}}


@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "stream"])
@async_test
async def test_stop_sequences_and_max_tokens(tokenizer: Tokenizer, stream_it: bool) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        for body, text, reason, sequence in ((
                {**BODY, "stop_sequences": ["zzz", "end"]}, REPLY[:REPLY.index("end")], "stop_sequence", "end"),
                (BODY, REPLY, "max_tokens", None)):
            engine.finish_reason = "stop" if sequence else "length"
            if stream_it:
                _, events = await stream(client, body)
                got = (streamed_text(events), events[-2][1]["delta"])
            else:
                got = (await post(client, "/v1/messages", body))[1]
                got = (got["content"][0]["text"], {k: got[k] for k in ("stop_reason", "stop_sequence")})
            assert got == (text, {"stop_reason": reason, "stop_sequence": sequence})


@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "stream"])
@async_test
async def test_a_forced_tool_call_is_a_tool_use_block(tokenizer: Tokenizer, stream_it: bool) -> None:
    arguments = '{"city": "Paris"}'
    body = {**BODY, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    async with serve(scripted(tokenizer, arguments), tokenizer) as client:
        if stream_it:
            _, events = await stream(client, body)
            start = next(d for name, d in events if name == "content_block_start")["content_block"]
            block = {**start, "input": orjson.loads(streamed_text(events, "input_json_delta", "partial_json"))}
            stop_reason = events[-2][1]["delta"]["stop_reason"]
        else:
            _, message = await post(client, "/v1/messages", body)
            [block], stop_reason = message["content"], message["stop_reason"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and block["name"] == "get_weather"
    assert block["input"] == {"city": "Paris"} and stop_reason == "tool_use"


@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "stream"])
@async_test
async def test_reasoning_is_a_thinking_block(tokenizer: Tokenizer, stream_it: bool) -> None:
    async with serve(scripted(tokenizer, "<think>\nBlue is calm.\n</think>\n\nBlue."), tokenizer,
                     reasoning_parser="qwen3") as client:
        if stream_it:
            _, events = await stream(client, BODY)
            starts = [d["content_block"]["type"] for name, d in events if name == "content_block_start"]
            got = [streamed_text(events, "thinking_delta", "thinking"), streamed_text(events)]
            assert starts == ["thinking", "text"]
        else:
            _, message = await post(client, "/v1/messages", BODY)
            thinking, text = message["content"]
            assert thinking["type"] == "thinking" and thinking["signature"] == ""
            got = [thinking["thinking"], text["text"]]
    assert got == ["\nBlue is calm.\n", "Blue."]


# ----------------------------------------------------------------------------- cache_control usage


class PinRefusingEngine(FakeEngine):
    """Says each request's pin was refused, as the engine does past its caps."""

    async def generate(self, *args, **kwargs):
        async for out in super().generate(*args, **kwargs):
            yield dataclasses.replace(out, pin_refused="past the cap")


@pytest.mark.parametrize("engine_cls", [FakeEngine, PinRefusingEngine], ids=["pinned", "refused"])
@async_test
async def test_usage_splits_the_prompt_into_read_written_and_the_rest(tokenizer: Tokenizer, engine_cls) -> None:
    engine = engine_cls(tokenizer)
    system = "You answer questions about rivers and bridges. " * 6
    body = {**BODY, "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
    async with serve(engine, tokenizer) as client:
        async with client.post("/v1/messages", json=body) as resp:
            message, header = await resp.json(), resp.headers.get("x-memserve-cache-pin")
    params = engine.requests[0]["params"]
    head = tokenizer.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False)
    assert params.pin_tokens == len(head) > 3 and params.pin_ttl_s == 300.0
    prompt = len(engine.requests[0]["prompt_token_ids"])
    written = 0 if header else len(head) - 3
    assert (header is not None) == (engine_cls is PinRefusingEngine)
    assert message["usage"] == {"input_tokens": prompt - 3 - written, "output_tokens": len(engine.outputs),
                                "cache_creation_input_tokens": written, "cache_read_input_tokens": 3}


# ----------------------------------------------------------------------------- errors and keys


@async_test
async def test_every_error_is_anthropics_error_object(tokenizer: Tokenizer) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        async with client.post("/v1/messages", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            assert_error(r.status, await r.json(), 400, "invalid_request_error")
        async with client.get("/v1/messages") as r:
            assert_error(r.status, await r.json(), 405, "invalid_request_error")
        for body, status, kind in (
                ({k: v for k, v in BODY.items() if k != "max_tokens"}, 400, "invalid_request_error"),
                ({**BODY, "max_tokens": 0}, 400, "invalid_request_error"),
                ({**BODY, "model": "claude-nonexistent"}, 404, "not_found_error"),
                ({**BODY, "messages": [{"role": "user", "content": [image]}]}, 400, "invalid_request_error"),
                ({**BODY, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
                ({**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Sure"}]}, 400,
                 "invalid_request_error"),
                ({**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
                 "invalid_request_error"),
                ({**BODY, "max_tokens": 10_000}, 400, "invalid_request_error")):  # past the context window
            got_status, got = await post(client, "/v1/messages", body)
            assert_error(got_status, got, status, kind)
        image_status, image_error = await post(client, "/v1/messages/count_tokens",
                                               {"model": MODEL, "messages": [{"role": "user", "content": [image]}]})
        assert_error(image_status, image_error, 400, "invalid_request_error")
        assert "image" in image_error["error"]["message"]
        engine.exception = RequestRejected("the SLO cannot be met", retry_after_s=2.0)
        async with client.post("/v1/messages", json=BODY) as r:
            assert_error(r.status, await r.json(), 429, "rate_limit_error")
            assert r.headers["Retry-After"] == "2"
        engine.exception = None
        engine.error = "the worker died"
        status, events = await stream(client, BODY)
        assert status == 200 and events[-1][0] == "error"
        assert events[-1][1]["error"]["type"] == "api_error" and "the worker died" in events[-1][1]["error"]["message"]
        # the OpenAI endpoints keep OpenAI's error object
        status, body = await post(client, "/v1/chat/completions", {"model": "claude-nonexistent", "messages": MESSAGES})
        assert status == 404 and body["error"]["code"] == "model_not_found"


@async_test
async def test_x_api_key_authenticates_and_a_bad_one_gets_anthropics_401(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer, auth=AuthConfig((KEY,))) as client:
        for headers, status in (({"x-api-key": KEY}, 200), ({"Authorization": f"Bearer {KEY}"}, 200),
                                ({"x-api-key": "sk-wrong"}, 401), ({}, 401)):
            async with client.post("/v1/messages", json=BODY, headers=headers) as r:
                body = await r.json()
                if status == 401:
                    assert_error(r.status, body, 401, "authentication_error")
                else:
                    assert r.status == 200 and body["type"] == "message"
        async with client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                               headers={"x-api-key": KEY}) as r:
            assert r.status == 200  # the header serves every endpoint


# ----------------------------------------------------------------------------- the official SDK


@async_test
async def test_the_anthropic_sdk_creates_streams_and_counts(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    kwargs = {"model": MODEL, "max_tokens": 50, "system": "Be brief.",
              "messages": [{"role": "user", "content": "Greet me"}]}
    async with serve(engine, tokenizer, auth=AuthConfig((KEY,))) as client:
        url = str(client.make_url(""))
        async with anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as sdk:
            message = await sdk.messages.create(**kwargs)
            async with sdk.messages.stream(**kwargs) as streamed:
                text = "".join([t async for t in streamed.text_stream])
                final = await streamed.get_final_message()
            count = await sdk.messages.count_tokens(model=MODEL, system="Be brief.", messages=kwargs["messages"])
            with pytest.raises(anthropic.NotFoundError) as unknown:
                await sdk.messages.create(**{**kwargs, "model": "claude-nonexistent"})
        async with anthropic.AsyncAnthropic(base_url=url, api_key="sk-wrong", max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as bad_key:
                await wrong.messages.create(**kwargs)
    assert message.content[0].text == text == final.content[0].text == REPLY
    assert message.stop_reason == final.stop_reason == "end_turn"
    assert message.usage == final.usage
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    assert unknown.value.body["error"]["type"] == "not_found_error"
