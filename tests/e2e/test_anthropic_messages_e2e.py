"""Anthropic's Messages API on a real ``memserve up``, through the official ``anthropic``
SDK and LangChain's ``ChatAnthropic``: messages whole and streamed, a forced tool call and
its ``tool_result`` round trip, a ``cache_control`` system block written then read back,
count_tokens, greedy text equal to the OpenAI chat endpoint's, and Anthropic's error
objects for bad requests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import anthropic
import openai
import pytest
from langchain_anthropic import ChatAnthropic

from memserve.bench.server_process import ServerHandle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The SDK no longer has sampling arguments (newer models fix them); older clients' fields go in the body.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}}}}


@pytest.fixture(scope="module")
def client(memserve_server: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=memserve_server.base_url, api_key="unused", max_retries=0)


def post(server: ServerHandle, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(server.base_url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                                              "anthropic-beta": "prompt-caching-2024-07-31"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_create_and_stream(client: anthropic.Anthropic, memserve_server: ServerHandle) -> None:
    kwargs = {"model": memserve_server.model, "max_tokens": 6, "extra_body": GREEDY, "messages": QUESTION}
    message = client.messages.create(**kwargs)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == memserve_server.model
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 6
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text  # greedy: the same text either way
    assert final.usage.output_tokens == message.usage.output_tokens and final.stop_reason == message.stop_reason


def test_greedy_text_equals_the_chat_endpoints(client: anthropic.Anthropic, memserve_server: ServerHandle) -> None:
    system = "You are a geography teacher."
    message = client.messages.create(model=memserve_server.model, max_tokens=8, extra_body=GREEDY, system=system,
                                     messages=QUESTION)
    chat = openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = chat.chat.completions.create(model=memserve_server.model, max_tokens=8, temperature=0,
                                              messages=[{"role": "system", "content": system}, *QUESTION])
    assert message.content[0].text == completion.choices[0].message.content
    assert message.usage.output_tokens == completion.usage.completion_tokens


def test_forced_tool_call_and_tool_result_round_trip(client: anthropic.Anthropic,
                                                     memserve_server: ServerHandle) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(model=memserve_server.model, max_tokens=24, extra_body=GREEDY, messages=question,
                                    tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    [use] = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input["city"], str) and called.stop_reason == "tool_use"
    answer = client.messages.create(
        model=memserve_server.model, max_tokens=6, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "none"},
        messages=[*question, {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 24 degrees"}]}])
    assert answer.content[0].type == "text" and answer.content[0].text and answer.stop_reason != "tool_use"


def test_a_cached_system_block_is_written_then_read(client: anthropic.Anthropic,
                                                     memserve_server: ServerHandle) -> None:
    system = [{"type": "text", "text": f"[{uuid.uuid4().hex}] You answer questions about rivers, briefly. " * 4,
               "cache_control": {"type": "ephemeral"}}]
    kwargs = {"model": memserve_server.model, "max_tokens": 2, "extra_body": GREEDY, "system": system,
              "messages": QUESTION}
    first = client.messages.create(**kwargs)
    again = client.messages.create(**kwargs)
    assert first.usage.cache_creation_input_tokens > 0 and first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens > 0
    count = client.messages.count_tokens(model=memserve_server.model, system=system, messages=QUESTION)
    for usage in (first.usage, again.usage):
        assert count.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                      + usage.cache_creation_input_tokens)


def test_langchain_chat_anthropic(memserve_server: ServerHandle) -> None:
    llm = ChatAnthropic(model=memserve_server.model, base_url=memserve_server.base_url, api_key="unused",
                        max_tokens=6, max_retries=0)
    reply = llm.invoke("Say hello.")
    assert isinstance(reply.text, str) and reply.text
    assert reply.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize("body, status, kind", [
    (b"{not json", 400, "invalid_request_error"),
    (json.dumps({"model": "SmolLM2-135M-Instruct", "messages": QUESTION}).encode(), 400, "invalid_request_error"),
    (json.dumps({"model": "claude-nonexistent", "max_tokens": 4, "messages": QUESTION}).encode(), 404,
     "not_found_error"),
    (json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}).encode(),
     400, "invalid_request_error"),
], ids=["bad-json", "no-max-tokens", "unknown-model", "image"])
def test_errors_are_anthropics(memserve_server: ServerHandle, body: bytes, status: int, kind: str) -> None:
    got_status, error = post(memserve_server, "/v1/messages", body)
    assert got_status == status and error["type"] == "error" and error["error"]["type"] == kind, error


def test_the_sdk_raises_its_own_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=QUESTION)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                               messages=[{"role": "user", "content": [image]}])
    assert "image" in bad.value.message
