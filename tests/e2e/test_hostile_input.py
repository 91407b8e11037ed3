"""Hostile input against a real `memserve up` (the shared ``memserve_server``): one
request must never take the gateway down.

- Generated with hypothesis (``hostile_requests.py``, shared with ``scripts/fuzz``): junk
  JSON, wrong types, huge numbers, NaN/Infinity, unicode junk, deep nesting, random
  bytes, odd content types. Every answer is a 4xx carrying OpenAI's error object or a
  valid 200, never a 5xx, and a normal request succeeds after each batch. Fixed seeds
  and a bounded number of examples keep the run short and the same on every run.
- The crash-class inputs: a 400 KB body of nested brackets (it segfaulted the gateway
  with an orjson that had no recursion limit) and malformed HTTP (garbage request
  lines, bad Content-Length, oversized headers, bad gzip) get error objects, and leave
  neither an ERROR line nor a traceback in the server's log."""

from __future__ import annotations

import json
import time
import urllib.parse

import pytest
from helpers.hostile_requests import (
    RAW_HTTP_CASES,
    HostileRequest,
    check_response,
    hostile_requests,
    raw_http,
    send,
)
from hypothesis import HealthCheck, given, seed, settings

from memserve.bench.server_process import ServerHandle

BATCHES = 3
EXAMPLES_PER_BATCH = 50


def host_port(server: ServerHandle) -> tuple[str, int]:
    url = urllib.parse.urlsplit(server.base_url)
    return url.hostname, url.port


def assert_normal_request_succeeds(server: ServerHandle) -> None:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}).encode()
    status, _, raw = send(*host_port(server), HostileRequest("POST", "/v1/completions", body, "application/json"))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3, raw


class ServerLog:
    """What the server logs from now on."""

    def __init__(self, server: ServerHandle) -> None:
        self._path = server.log_path
        self._start = self._path.stat().st_size

    def lines(self) -> list[str]:
        time.sleep(0.2)  # let the server finish with its connections
        with open(self._path, encoding="utf-8", errors="replace") as f:
            f.seek(self._start)
            return f.read().splitlines()


@pytest.mark.parametrize("batch", range(BATCHES))
def test_hostile_requests_get_error_objects_or_valid_answers(memserve_server: ServerHandle, batch: int) -> None:
    host, port = host_port(memserve_server)

    @settings(max_examples=EXAMPLES_PER_BATCH, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @seed(batch)
    @given(hostile_requests())
    def answered_properly(request: HostileRequest) -> None:
        status, content_type, body = send(host, port, request)
        problem = check_response(status, content_type, body)
        assert problem is None, f"{request.describe()}: {problem}"

    answered_properly()
    assert_normal_request_succeeds(memserve_server)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", nested(200_000)),
    ("/v1/completions", b'{"prompt": ' + nested(200_000) + b"}"),
    ("/v1/completions", b'{"prompt": ' + nested(1000) + b"}"),
    ("/v1/chat/completions", b'{"messages": ' + nested(200_000) + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + nested(1000) + b"}]}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": null, "tool_calls": ' + nested(1000)
     + b"}]}"),
], ids=["top-level", "prompt", "prompt-1000", "messages", "content-1000", "tool-calls-1000"])
def test_deep_nesting_is_a_400_error_object(memserve_server: ServerHandle, path: str, body: bytes) -> None:
    log = ServerLog(memserve_server)
    status, content_type, answer = send(*host_port(memserve_server),
                                        HostileRequest("POST", path, body, "application/json"))
    assert status == 400 and check_response(status, content_type, answer) is None, answer
    assert_normal_request_succeeds(memserve_server)
    assert not [line for line in log.lines() if "ERROR" in line or "Traceback" in line]


def test_malformed_http_gets_error_objects_and_quiet_log_lines(memserve_server: ServerHandle) -> None:
    log = ServerLog(memserve_server)
    for name, data, expected in RAW_HTTP_CASES:
        answer = raw_http(*host_port(memserve_server), data)
        assert answer.status == expected, (name, answer)
        assert check_response(answer.status, answer.content_type, answer.body) is None, (name, answer)
    assert_normal_request_succeeds(memserve_server)
    lines = log.lines()
    assert not [line for line in lines if "ERROR" in line or "Traceback" in line or "WARNING" in line], lines
    assert len(lines) <= len(RAW_HTTP_CASES) and all(len(line) < 400 for line in lines), lines
