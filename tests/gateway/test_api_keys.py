"""API keys (gateway/auth.py): the gateway's real HTTP app over a fake engine for every
route, then one real `memserve up --api-key ...` for the command line, the environment
variable, the key-id counter and the server log (which must never hold a key)."""

from __future__ import annotations

import hmac
import json
import os
import re
import urllib.error
import urllib.request
from unittest import mock

import pytest
from helpers.fake_engine import MESSAGES, MODEL, FakeEngine, async_test, serve
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server
from memserve.gateway import auth as auth_module
from memserve.gateway.auth import (
    AuthConfig,
    KeyChecker,
    auth_config,
    tenant_salt,
    bearer_token,
    key_id,
)

KEY_1 = "sk-first-0123456789abcdef"
KEY_2 = "sk-second-fedcba9876543210"
METRICS_KEY = "sk-metrics-secret-42"

# Every protected route: (method, path, body).
PROTECTED = [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("GET", "/v1/stats", None),
]


async def call(client, method: str, path: str, body: dict | None, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with client.request(method, path, json=body, headers=headers) as resp:
        text = await resp.text()
        return resp.status, resp.headers, text


def assert_unauthorized(status: int, headers, text: str) -> None:
    assert status == 401, text
    assert headers["WWW-Authenticate"] == "Bearer"
    error = json.loads(text)["error"]
    assert error["code"] == "invalid_api_key"
    assert error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
@async_test
async def test_protected_routes_need_a_configured_key(tokenizer, method, path, body):
    async with serve(FakeEngine(tokenizer), tokenizer, auth=AuthConfig((KEY_1, KEY_2))) as client:
        assert_unauthorized(*await call(client, method, path, body, None))
        assert_unauthorized(*await call(client, method, path, body, "sk-wrong"))
        assert_unauthorized(*await call(client, method, path, body, KEY_1 + "x"))
        for key in (KEY_1, KEY_2):  # the second of two configured keys works too
            status, _, text = await call(client, method, path, body, key)
            assert status == 200, text


@async_test
async def test_malformed_authorization_headers(tokenizer):
    async with serve(FakeEngine(tokenizer), tokenizer, auth=AuthConfig((KEY_1,))) as client:
        for header in (KEY_1, f"Basic {KEY_1}", "Bearer", "Bearer ", f"Token {KEY_1}"):
            async with client.get("/v1/models", headers={"Authorization": header}) as resp:
                assert resp.status == 401, header
        async with client.get("/v1/models", headers={"Authorization": f"bearer  {KEY_1} "}) as resp:
            assert resp.status == 200  # the scheme is case-insensitive


@async_test
async def test_health_and_metrics_stay_open_without_a_metrics_key(tokenizer):
    async with serve(FakeEngine(tokenizer), tokenizer, auth=AuthConfig((KEY_1,))) as client:
        assert (await call(client, "GET", "/health", None, None))[0] == 200
        status, _, text = await call(client, "GET", "/metrics", None, None)
        assert status == 200
        assert "memserve_requests_total" in text


@async_test
async def test_metrics_api_key_protects_metrics_only(tokenizer):
    config = AuthConfig((KEY_1,), metrics_api_key=METRICS_KEY)
    async with serve(FakeEngine(tokenizer), tokenizer, auth=config) as client:
        assert (await call(client, "GET", "/health", None, None))[0] == 200  # load balancers probe it
        assert_unauthorized(*await call(client, "GET", "/metrics", None, None))
        assert_unauthorized(*await call(client, "GET", "/metrics", None, KEY_1))  # an API key is not it
        status, _, text = await call(client, "GET", "/metrics", None, METRICS_KEY)
        assert status == 200 and "memserve_requests_total" in text


@async_test
async def test_metrics_key_alone_leaves_the_api_open(tokenizer):
    async with serve(FakeEngine(tokenizer), tokenizer, auth=AuthConfig((), metrics_api_key=METRICS_KEY)) as client:
        assert (await call(client, "GET", "/v1/models", None, None))[0] == 200
        assert (await call(client, "GET", "/metrics", None, None))[0] == 401


@async_test
async def test_without_keys_nothing_changes(tokenizer):
    for config in (None, AuthConfig()):
        async with serve(FakeEngine(tokenizer), tokenizer, auth=config) as client:
            for method, path, body in PROTECTED:
                assert (await call(client, method, path, body, None))[0] == 200, path
            status, _, text = await call(client, "GET", "/metrics", None, None)
            assert status == 200 and "memserve_requests_by_key_total{" not in text


@async_test
async def test_key_ids_are_counted_and_keys_never_shown(tokenizer):
    config = AuthConfig((KEY_1, KEY_2))
    async with serve(FakeEngine(tokenizer), tokenizer, auth=config) as client:
        for key in (KEY_1, KEY_1, KEY_2):
            assert (await call(client, "GET", "/v1/models", None, key))[0] == 200
        await call(client, "GET", "/v1/models", None, "sk-wrong")
        _, _, text = await call(client, "GET", "/metrics", None, None)
    assert f'memserve_requests_by_key_total{{key_id="{key_id(KEY_1)}"}} 2.0' in text
    assert f'memserve_requests_by_key_total{{key_id="{key_id(KEY_2)}"}} 1.0' in text
    assert KEY_1 not in text and KEY_2 not in text and "sk-wrong" not in text


@async_test
async def test_cache_salt_from_key_keeps_keys_apart_whatever_the_body_says(tokenizer):
    engine = FakeEngine(tokenizer)
    config = AuthConfig((KEY_1, KEY_2), cache_salt_from_key=True)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    async with serve(engine, tokenizer, auth=config) as client:
        for request_body, key in ((body, KEY_1), (body, KEY_2), ({**body, "cache_salt": "mine"}, KEY_1),
                                  ({**body, "cache_salt": "mine"}, KEY_2), ({**body, "cache_salt": "mine"}, KEY_1)):
            assert (await call(client, "POST", "/v1/completions", request_body, key))[0] == 200
    salts = [r["params"].cache_salt for r in engine.requests]
    assert all(salts) and KEY_1 not in salts[0]
    assert len(set(salts[:4])) == 4  # two keys, each with and without a body salt: four names
    assert salts[2] == salts[4]  # the same key and the same body salt share
    owners = [r["params"].pin_owner for r in engine.requests]  # each key's pins have a share of their own
    assert owners == [key_id(KEY_1), key_id(KEY_2), key_id(KEY_1), key_id(KEY_2), key_id(KEY_1)]


def test_tenant_salt_combines_and_never_replaces():
    assert tenant_salt(None, None) is None and tenant_salt(None, "b") == "b"
    assert tenant_salt("key:k", None) == "key:k"
    assert tenant_salt("key:k", "b") not in ("key:k", "b")


@async_test
async def test_cache_salt_is_validated_and_passed_to_the_engine(tokenizer):
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2})):
            for bad in ("", "x" * 257, 5, ["a"]):
                status, _, text = await call(client, "POST", path, {**body, "cache_salt": bad}, None)
                assert status == 400, (bad, text)
                assert json.loads(text)["error"]["param"] == "cache_salt"
            assert (await call(client, "POST", path, {**body, "cache_salt": "s" * 256}, None))[0] == 200
            assert (await call(client, "POST", path, body, None))[0] == 200
    assert [r["params"].cache_salt for r in engine.requests] == ["s" * 256, None, "s" * 256, None]


def test_every_configured_key_is_compared_with_compare_digest():
    keys = ["k-one", "k-two", "k-three"]
    checker = KeyChecker(keys)
    for presented, expected in (("k-one", key_id("k-one")), ("k-three", key_id("k-three")), ("nope", None)):
        with mock.patch.object(auth_module.hmac, "compare_digest", wraps=hmac.compare_digest) as spy:
            assert checker.match(presented) == expected
        assert spy.call_count == len(keys)  # no early exit on the first match
        assert [c.args[1] for c in spy.call_args_list] == [k.encode() for k in keys]
        assert all(c.args[0] == presented.encode() for c in spy.call_args_list)


def test_key_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None
    config = auth_config(["a", "b,c"], " d, a ,,e ", "m", True)
    assert config.api_keys == ("a", "b,c", "d", "e")  # a flag's key is taken whole; the variable's split
    assert config.metrics_api_key == "m" and config.cache_salt_from_key
    assert not auth_config(None, None, None, False).enabled
    assert re.fullmatch(r"[0-9a-f]{8}", key_id("a")) and key_id("a") == key_id("a") != key_id("b")


def _get(server, path: str, key: str | None) -> tuple[int, str]:
    request = urllib.request.Request(server.base_url + path,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(server, path: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(server.base_url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_real_server_with_flag_and_environment_keys(tmp_path):
    """`memserve up --api-key K1 --metrics-api-key M` with MEMSERVE_API_KEY=K2: both keys
    work, /health is open, /metrics needs M and counts key ids; no key reaches the log."""
    log_path = tmp_path / "memserve.log"
    with mock.patch.dict(os.environ, {"MEMSERVE_API_KEY": KEY_2}):
        server = start_server(["--num-blocks", "64", "--api-key", KEY_1, "--metrics-api-key", METRICS_KEY,
                               "--max-model-len", "256"], log_path, cwd=REPO)
    try:
        assert _get(server, "/health", None)[0] == 200
        assert _get(server, "/v1/models", None)[0] == 401
        assert _get(server, "/v1/models", "sk-wrong")[0] == 401
        assert _get(server, "/v1/models", KEY_1)[0] == 200
        assert _get(server, "/v1/models", KEY_2)[0] == 200  # from the environment variable
        status, body = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hello", "max_tokens": 2},
                             KEY_2)
        assert status == 200, body
        status, body = _post(server, "/tokenize", {"model": server.model, "prompt": "Hello"}, None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert _get(server, "/metrics", None)[0] == 401
        assert _get(server, "/metrics", KEY_1)[0] == 401
        status, metrics = _get(server, "/metrics", METRICS_KEY)
        assert status == 200
        assert f'memserve_requests_by_key_total{{key_id="{key_id(KEY_1)}"}} 1.0' in metrics
        assert f'memserve_requests_by_key_total{{key_id="{key_id(KEY_2)}"}} 2.0' in metrics
    finally:
        stop_server(server)
    log = log_path.read_text(errors="replace")
    assert f"key_id={key_id(KEY_2)}" in log  # each request is logged with its key's id
    for secret in (KEY_1, KEY_2, METRICS_KEY):
        assert secret not in log
        assert secret not in metrics
