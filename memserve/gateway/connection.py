"""The gateway's HTTP connections: aiohttp's protocol layer, hardened against hostile
and slow clients.

What aiohttp cannot parse (a garbage request line, a bad Content-Length, oversized
headers) never reaches the app's middleware: ``RequestHandler.handle_error`` answers a
plain-text 400 and logs a traceback at ERROR, so a scanner could flood the log. Here
those answers are OpenAI error objects (431 for oversized headers) and cost one short
INFO line; aiohttp's own "Unhandled exception" reports of client faults (a body that
failed to decode, a connection reset) drop to one DEBUG line. Real server faults still
log their traceback at ERROR.

The runner also bounds what slow or numerous clients can hold:

- a connection must deliver a complete request head within ``header_timeout_s`` of
  being opened or of its previous response, else it is closed: this is aiohttp's
  keep-alive timer, which also runs before the first request, and a trickle of bytes
  does not reset it;
- an unread request body is drained for at most ``body_timeout_s`` after the response
  (the app bounds the reading of the bodies it reads by the same time);
- past ``max_connections`` open connections, a new one is answered 503 and closed at once.

aiohttp builds its ``Server`` inside ``Application._make_handler`` with no hook for the
protocol class, so ``GatewayRunner`` rebuilds it as a ``_GatewayServer`` (same handler,
request factory and settings) whose protocol factory is the hardened one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from memserve.gateway.errors import APIError, error_body

log = logging.getLogger("memserve.gateway")

_CLIENT_FAULTS = (HttpProcessingError, web.RequestPayloadError, ConnectionError)


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


class _GatewayRequestHandler(web.RequestHandler):
    """aiohttp's protocol, with OpenAI error objects for requests it cannot parse."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.logger.exception("Error handling request from %s", request.remote, exc_info=exc)
            message = "internal server error"
        else:
            message = _one_line(message or str(exc) or "malformed request")
            log.info("malformed HTTP request from %s: %s", request.remote, message)
        if isinstance(exc, LineTooLong):
            status = 431
        if request.writer.output_size > 0:  # as aiohttp: a response already started cannot be replaced
            raise ConnectionError("the response has already started; cannot send an error")
        response = APIError(status, message).response()
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, _CLIENT_FAULTS):
            log.debug("connection closed after a client fault: %s", _one_line(f"{type(exc).__name__}: {exc}"))
        else:
            super().log_exception(*args, **kwargs)


class _Overloaded(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed before anything is read."""

    def __init__(self, response: bytes) -> None:
        self._response = response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # uvloop's transports do not subclass asyncio's
        writer.write(self._response)
        writer.close()


def _overloaded_response(max_connections: int) -> bytes:
    body = orjson.dumps(error_body(503, f"the server has {max_connections} open connections, its limit; "
                                        "retry later"))
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _GatewayServer(web.Server):
    """The app's ``web.Server``, creating hardened protocols, up to ``max_connections``."""

    def __init__(self, server: web.Server, max_connections: int) -> None:
        super().__init__(server.request_handler, request_factory=server.request_factory,
                         handler_cancellation=server.handler_cancellation, loop=server._loop, **server._kwargs)
        self._max_connections = max_connections
        self._overloaded = _overloaded_response(max_connections)

    # aiohttp types this factory as returning its RequestHandler; the event loop needs only a
    # protocol, and a refused connection gets a bare one (_Overloaded).
    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]  # narrower in aiohttp, see above
        if len(self.connections) >= self._max_connections:
            return _Overloaded(self._overloaded)
        return _GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` with the hardened connection layer and its limits."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, body_timeout_s: float, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=header_timeout_s, lingering_time=body_timeout_s, **kwargs)
        self._max_connections = max_connections

    async def _make_server(self) -> web.Server:
        return _GatewayServer(await super()._make_server(), self._max_connections)
