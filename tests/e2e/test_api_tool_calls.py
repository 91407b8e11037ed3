"""``tools`` + ``tool_choice``: a named function and ``required`` constrain SmolLM2
(whose template knows no tools) on a real ``memserve up``; ``auto`` is refused for it
with a 400 and, with a template that reads ``tools``, parses Hermes-style
``<tool_call>`` output (a scripted engine plays the model); a LangChain ``ChatOpenAI``
round trip calls a tool and answers from its result. Every body validates against
OpenAI's published schemas."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from helpers.fake_engine import async_test, post, scripted, serve
from helpers.openai_schema import assert_valid, chunk_schema, generate, sse_chunks
from jsonschema import Draft202012Validator

from memserve.bench.server_process import ServerHandle
from memserve.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(memserve_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict] = QUESTION, **fields) -> dict:
    """The raw JSON body of a greedy chat completion."""
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=64, **fields)
    return raw.http_response.json()


def chat_stream(server: ServerHandle, **fields) -> list[dict]:
    status, _, raw = generate(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 64,
                                                               "stream": True, **fields})
    assert status == 200, raw
    return sse_chunks(raw)


def assert_call(call: dict) -> None:
    """A well-formed call of one of TOOLS whose arguments validate against its schema."""
    assert call["id"].startswith("call_") and call["type"] == "function"
    schema = TOOLS[call["function"]["name"]]["function"]["parameters"]
    Draft202012Validator(schema).validate(json.loads(call["function"]["arguments"]))


def streamed_calls(chunks: list[dict]) -> list[dict]:
    """Tool calls put together from their deltas, as OpenAI's client libraries do."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        assert_valid(chunk, chunk_schema("CreateChatCompletionResponse", chunk))
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"function": {"arguments": ""}})
            call.update({k: delta[k] for k in ("id", "type") if k in delta})
            call["function"]["name"] = delta["function"].get("name", call["function"].get("name"))
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_tool_call(client: openai.OpenAI, memserve_server: ServerHandle, tool_choice: object) -> None:
    body = chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert_valid(body, "CreateChatCompletionResponse")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    calls = choice["message"]["tool_calls"]
    assert calls
    for call in calls:
        assert_call(call)
    if tool_choice == NAMED:
        assert [c["function"]["name"] for c in calls] == ["get_weather"]

    chunks = chat_stream(memserve_server, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in streamed_calls(chunks)] == [c["function"] for c in calls]


def test_history_with_tool_calls_and_results(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    body = chat(client, history, tools=[WEATHER], tool_choice="none")
    assert_valid(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["content"] and "tool_calls" not in body["choices"][0]["message"]


INVALID = [
    pytest.param({"tools": [WEATHER]}, "tool_choice", id="auto-without-template-support"),
    pytest.param({"tool_choice": "required"}, "tool_choice", id="tool-choice-without-tools"),
    pytest.param({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 "tool_choice", id="unknown-function"),
    pytest.param({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", id="unknown-tool-choice"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                  "tool_choice": "required"}, "tools[0].function.parameters", id="invalid-parameters"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
                 "tools[0].function.name", id="invalid-name"),
    pytest.param({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", id="duplicate-name"),
    pytest.param({"tools": {"a": 1}}, "tools", id="tools-not-array"),
    pytest.param({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
                 "response_format", id="with-response-format"),
    pytest.param({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"},
                 "parallel_tool_calls", id="mistyped-parallel-tool-calls"),
]


@pytest.mark.parametrize("fields,param", INVALID)
def test_invalid_tools_are_a_400(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body=fields)
    body = info.value.response.json()
    assert_valid(body, "ErrorResponse")
    assert body["error"]["param"] == param, body


def test_langchain_tool_round_trip(memserve_server: ServerHandle) -> None:
    """bind_tools with a named tool_choice -> a tool call -> a ToolMessage -> an answer."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return f"It is 21 degrees and sunny in {city}."

    llm = langchain_openai.ChatOpenAI(model=memserve_server.model, base_url=memserve_server.base_url + "/v1",
                                      api_key="unused", temperature=0, max_tokens=96, max_retries=0)
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"], reply
    call = reply.tool_calls[0]
    assert isinstance(call["args"].get("city"), str) and call["id"].startswith("call_")
    messages += [reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.invoke(messages)
    assert isinstance(answer.content, str) and answer.content.strip() and not answer.tool_calls


# ----------------------------------------------------------------------------- auto, Hermes style

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions: {{ tools | tojson }}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HERMES_REPLY = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n'
                '</tool_call>')


@pytest.fixture(scope="module")
def hermes_tokenizer(tokenizer_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("hermes-template")
    shutil.copytree(tokenizer_folder, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer.supports_tools
    return tokenizer


def content_calls_reason(body, stream: bool) -> tuple[str, list[dict], str]:
    """The content, tool calls and finish reason of a one-choice answer, whole or streamed."""
    if stream:
        chunks = body[:-1]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        return content, streamed_calls(chunks), chunks[-1]["choices"][0]["finish_reason"]
    assert_valid(body, "CreateChatCompletionResponse")
    message = body["choices"][0]["message"]
    return message["content"] or "", message["tool_calls"], body["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@async_test
async def test_auto_parses_hermes_tool_calls(hermes_tokenizer: Tokenizer, stream: bool) -> None:
    engine = scripted(hermes_tokenizer, HERMES_REPLY)
    async with serve(engine, hermes_tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {
            "messages": QUESTION, "tools": [WEATHER, TIME], "stream": stream})
    assert status == 200, body
    assert "get_time" in hermes_tokenizer.decode(engine.requests[0]["prompt_token_ids"])  # the template saw tools
    content, calls, reason = content_calls_reason(body, stream)
    assert content.strip() == "Let me check." and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Paris"})]
    for call in calls:
        assert_call(call)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@async_test
async def test_auto_without_a_call_is_text(hermes_tokenizer: Tokenizer, stream: bool) -> None:
    """Text that merely starts like a tag ("<tool") is held back, then sent as text."""
    reply = "Paris is sunny. <tool"
    async with serve(scripted(hermes_tokenizer, reply), hermes_tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {
            "messages": QUESTION, "tools": [WEATHER], "tool_choice": "auto", "stream": stream})
    assert status == 200, body
    if stream:
        chunks = body[:-1]
        for chunk in chunks:
            assert_valid(chunk, chunk_schema("CreateChatCompletionResponse", chunk))
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == reply and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        assert body["choices"][0]["message"]["content"] == reply and body["choices"][0]["finish_reason"] == "stop"
        assert "tool_calls" not in body["choices"][0]["message"]


# ----------------------------------------------------------------------------- auto, other families

# Each family's marker in its template picks its parser (--tool-call-parser auto).
FAMILY_REPLIES = {
    "llama3_json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                        '{"name": "get_time", "parameters": {"city": "Paris"}}'),
    "mistral": ("Let me check.", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                                 '"unit": "celsius"}}, {"name": "get_time", "arguments": {"city": "Paris"}}]'),
}
FAMILY_MARKERS = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


def family_tokenizer(folder: Path, tmp: Path, family: str) -> Tokenizer:
    shutil.copytree(folder, tmp, dirs_exist_ok=True)
    (tmp / "chat_template.jinja").write_text(HERMES_TEMPLATE.replace("You may call", FAMILY_MARKERS[family] + " call"))
    return Tokenizer.from_folder(tmp)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("family", sorted(FAMILY_REPLIES))
@async_test
async def test_auto_parses_each_familys_tool_calls(tokenizer_folder: Path, tmp_path: Path, family: str,
                                                   stream: bool) -> None:
    tokenizer = family_tokenizer(tokenizer_folder, tmp_path, family)
    want_content, reply = FAMILY_REPLIES[family]
    async with serve(scripted(tokenizer, reply), tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {
            "messages": QUESTION, "tools": [WEATHER, TIME], "stream": stream})
    assert status == 200, body
    content, calls, reason = content_calls_reason(body, stream)
    assert content.strip() == want_content and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@async_test
async def test_llama3_text_that_is_not_a_call_stays_text(tokenizer_folder: Path, tmp_path: Path,
                                                          stream: bool) -> None:
    """Llama 3.1's calls can only open the output: JSON later in the text is content."""
    tokenizer = family_tokenizer(tokenizer_folder, tmp_path, "llama3_json")
    reply = 'It is sunny. {"name": "get_weather"}'
    async with serve(scripted(tokenizer, reply), tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {
            "messages": QUESTION, "tools": [WEATHER], "stream": stream})
    assert status == 200, body
    if stream:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in body[:-1] if c["choices"])
    else:
        text = body["choices"][0]["message"]["content"]
    assert text == reply
