"""``response_format`` against a real ``memserve up`` with the ``openai`` client: for ten
JSON Schemas of varied shape the greedy output completes (finish_reason "stop") and
validates; ``json_object`` gives a JSON object; streaming gives the same text; schemas
the grammar engine cannot enforce get a 400 naming the field. Every body validates
against OpenAI's published schemas."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers.openai_schema import assert_valid, chunk_schema, generate, sse_chunks
from jsonschema import Draft202012Validator

from memserve.bench.server_process import ServerHandle

SHORT = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "flat": ("Describe a person.", {
        "type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    "nested": ("Where does Marie Curie live?", {
        "type": "object", "properties": {
            "person": {"type": "object", "properties": {"first": SHORT, "last": SHORT},
                       "required": ["first", "last"], "additionalProperties": False},
            "city": SHORT}, "required": ["person", "city"], "additionalProperties": False}),
    "integer-array": ("Pick three numbers.", {
        "type": "object", "properties": {"numbers": {"type": "array", "items": {
            "type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3, "maxItems": 3}},
        "required": ["numbers"], "additionalProperties": False}),
    "enums": ("Describe a T-shirt.", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False}),
    "bounded-numbers": ("What is the weather like?", {
        "type": "object", "properties": {
            "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
            "humidity": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.5}},
        "required": ["temperature", "humidity"], "additionalProperties": False}),
    "optional-field": ("Name a fruit.", {
        "type": "object", "properties": {"fruit": SHORT, "note": SHORT},
        "required": ["fruit"], "additionalProperties": False}),
    "patterns": ("Give an address code and a phone extension.", {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                         "extension": {"type": "string", "pattern": "^x[0-9]{2,3}$"}},
        "required": ["zip", "extension"], "additionalProperties": False}),
    "boolean-and-null": ("Is the task done?", {
        "type": "object", "properties": {"done": {"type": "boolean"},
                                         "reason": {"anyOf": [SHORT, {"type": "null"}]}},
        "required": ["done", "reason"], "additionalProperties": False}),
    "ref-array-of-objects": ("List a shopping basket.", {
        "$defs": {"item": {"type": "object", "properties": {"name": SHORT, "qty": {
            "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["name", "qty"],
            "additionalProperties": False}},
        "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                   "minItems": 1, "maxItems": 2}},
        "required": ["items"], "additionalProperties": False}),
    "top-level-array": ("Answer yes or no to three questions.", {
        "type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 3, "maxItems": 3}),
}
MAX_TOKENS = 96  # well above what any schema above needs once it is complete


@pytest.fixture(scope="module")
def client(memserve_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(client: openai.OpenAI, prompt: str, **fields) -> dict:
    """The raw JSON body of a chat completion (greedy unless ``fields`` say otherwise)."""
    raw = client.chat.completions.with_raw_response.create(**{
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": MAX_TOKENS, **fields})
    return raw.http_response.json()


def chat_stream(server: ServerHandle, prompt: str, **fields) -> list[dict]:
    status, _, raw = generate(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "stream": True, **fields})
    assert status == 200, raw
    return sse_chunks(raw)


SAMPLED_SEEDS = (0, 1, 2)
JSON_OBJECT_PROMPT = "Reply with a JSON object whose key 'capital' holds the capital of France."


@pytest.fixture(scope="module")
def outputs(client: openai.OpenAI, memserve_server: ServerHandle) -> dict:
    """All the generations the tests below look at, sent at once: the worker masks a
    batch of different grammars (greedy and sampled rows) in the same steps."""
    jobs = {name: (chat, client, prompt, {"response_format": json_schema_format(schema)})
            for name, (prompt, schema) in SCHEMAS.items()}
    jobs["stream"] = (chat_stream, memserve_server, SCHEMAS["nested"][0],
                      {"response_format": json_schema_format(SCHEMAS["nested"][1])})
    jobs["json_object"] = (chat, client, JSON_OBJECT_PROMPT, {"response_format": {"type": "json_object"}})
    for seed in SAMPLED_SEEDS:
        jobs[f"sampled-{seed}"] = (chat, client, SCHEMAS["enums"][0], {
            "response_format": json_schema_format(SCHEMAS["enums"][1]), "temperature": 1.0, "seed": seed})
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(fn, target, prompt, **fields)
                   for name, (fn, target, prompt, fields) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_output_completes_and_validates(outputs: dict, name: str) -> None:
    body = outputs[name]
    assert_valid(body, "CreateChatCompletionResponse")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    errors = list(Draft202012Validator(SCHEMAS[name][1]).iter_errors(value))
    assert not errors, (value, errors)


def test_stream_gives_the_same_text(outputs: dict) -> None:
    chunks = outputs["stream"]
    for chunk in chunks:
        assert_valid(chunk, chunk_schema("CreateChatCompletionResponse", chunk))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == outputs["nested"]["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_json_object_is_a_json_object(outputs: dict) -> None:
    body = outputs["json_object"]
    assert_valid(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_sampled_rows_respect_the_schema(outputs: dict) -> None:
    for seed in SAMPLED_SEEDS:
        Draft202012Validator(SCHEMAS["enums"][1]).validate(
            json.loads(outputs[f"sampled-{seed}"]["choices"][0]["message"]["content"]))


def test_completions_take_a_response_format(client: openai.OpenAI, memserve_server: ServerHandle) -> None:
    prompt, schema = SCHEMAS["flat"]
    raw = client.completions.with_raw_response.create(
        model=memserve_server.model, prompt="A person, as JSON: ", temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"response_format": json_schema_format(schema)})
    body = raw.http_response.json()
    assert_valid(body, "CreateCompletionResponse")
    assert body["choices"][0]["finish_reason"] == "stop"
    Draft202012Validator(schema).validate(json.loads(body["choices"][0]["text"]))


INVALID = [
    pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                  "uniqueItems": True}}},
                 "response_format.json_schema.schema", id="unenforceable-keyword"),
    pytest.param(json_schema_format({"type": "objekt"}), "response_format.json_schema.schema", id="unknown-type"),
    pytest.param(json_schema_format({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema",
                 id="dangling-ref"),
    pytest.param(json_schema_format({"type": "string", "pattern": "(("}), "response_format.json_schema.schema",
                 id="bad-pattern"),
    pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
                 "response_format.json_schema.schema", id="schema-not-object"),
    pytest.param({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
                 id="missing-name"),
    pytest.param({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
                 "response_format.json_schema.strict", id="mistyped-strict"),
    pytest.param({"type": "json_schema"}, "response_format.json_schema", id="missing-json-schema"),
    pytest.param({"type": "xml"}, "response_format", id="unknown-type-of-format"),
    pytest.param("json", "response_format", id="not-an-object"),
]


@pytest.mark.parametrize("response_format,param", INVALID)
def test_invalid_response_format_is_a_400(client: openai.OpenAI, response_format: object, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "hi", response_format=response_format)
    body = info.value.response.json()
    assert_valid(body, "ErrorResponse")
    assert body["error"]["param"] == param, body


def test_ignore_eos_cannot_be_combined(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "hi", response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    assert info.value.response.json()["error"]["param"] == "ignore_eos"
