"""API keys: ``Authorization: Bearer <key>`` on the OpenAI API, or Anthropic's ``x-api-key:
<key>`` (``memserve up --api-key``).

With keys configured (``--api-key``, repeatable, or ``MEMSERVE_API_KEY``, comma-separated),
``/v1/*``, ``/tokenize`` and ``/detokenize`` answer a request without a configured key with
401 and OpenAI's error object (``code: invalid_api_key``, ``WWW-Authenticate: Bearer``;
Anthropic's on /v1/messages, ``anthropic_api.py``).
``/health`` stays open (load balancers probe it); ``/metrics`` is open unless
``--metrics-api-key`` names the one key that reads it.

A presented key is compared with every configured key by ``hmac.compare_digest`` (constant
time, and every key is compared, so the time taken does not tell which key matched or how
many there are). A request is known by its key's id (``key_id``: the first 8 hex digits of
the key's SHA-256), never by the key: the id is logged with the request, counted in
``memserve_requests_by_key_total{key_id}`` and, with ``--cache-salt-from-key``, salts the
request's KV cache (``cache_salt``): the key's salt alone, or combined with the body's
``cache_salt`` when it names one (``tenant_salt``), never replaced by it, so that tenants with
different keys never share cached blocks whatever their bodies say.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson
from aiohttp import web

from memserve.gateway.errors import error_body

log = logging.getLogger("memserve.gateway")

ENV_API_KEY = "MEMSERVE_API_KEY"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})  # besides everything under /v1/
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"

# Keys of what the middleware leaves on an authenticated ``web.Request``.
KEY_ID = web.RequestKey("memserve_key_id", str)
KEY_SALT = web.RequestKey("memserve_key_cache_salt", str)  # only with --cache-salt-from-key


def key_id(key: str) -> str:
    """A short stable id of an API key, safe to log and to label metrics with."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


def tenant_salt(key_salt: str | None, body_salt: str | None) -> str | None:
    """The salt a request's blocks are named with: the body's ``cache_salt`` within its key's.

    A key's salt has one fixed length (``"key:"`` and 64 hex digits), so the combination
    cannot be spelled by another key's salt with another body salt."""
    if key_salt is None:
        return body_salt
    return key_salt if body_salt is None else f"{key_salt}/{body_salt}"


def split_keys(text: str | None) -> list[str]:
    """The keys of a comma-separated list (``MEMSERVE_API_KEY``), blanks dropped."""
    return [k.strip() for k in (text or "").split(",") if k.strip()]


@dataclass(frozen=True)
class AuthConfig:
    """What ``create_app`` needs to check keys; empty: the API is open, as without it."""

    api_keys: tuple[str, ...] = ()
    metrics_api_key: str | None = None
    cache_salt_from_key: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.metrics_api_key is not None


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>`` (OpenAI clients), else
    ``x-api-key: <key>`` (Anthropic clients)."""
    return bearer_token(headers.get("Authorization")) or (headers.get("x-api-key") or "").strip() or None


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyChecker:
    """Constant-time matching of a presented key against the configured ones."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [(k.encode("utf-8"), key_id(k)) for k in keys]
        # --cache-salt-from-key: the whole digest, so no two keys' caches can meet
        self.salts = {key_id(k): "key:" + hashlib.sha256(k.encode("utf-8")).hexdigest() for k in keys}

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, presented: str | None) -> str | None:
        """The id of the configured key equal to ``presented``, or None. Every key is
        compared (no early exit on a match)."""
        given = (presented or "").encode("utf-8")
        found: str | None = None
        for key, kid in self._keys:
            if hmac.compare_digest(given, key) and found is None:
                found = kid
        return found if presented else None


def unauthorized(message: str) -> web.Response:
    """401 with OpenAI's error object for a bad key."""
    body = error_body(401, message, None, "invalid_api_key")
    body["error"]["type"] = "invalid_request_error"  # what OpenAI answers for a bad key
    return web.Response(status=401, body=orjson.dumps(body), content_type="application/json",
                        headers={"WWW-Authenticate": "Bearer"})


def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path in PROTECTED_PATHS


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(config: AuthConfig, count_key: Callable[[str], None] | None = None) -> Callable:
    """The aiohttp middleware enforcing ``config``; ``count_key(key_id)`` is called for
    each authenticated API request (the Prometheus counter)."""
    api = KeyChecker(config.api_keys)
    metrics = KeyChecker([config.metrics_api_key] if config.metrics_api_key is not None else [])

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS:
            return await handler(request)
        if path == METRICS_PATH:
            if metrics and metrics.match(bearer_token(request.headers.get("Authorization"))) is None:
                log.warning("%s %s: 401, no valid metrics API key", request.method, path)
                return unauthorized("Invalid or missing metrics API key: send 'Authorization: Bearer <key>'.")
            return await handler(request)
        if not api or not _protected(path):
            return await handler(request)
        kid = api.match(presented_key(request.headers))
        if kid is None:
            log.warning("%s %s: 401, no valid API key", request.method, path)
            return unauthorized("Invalid or missing API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'.")
        request[KEY_ID] = kid
        if config.cache_salt_from_key:
            request[KEY_SALT] = api.salts[kid]
        if count_key is not None:
            count_key(kid)
        try:
            response = await handler(request)
        except BaseException:
            log.info("%s %s key_id=%s: failed", request.method, path, kid)
            raise
        log.info("%s %s key_id=%s: %d", request.method, path, kid, response.status)
        return response

    return middleware


def auth_config(api_keys: Iterable[str] | None, env_value: str | None, metrics_api_key: str | None,
                cache_salt_from_key: bool) -> AuthConfig:
    """The keys of ``--api-key`` (each one key, as given) plus ``MEMSERVE_API_KEY``'s
    (comma-separated), duplicates dropped."""
    keys: list[str] = []
    for key in [*(api_keys or ()), *split_keys(env_value)]:
        if key and key not in keys:
            keys.append(key)
    return AuthConfig(tuple(keys), metrics_api_key or None, cache_salt_from_key)
