"""The Responses API against a real ``memserve up`` with the ``openai`` SDK: greedy text
equal to the chat endpoint's, streaming with the SDK's helper, a conversation continued by
``previous_response_id`` whose earlier turn's KV is reused (cached tokens on the second
turn), a function-call round trip, ``text.format`` json_schema output that validates,
GET/DELETE and ``store: false``; then a server with API keys and a store of two responses:
a response is invisible to another key, and the oldest goes first."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from helpers.paths import REPO
from jsonschema import Draft202012Validator

from memserve.bench.server_process import ServerHandle, start_server, stop_server

MAX_TOKENS = 12
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1,
                                                                    "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(memserve_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="unused", max_retries=0)


def respond(client: openai.OpenAI, **fields):
    return client.responses.create(model="SmolLM2-135M-Instruct", temperature=0, max_output_tokens=MAX_TOKENS,
                                   **fields)


def test_greedy_text_equals_the_chat_endpoints(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}])
    response = respond(client, instructions="You answer briefly.", input="What is the capital of France?")
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_the_sdk_stream_helper(client: openai.OpenAI) -> None:
    """The helper's final response needs ``response.completed``: the answer ends before its budget."""
    fields = {"model": "SmolLM2-135M-Instruct", "input": "Say hello.", "temperature": 0, "max_output_tokens": 64}
    with client.responses.stream(**fields) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and len(deltas) > 1 and "".join(deltas) == final.output_text
    assert final.output_text == client.responses.create(**fields).output_text  # as unstreamed


def test_a_continued_conversation_reuses_the_first_turns_kv(client: openai.OpenAI) -> None:
    story = f"[{uuid.uuid4().hex}] A ferry crosses the river at dawn and at dusk, carrying carts and cattle."
    first = respond(client, input=story + " What does the ferry carry?")
    second = respond(client, input="And when does it cross?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 - 16


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=32)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    Draft202012Validator(WEATHER["parameters"]).validate(json.loads(call.arguments))
    second = respond(client, previous_response_id=first.id,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}])
    assert second.output_text and second.output[-1].type == "message"
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="SmolLM2-135M-Instruct", input="Describe a person.", temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    Draft202012Validator(PERSON).validate(json.loads(response.output_text))
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


def test_get_delete_and_store_false(client: openai.OpenAI) -> None:
    response = respond(client, input="Say hi.")
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = respond(client, input="Say hi.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        respond(client, input="Again.", previous_response_id=unstored.id)


def test_keys_and_a_bounded_store_on_a_real_server(tmp_path) -> None:
    keys = ("sk-responses-one-0123456789", "sk-responses-two-9876543210")
    server = start_server(["--num-blocks", "64", "--max-model-len", "256", "--api-key", keys[0], "--api-key",
                           keys[1], "--responses-store-size", "2"], tmp_path / "memserve.log", cwd=REPO)
    try:
        owner, other = (openai.OpenAI(base_url=server.base_url + "/v1", api_key=k, max_retries=0) for k in keys)
        response = owner.responses.create(model=server.model, input="Say hi.", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=server.model, input="Hi.", previous_response_id=response.id,
                                   max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response.id)
        assert owner.responses.retrieve(response.id).id == response.id
        later = [owner.responses.create(model=server.model, input="Hi.", max_output_tokens=2) for _ in range(2)]
        with pytest.raises(openai.NotFoundError):  # the oldest of three went
            owner.responses.retrieve(response.id)
        assert [owner.responses.retrieve(r.id).id for r in later] == [r.id for r in later]
    finally:
        stop_server(server)
