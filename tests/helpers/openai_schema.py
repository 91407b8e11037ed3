"""OpenAI's published response schemas, and raw HTTP requests to a live server to check against them."""

from __future__ import annotations

import copy
import functools
import json
import urllib.error
import urllib.request
from typing import Any

import orjson
from jsonschema import Draft202012Validator

from helpers.paths import REPO
from memserve.bench.server_process import ServerHandle

SCHEMAS_PATH = REPO.parent / "shared" / "specs" / "openai-schemas.json"

# OpenAI streams text completions as CreateCompletionResponse objects whose finish_reason
# is null until the last chunk, which the published schema does not allow
# (openai/openai-openapi#100, closed unmerged). Chunks still streaming are checked
# against that schema with finish_reason nullable, the only exception made.
COMPLETION_CHUNK = "CreateCompletionResponse, finish_reason nullable"

_SUBSCHEMA = ("items", "additionalProperties", "not")  # keywords holding one subschema
_COMPOSITIONS = ("allOf", "anyOf", "oneOf")  # keywords holding a list of subschemas


def openapi_to_json_schema(schema: Any) -> Any:
    """An OpenAPI 3.0 schema object as JSON Schema: ``nullable: true`` lets null through,
    at any depth. Only subschema positions are walked, so a property named ``nullable``
    or a dict inside ``enum``/``default`` is never taken for the keyword."""
    if not isinstance(schema, dict):
        return schema  # additionalProperties: true/false
    out = {key: value for key, value in schema.items() if key != "nullable"}
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = openapi_to_json_schema(out[key])
    for key in _COMPOSITIONS:
        if key in out:
            out[key] = [openapi_to_json_schema(s) for s in out[key]]
    if "properties" in out:
        out["properties"] = {name: openapi_to_json_schema(s) for name, s in out["properties"].items()}
    return _allow_null(out) if schema.get("nullable") is True else out


def _allow_null(schema: dict) -> dict:
    """``type`` gains "null" and ``enum`` gains None. A schema whose subschemas would
    still refuse null (allOf/anyOf/oneOf/not), or that has neither keyword, is wrapped in
    ``anyOf`` with ``{"type": "null"}`` instead."""
    if any(key in schema for key in (*_COMPOSITIONS, "not")) or ("type" not in schema and "enum" not in schema):
        return {"anyOf": [schema, {"type": "null"}]}
    schema = dict(schema)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        schema["type"] = types if "null" in types else [*types, "null"]
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    return schema


@functools.cache
def published_schemas() -> dict[str, dict]:
    """The file as published (OpenAPI 3.0), plus the completion chunk exception."""
    schemas = json.loads(SCHEMAS_PATH.read_text())
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
    schemas[COMPLETION_CHUNK] = chunk
    return schemas


@functools.cache
def validator(name: str) -> Draft202012Validator:
    """No format checker: ``format`` stays an annotation, as 2020-12 has it by default
    (OpenAI's "unixtime" is no JSON Schema format; "uri" and "date" sit on fields
    memserve never sends)."""
    schema = openapi_to_json_schema(published_schemas()[name])
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_errors(instance: Any, name: str) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in validator(name).iter_errors(instance)]


def assert_valid(instance: Any, name: str) -> None:
    errors = schema_errors(instance, name)
    assert not errors, f"not a valid {name}:\n" + "\n".join(errors) + f"\n{instance}"


def request(server: ServerHandle, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    """Status, content type and raw body (urllib: no client library reshapes them)."""
    req = urllib.request.Request(server.base_url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get_content_type(), resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers.get_content_type(), e.read()


def generate(server: ServerHandle, path: str, fields: dict) -> tuple[int, str, bytes]:
    body = {"model": server.model, "max_tokens": 12, "temperature": 0, **fields}
    return request(server, "POST", path, orjson.dumps(body))


def chunk_schema(response_schema: str, chunk: dict) -> str:
    if response_schema == "CreateChatCompletionResponse":
        return "CreateChatCompletionStreamResponse"
    streaming = any(choice["finish_reason"] is None for choice in chunk["choices"])
    return COMPLETION_CHUNK if streaming else response_schema


def sse_chunks(raw: bytes) -> list[dict]:
    """The JSON events of an SSE body that ends with ``data: [DONE]``."""
    blocks = raw.decode().split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""], blocks[-3:]
    assert all(block.startswith("data: ") for block in blocks[:-2]), blocks
    return [orjson.loads(block.removeprefix("data: ")) for block in blocks[:-2]]
