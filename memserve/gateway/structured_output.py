"""``response_format`` (and forced tool calls) as a grammar for the worker's sampler.

A JSON Schema becomes an llguidance grammar (``workers/model/grammar.py`` matches it
token by token). It is validated here, so that a schema the grammar engine cannot
honour gets a 400 naming the field rather than a failed request later: llguidance
refuses keywords it does not implement (``uniqueItems``, ...) instead of ignoring them,
so every output that completes validates against the schema, ``strict`` or not.

Whitespace is fixed (``{"a": 1, "b": [2, 3]}``, as ``json.dumps`` writes it): a small
model allowed free whitespace can fill its whole budget with newlines. Schemas are
serialised once and their grammars kept in an LRU cache, so a client that sends the
same schema with every request pays the validation once."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import llguidance
import orjson

from memserve.gateway.errors import bad_request

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stubs, not exported

# Distinct schemas whose validated grammar the gateway keeps.
SCHEMA_CACHE_SIZE = 256
# llguidance's JSON options: the separators of json.dumps, no other whitespace.
_JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict = {"type": "object"}


@functools.lru_cache(maxsize=SCHEMA_CACHE_SIZE)
def _grammar_or_error(schema_text: str) -> tuple[str, str]:
    """(grammar, "") or ("", why the schema is refused)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=_JSON_LAYOUT)
    except ValueError as e:
        return "", str(e)
    return grammar, llguidance.LLMatcher.validate_grammar(grammar)


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of the JSON texts that ``schema`` accepts; a 400 naming ``param``
    when it is no schema or uses what the grammar engine cannot enforce."""
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{param}' must be a JSON Schema object", param)
    try:
        text = orjson.dumps(schema).decode()
    except orjson.JSONEncodeError as e:  # nested deeper than orjson writes
        raise bad_request(f"'{param}' is not a usable JSON Schema: {e}", param) from None
    grammar, error = _grammar_or_error(text)
    if error:
        raise bad_request(f"'{param}' is not a usable JSON Schema: {error}", param)
    return grammar


def _json_schema_format(value: Any) -> str:
    """OpenAI's ``{"name", "description"?, "schema"?, "strict"?}``; no schema means any
    JSON value, as OpenAI has it."""
    param = "response_format.json_schema"
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object", param)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{param}.name' must be a non-empty string", f"{param}.name")
    for key, kind, kind_name in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if value.get(key) is not None and not isinstance(value[key], kind):
            raise bad_request(f"'{param}.{key}' must be {kind_name}", f"{param}.{key}")
    return json_schema_grammar(value.get("schema", {}), f"{param}.schema")


def response_format_grammar(body: dict) -> str | None:
    """The grammar ``response_format`` asks for: None for text, any JSON object for
    ``json_object``, the given schema for ``json_schema``."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT, "response_format")
    if kind == "json_schema":
        return _json_schema_format(value.get("json_schema"))
    raise bad_request("'response_format' must be an object whose 'type' is 'text', 'json_object' or 'json_schema'",
                      "response_format")
