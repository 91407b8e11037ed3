"""Hostile requests for the gateway, shared by ``tests/e2e/test_hostile_input.py``
(hypothesis, a bounded run per test) and ``scripts/fuzz`` (tens of thousands against a
running server), so both exercise the same inputs: test-support code, kept out of the
package; ``scripts/fuzz`` puts ``tests/`` on ``sys.path`` to import it.

- ``hostile_requests()``: a hypothesis strategy of HTTP requests: random JSON values,
  valid-looking requests with fields of wrong types, out-of-range and huge numbers,
  NaN/Infinity and unpaired surrogates as raw bytes, unicode junk, deep nesting, random
  bytes, wrong or odd content types. Every request that could be valid asks for at most
  ``MAX_TOKENS`` tokens, so generation stays short.
- ``RAW_HTTP_CASES`` and ``raw_http()``: malformed HTTP on a raw socket (garbage request
  lines, bad Content-Length, oversized headers, bad gzip, broken chunking).
- ``check_response()``: what is acceptable: a 4xx carrying OpenAI's error object, or a
  200 that is a valid completion (JSON or SSE); never a 5xx."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 2  # what a valid-looking request asks for at most
MODEL = "SmolLM2-135M-Instruct"

# Deep nesting is spliced into the serialised body: json.dumps itself would recurse.
_DEEP = "\u0000deep:"


@dataclass(frozen=True)
class HostileRequest:
    method: str
    path: str
    body: bytes
    content_type: str | None  # None: no Content-Type header at all

    def describe(self) -> str:
        return f"{self.method} {self.path} [{self.content_type}] {self.body[:300]!r}"


def _serialise(obj: Any, ascii_only: bool) -> bytes:
    """JSON as a careless client might write it: Python's json emits NaN, Infinity and
    integers of any size; unpaired surrogates go out as invalid UTF-8 bytes."""
    text = json.dumps(obj, ensure_ascii=ascii_only)
    raw = text.encode("utf-8", "surrogatepass")
    while (start := raw.find(b'"' + _DEEP.encode())) != -1:
        end = raw.index(b'"', start + 1)
        depth = int(raw[start + 1 + len(_DEEP.encode()):end])
        raw = raw[:start] + b"[" * depth + b"]" * depth + raw[end + 1:]
    return raw


# ----------------------------------------------------------------------------- values

unicode_junk = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from([
    "\u0000", "\ud800", "\udfff", "\ufeff", "\u202e", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\U0001f600" * 5,
    "a\u0301" * 10, "\r\n\r\n", "{{ 7*7 }}", "{% for x in range(10**9) %}{% endfor %}", "%s%n", "\\", "",
])
huge_ints = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 10**400]).flatmap(
    lambda n: st.sampled_from([n, -n]))
odd_floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0, 1e-300])
bad_numbers = huge_ints | odd_floats | st.integers() | st.floats()
deep_nesting = st.integers(min_value=900, max_value=5000).map(lambda depth: f"{_DEEP}{depth}")
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | unicode_junk
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(unicode_junk, inner, max_size=4), max_leaves=12)
junk = json_values | bad_numbers | deep_nesting

# A token count that is never both valid and large: valid ones are small, the rest are refused.
token_counts = st.integers(1, MAX_TOKENS) | st.integers(max_value=0) | st.integers(min_value=10**5) | huge_ints


def _field_values(name: str) -> st.SearchStrategy:
    """Junk for one field, except that a token budget is never null or a valid large
    number (that would generate up to the context window)."""
    if name == "max_tokens":
        return token_counts | junk.filter(lambda v: v is not None and not (type(v) is int and MAX_TOKENS < v < 10**5))
    return junk | token_counts | st.none()


COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
                 "stream_options", "ignore_eos", "n", "logprobs", "session_id", "priority", "slo_ttft_ms",
                 "slo_tbt_ms", "response_format", "tool_choice", "logit_bias", "presence_penalty", "user"]


def _prompts() -> st.SearchStrategy:
    ids = st.integers(min_value=-5, max_value=50_000)
    return (unicode_junk.filter(bool) | st.lists(ids, max_size=20) | st.lists(st.lists(ids, max_size=3), max_size=3)
            | st.lists(unicode_junk, max_size=3) | junk)


def _messages() -> st.SearchStrategy:
    roles = st.sampled_from(["user", "assistant", "system", "tool", "developer"]) | unicode_junk
    text_part = st.fixed_dictionaries({"type": st.just("text"), "text": unicode_junk})
    content = unicode_junk | st.none() | st.lists(text_part, max_size=3) | junk
    tool_calls = st.lists(st.fixed_dictionaries({"id": unicode_junk, "type": st.just("function"), "function":
                                                 st.fixed_dictionaries({"name": unicode_junk, "arguments": junk})}),
                          max_size=2) | junk
    message = st.fixed_dictionaries({"role": roles}, optional={"content": content, "name": junk,
                                                                "tool_calls": tool_calls, "tool_call_id": junk,
                                                                "extra": junk})
    return st.lists(message, min_size=1, max_size=4) | junk


@st.composite
def valid_looking_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """A request that would be valid, with up to three fields replaced by junk."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, MAX_TOKENS)),
                            "temperature": draw(st.sampled_from([0, 0.7, 1.0]))}
    if path == COMPLETIONS:
        body["prompt"] = draw(st.sampled_from(["Hello", "1, 2, 3,", "The capital of France is"]))
    else:
        body["messages"] = [{"role": "user", "content": "Say hi."}]
        if draw(st.booleans()):  # an explicit null must not override max_tokens
            body["max_completion_tokens"] = None
    body["stream"] = draw(st.booleans())
    extra_fields = COMMON_FIELDS + (["prompt", "suffix", "echo", "best_of"] if path == COMPLETIONS
                                    else ["messages", "max_completion_tokens", "tools", "parallel_tool_calls"])
    for name in draw(st.lists(st.sampled_from(extra_fields), max_size=3, unique=True)):
        if name == "prompt":
            body[name] = draw(_prompts())
        elif name == "messages":
            body[name] = draw(_messages())
        elif name == "max_completion_tokens":
            body[name] = draw(token_counts | st.none())
        else:
            body[name] = draw(_field_values(name))
    return path, body


CONTENT_TYPES = ["application/json", None, "application/json; charset=utf-8", "application/x-www-form-urlencoded",
                 "application/octet-stream", "text/plain", "text/plain;charset=UTF-8",
                 "multipart/form-data; boundary=x", "application/xml", "application/vnd.api+json",
                 "application/json; charset=latin-1", "*/*", "", "application/json; boundary=\"", "APPLICATION/JSON",
                 ";;;", "a" * 300]


@st.composite
def hostile_requests(draw: st.DrawFn) -> HostileRequest:
    kind = draw(st.sampled_from(["valid-looking", "valid-looking", "valid-looking", "json-value", "bytes", "deep",
                                 "route"]))
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    if kind == "valid-looking":
        path, obj = draw(valid_looking_bodies())
        body = _serialise(obj, draw(st.booleans()))
    elif kind == "json-value":
        body = _serialise(draw(json_values | st.dictionaries(st.sampled_from(["prompt", "messages", "model"]), junk)),
                          draw(st.booleans()))
    elif kind == "bytes":
        body = draw(st.binary(max_size=300) | st.sampled_from([b"", b"{", b"null", b"[]", b'{"prompt": NaN}',
                                                               b'{"prompt": "a", "max_tokens": Infinity}',
                                                               b'{"prompt": "\\ud800"}', b"\xff\xfe{}",
                                                               b'{"prompt": "a"}' * 2, b'{"prompt": "a",}']))
    elif kind == "deep":
        depth = draw(st.sampled_from([1000, 1024, 1100, 200_000]))
        field = draw(st.sampled_from([b"", b'"prompt": ', b'"messages": ', b'"stop": ']))
        nested = b"[" * depth + b"]" * depth
        body = b"{" + field + nested + b"}" if field else nested
    else:  # routes that take no body (405), or do not exist (404)
        return HostileRequest(draw(st.sampled_from(["POST", "PUT", "DELETE", "PATCH"])),
                              draw(st.sampled_from(["/v1/models", "/health", "/metrics", "/v1/nothing", "/",
                                                    "/v1/completions/x", "/v1//completions", "/%2e%2e/etc"])),
                              draw(st.binary(max_size=50)), "application/json")
    content_type = draw(st.sampled_from(CONTENT_TYPES[:2]) | st.sampled_from(CONTENT_TYPES))
    return HostileRequest("POST", path, body, content_type)


def send(host: str, port: int, request: HostileRequest, timeout_s: float = 120.0) -> tuple[int, str, bytes]:
    """Status, content type and body of one request (http.client: nothing reshapes them)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        headers = {"Content-Type": request.content_type} if request.content_type is not None else {}
        conn.request(request.method, request.path, body=request.body, headers=headers)
        response = conn.getresponse()
        return response.status, response.headers.get_content_type(), response.read()
    finally:
        conn.close()


# ----------------------------------------------------------------------------- raw HTTP

def _post(head: bytes, body: bytes = b"") -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head + b"\r\n" + body


_VALID = b'{"prompt": "hi", "max_tokens": 1}'

# (name, bytes, expected status): each is answered by aiohttp's parser or the app.
RAW_HTTP_CASES: list[tuple[str, bytes, int]] = [
    ("tls-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n", 400),
    ("garbage-line", b"\x00\x01\x02 garbage \xff\r\n\r\n", 400),
    ("bad-version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    ("bad-method", b"G(T /health HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("space-in-header-name", b"GET /health HTTP/1.1\r\nHo st: x\r\n\r\n", 400),
    ("header-without-colon", b"GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400),
    ("nul-in-header", b"GET /health HTTP/1.1\r\nHost: x\x00y\r\n\r\n", 400),
    ("content-length-abc", _post(b"Content-Length: abc\r\n", _VALID), 400),
    ("content-length-negative", _post(b"Content-Length: -5\r\n", _VALID), 400),
    ("content-length-huge", _post(b"Content-Length: 99999999999999999999999\r\n", _VALID), 400),
    ("content-length-twice", _post(b"Content-Length: 5\r\nContent-Length: 7\r\n", _VALID), 400),
    ("content-length-and-chunked", _post(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"), 400),
    ("bad-chunk-size", _post(b"Transfer-Encoding: chunked\r\n", b"zz\r\nabc\r\n0\r\n\r\n"), 400),
    ("oversized-header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    ("oversized-url", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    ("too-many-headers", b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
     400),
    ("bad-gzip", _post(b"Content-Encoding: gzip\r\nContent-Length: 10\r\nConnection: close\r\n", b"0123456789"), 400),
    ("truncated-gzip", _post(b"Content-Encoding: gzip\r\nContent-Length: 12\r\nConnection: close\r\n",
                             gzip.compress(_VALID)[:12]), 400),
    ("bad-deflate", _post(b"Content-Encoding: deflate\r\nContent-Length: 10\r\nConnection: close\r\n", b"0123456789"),
     400),
]


@dataclass
class RawAnswer:
    status: int | None  # None: the connection closed without an answer
    content_type: str
    body: bytes
    error: str | None = None  # a connection error instead of an answer


def raw_http(host: str, port: int, data: bytes, timeout_s: float = 15.0) -> RawAnswer:
    """Send bytes as they are and read one HTTP answer (aiohttp closes the connection
    after a parse error, so the body is read to its end)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server may answer and close before reading everything
            pass
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            return RawAnswer(response.status, response.headers.get_content_type(), response.read())
        except (http.client.RemoteDisconnected, http.client.IncompleteRead):
            return RawAnswer(None, "", b"")
        except OSError as e:
            return RawAnswer(None, "", b"", f"{type(e).__name__}: {e}")


# ----------------------------------------------------------------------------- verdict

def _error_object_problem(body: bytes) -> str | None:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error object: {body[:200]!r}"
    if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
            and all(error[k] is None or isinstance(error[k], str) for k in ("param", "code"))):
        return f"malformed error object: {error!r}"[:300]
    return None


def _completion_problem(obj: Any) -> str | None:
    if not (isinstance(obj, dict) and obj.get("object") in ("text_completion", "chat.completion",
                                                            "chat.completion.chunk")
            and isinstance(obj.get("choices"), list)):
        return f"not a completion: {obj!r}"[:300]
    return None


def check_response(status: int, content_type: str, body: bytes) -> str | None:
    """None when the answer is acceptable, else what is wrong with it."""
    if 400 <= status < 500:
        if content_type != "application/json":
            return f"{status} with content type {content_type}: {body[:200]!r}"
        return _error_object_problem(body)
    if status != 200:
        return f"status {status}: {body[:300]!r}"
    if content_type == "application/json":
        try:
            return _completion_problem(json.loads(body))
        except ValueError:
            return f"200 with invalid JSON: {body[:200]!r}"
    if content_type == "text/event-stream":
        events = [block.removeprefix(b"data: ") for block in body.split(b"\n\n") if block]
        if not events or events[-1] != b"[DONE]":
            return f"stream does not end with [DONE]: {body[-200:]!r}"
        for event in events[:-1]:
            problem = _completion_problem(json.loads(event))
            if problem is not None:
                return problem
        return None
    return f"200 with content type {content_type}"
