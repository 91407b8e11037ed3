"""The Responses API (/v1/responses) through the gateway's real HTTP app over a scripted
fake engine: that it runs the chat pipeline (the same prompt as the chat endpoint), the
response object and stream events in the shapes of the ``openai`` SDK's models, the SDK
itself, continuations by ``previous_response_id``, function calls, structured output,
reasoning items, the store (bounded, per API key) and every 4xx as an error object."""

from __future__ import annotations

import json

import openai
import orjson
import pytest
from helpers.fake_engine import MESSAGES, MODEL, REPLY, FakeEngine, async_test, scripted, serve
from helpers.openai_schema import assert_valid
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from memserve.gateway.auth import AuthConfig
from memserve.gateway.response_store import ResponseStore
from memserve.text.tokenizer import Tokenizer

EVENT = TypeAdapter(ResponseStreamEvent)
KEY_1, KEY_2 = "sk-first-0123456789abcdef", "sk-second-fedcba9876543210"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def sse_events(text: str) -> list[dict]:
    """The events of a Responses stream: an ``event:`` line naming each ``data:`` line's type."""
    events = []
    for block in filter(None, text.split("\n\n")):
        name, data = block.split("\n")
        event = orjson.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"], block
        EVENT.validate_python(event)  # the SDK's own model of that event
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def create(client, body: dict, key: str | None = None) -> tuple[int, dict | list]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with client.post("/v1/responses", json={"model": MODEL, **body}, headers=headers) as resp:
        text = await resp.text()
        if resp.content_type == "text/event-stream":
            return resp.status, sse_events(text)
        body = orjson.loads(text)
        if resp.status == 200:
            Response.model_validate(body)
        return resp.status, body


async def call(client, method: str, path: str) -> tuple[int, dict]:
    async with client.request(method, path) as resp:
        return resp.status, await resp.json()


def texts(response: dict) -> list[str]:
    return [part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]]


def sdk(client, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


# ----------------------------------------------------------------------------- text


@async_test
async def test_a_response_runs_the_chat_pipeline(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        async with client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}) as resp:
            assert resp.status == 200
        status, body = await create(client, {"instructions": "Be brief.", "input": "Greet me",
                                             "metadata": {"run": "1"}, "user": "u-1"})
    assert status == 200
    chat, responses = engine.requests
    assert responses["prompt_token_ids"] == chat["prompt_token_ids"]  # the same template, the same prompt
    assert responses["params"] == chat["params"]
    assert body["id"].startswith("resp_") and responses["request_id"] == body["id"]
    assert body["object"] == "response" and body["status"] == "completed" and body["model"] == MODEL
    assert body["incomplete_details"] is None and body["error"] is None
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": REPLY, "annotations": [], "logprobs": []}]
    prompt = len(chat["prompt_token_ids"])
    assert body["usage"] == {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 3,
                                                                              "cache_write_tokens": 0},
                             "output_tokens": len(engine.outputs), "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + len(engine.outputs)}
    assert body["instructions"] == "Be brief." and body["metadata"] == {"run": "1"} and body["user"] == "u-1"
    assert body["store"] is True and body["previous_response_id"] is None
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert body["tools"] == [] and body["tool_choice"] == "auto" and body["temperature"] == 1.0


@async_test
async def test_input_items_render_as_chat_messages(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
                {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Greet me"}]
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Greet me"}]
    async with serve(engine, tokenizer) as client:
        async with client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}) as resp:
            assert resp.status == 200
        assert (await create(client, {"input": items}))[0] == 200
    assert engine.requests[1]["prompt_token_ids"] == engine.requests[0]["prompt_token_ids"]


@async_test
async def test_a_stream_builds_the_same_response(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, events = await create(client, {"input": "Greet me", "stream": True})
        assert status == 200
        types = [e["type"] for e in events]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert len(deltas) > 5  # really streamed
        assert types == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *[d["type"] for d in deltas], "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", "response.completed"]
        created, final = events[0]["response"], events[-1]["response"]
        assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
        assert final["id"] == created["id"] and final["status"] == "completed"
        assert "".join(d["delta"] for d in deltas) == REPLY == texts(final)[0]
        item_id = final["output"][0]["id"]
        assert all(e["item_id"] == item_id for e in deltas) and events[2]["item"]["id"] == item_id
        assert final["usage"]["output_tokens"] == len(engine.outputs)
        assert (await call(client, "GET", f"/v1/responses/{final['id']}")) == (200, final)  # stored as sent

        client_sdk = sdk(client)
        async with client_sdk.responses.stream(model=MODEL, input="Greet me") as stream:
            text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
            response = await stream.get_final_response()
        assert text == response.output_text == REPLY
        await client_sdk.close()


@async_test
async def test_max_output_tokens_cut_is_incomplete(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.finish_reason = "length"
    async with serve(engine, tokenizer) as client:
        status, body = await create(client, {"input": "Greet me", "max_output_tokens": 5})
        _, events = await create(client, {"input": "Greet me", "max_output_tokens": 5, "stream": True})
    assert status == 200 and engine.requests[0]["params"].max_tokens == 5
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["max_output_tokens"] == 5
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


@async_test
async def test_the_sdk_creates_and_retrieves(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        client_sdk = sdk(client)
        response = await client_sdk.responses.create(model=MODEL, input="Greet me", temperature=0, top_p=0.5)
        assert response.output_text == REPLY and response.usage.input_tokens_details.cached_tokens == 3
        assert response.temperature == 0 and response.top_p == 0.5
        assert (await client_sdk.responses.retrieve(response.id)).output_text == REPLY
        await client_sdk.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            await client_sdk.responses.retrieve(response.id)
        await client_sdk.close()


# ----------------------------------------------------------------------------- conversations


@async_test
async def test_previous_response_id_continues_the_conversation(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        _, first = await create(client, {"instructions": "Be brief.", "input": "Greet me"})
        _, second = await create(client, {"instructions": "Be brief.", "input": "Again, please",
                                          "previous_response_id": first["id"]})
        _, third = await create(client, {"input": "Once more", "previous_response_id": second["id"]})
    assert second["previous_response_id"] == first["id"] and texts(second) == [REPLY]
    one, two, three = (r["prompt_token_ids"] for r in engine.requests)
    assert two[:len(one)] == one  # the first turn's tokens lead: its cached KV serves them
    prompt = tokenizer.decode(three, skip_special_tokens=False)
    assert prompt.count(REPLY) == 2 and "Greet me" in prompt and "Again, please" in prompt
    assert "Be brief." not in prompt  # instructions are not carried over
    assert third["instructions"] is None


@async_test
async def test_function_call_round_trip(tokenizer: Tokenizer) -> None:
    engine = scripted(tokenizer, '{"city": "Paris"}')
    forced = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    async with serve(engine, tokenizer) as client:
        _, first = await create(client, {"input": "Weather in Paris?", **forced})
        [call] = first["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
        assert call["arguments"] == '{"city": "Paris"}' and call["call_id"].startswith("call_")
        assert call["id"].startswith("fc_") and engine.requests[0]["params"].grammar is not None
        assert first["tools"] == [{**WEATHER, "strict": None}] and first["tool_choice"] == forced["tool_choice"]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "22 C and sunny"}
        status, second = await create(client, {"input": [result], "previous_response_id": first["id"]})
        assert status == 200 and texts(second) == ['{"city": "Paris"}']
        prompt = tokenizer.decode(engine.requests[1]["prompt_token_ids"], skip_special_tokens=False)
        assert "22 C and sunny" in prompt and '"get_weather"' in prompt  # the call, then its output

        _, events = await create(client, {"input": "Weather in Paris?", "stream": True, **forced})
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert "".join(deltas) == done["arguments"] == '{"city": "Paris"}'
    assert events[-1]["response"]["output"][0]["arguments"] == done["arguments"]


@async_test
async def test_required_tool_choice_calls_a_listed_function(tokenizer: Tokenizer) -> None:
    engine = scripted(tokenizer, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    async with serve(engine, tokenizer) as client:
        _, body = await create(client, {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required"})
    assert [(i["type"], i["name"], i["arguments"]) for i in body["output"]] == \
        [("function_call", "get_weather", '{"city": "Oslo"}')]


@async_test
async def test_text_format_json_schema_and_json_object(tokenizer: Tokenizer) -> None:
    engine = scripted(tokenizer, '{"name": "Ada", "age": 36}')
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    async with serve(engine, tokenizer) as client:
        _, body = await create(client, {"input": "Who?", "text": text})
        _, plain = await create(client, {"input": "Who?", "text": {"format": {"type": "json_object"}}})
    assert json.loads(texts(body)[0]) == {"name": "Ada", "age": 36}
    assert body["text"] == {**text, "verbosity": "medium"} and plain["text"]["format"] == {"type": "json_object"}
    assert all(r["params"].grammar for r in engine.requests)


@async_test
async def test_reasoning_becomes_a_reasoning_item(tokenizer: Tokenizer) -> None:
    engine = scripted(tokenizer, "<think>Let me see.</think>\n\nHi there")
    async with serve(engine, tokenizer, reasoning_parser="qwen3") as client:
        _, body = await create(client, {"input": "Hi", "reasoning": {"effort": "low"}})
        _, events = await create(client, {"input": "Hi", "stream": True})
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert texts(body) == ["Hi there"] and body["reasoning"] == {"effort": "low", "summary": None}
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == \
        len(tokenizer.encode("Let me see.", add_special_tokens=False))
    thoughts = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in thoughts) == "Let me see." and {e["output_index"] for e in thoughts} == {0}
    assert events[-1]["response"]["output"][1:] == [{**message, "id": events[-1]["response"]["output"][1]["id"]}]


# ----------------------------------------------------------------------------- the store


@async_test
async def test_get_delete_and_store_false(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        _, body = await create(client, {"input": "Greet me"})
        path = f"/v1/responses/{body['id']}"
        assert await call(client, "GET", path) == (200, body)
        assert await call(client, "DELETE", path) == (200, {"id": body["id"], "object": "response", "deleted": True})
        for method in ("GET", "DELETE"):
            status, error = await call(client, method, path)
            assert status == 404 and error["error"]["param"] == "response_id"
        _, unstored = await create(client, {"input": "Greet me", "store": False})
        assert unstored["store"] is False
        assert (await call(client, "GET", f"/v1/responses/{unstored['id']}"))[0] == 404
        status, error = await create(client, {"input": "Again", "previous_response_id": unstored["id"]})
        assert status == 404 and error["error"]["code"] == "previous_response_not_found"


@async_test
async def test_the_store_is_bounded(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer, response_store=ResponseStore(max_responses=2)) as client:
        ids = [(await create(client, {"input": "Greet me"}))[1]["id"] for _ in range(3)]
        assert [(await call(client, "GET", f"/v1/responses/{i}"))[0] for i in ids] == [404, 200, 200]


def test_store_bounds_age_and_owners() -> None:
    now = [0.0]
    store = ResponseStore(max_responses=10, ttl_s=60.0, clock=lambda: now[0])
    store.put("a", {"id": "resp_1"}, [])
    now[0] = 30.0
    store.put("a", {"id": "resp_2"}, [])
    assert store.get("b", "resp_1") is None and not store.delete("b", "resp_1")  # another key's: absent
    now[0] = 61.0
    assert store.get("a", "resp_1") is None and store.get("a", "resp_2") is not None and len(store) == 1
    assert store.delete("a", "resp_2") and len(store) == 0
    empty = ResponseStore(max_responses=0)
    empty.put("a", {"id": "resp_3"}, [])
    assert empty.get("a", "resp_3") is None


@async_test
async def test_a_stored_response_belongs_to_its_api_key(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer, auth=AuthConfig((KEY_1, KEY_2))) as client:
        owner, other = sdk(client, KEY_1), sdk(client, KEY_2)
        response = await owner.responses.create(model=MODEL, input="Greet me")
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(model=MODEL, input="Again", previous_response_id=response.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(response.id)
        assert (await owner.responses.retrieve(response.id)).output_text == REPLY
        again = await owner.responses.create(model=MODEL, input="Again", previous_response_id=response.id)
        assert again.previous_response_id == response.id
        await owner.close()
        await other.close()


# ----------------------------------------------------------------------------- errors

BAD_REQUESTS = [
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{**WEATHER, "name": "bad name"}], "tool_choice": "required"}, "tools[0].name"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER]}, "tool_choice"),  # auto: SmolLM2's template has no tool support
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format.name"),
    ({"input": "Hi", "text": {"verbosity": "high"}}, "text.verbosity"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 3}, "temperature"),
    ({"input": "Hi", "metadata": {"k": 1}}, "metadata"),
    ({"input": "Hi", "store": "yes"}, "store"),
    ({"input": "Hi", "stream": "yes"}, "stream"),
    ({"input": "x " * 300}, "input"),  # over the context window (with --truncation error)
    ({"input": "Hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "Hi", "model": "other-model"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
@async_test
async def test_every_4xx_is_an_error_object(tokenizer: Tokenizer, body: dict, param: str) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer, truncation="error") as client:
        status, error = await create(client, body)
    assert 400 <= status < 500, error
    assert_valid(error, "ErrorResponse")
    assert error["error"]["param"] == param, error
    assert "messages" not in error["error"]["message"] and "function." not in error["error"]["message"]


@async_test
async def test_unreadable_requests_and_routes_are_error_objects(tokenizer: Tokenizer) -> None:
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        for method, path, data in (("POST", "/v1/responses", b"{not json"), ("POST", "/v1/responses", b"[1]"),
                                   ("PUT", "/v1/responses/resp_1", b"{}"),
                                   ("GET", "/v1/responses/resp_1?stream=true", None)):
            async with client.request(method, path, data=data, headers={"Content-Type": "application/json"}) as r:
                assert 400 <= r.status < 500, (method, path)
                assert_valid(await r.json(), "ErrorResponse")


@async_test
async def test_a_failure_once_streaming_is_an_error_event(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.error = "the worker was lost"
    async with serve(engine, tokenizer) as client:
        status, events = await create(client, {"input": "Greet me", "stream": True})
        assert status == 200
        assert events[-1]["type"] == "error" and "the worker was lost" in events[-1]["message"]
        assert not any(e["type"] == "response.completed" for e in events)
        response_id = events[0]["response"]["id"]
        assert (await call(client, "GET", f"/v1/responses/{response_id}"))[0] == 404  # never stored
