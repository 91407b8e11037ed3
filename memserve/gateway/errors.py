"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` names the HTTP status the way vLLM does ("BadRequestError",
"NotFoundError", ...), which OpenAI clients surface as the exception text."""

from __future__ import annotations

from http import HTTPStatus

import orjson
from aiohttp import web


def error_type(status: int) -> str:
    name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return name if name.endswith("Error") else name + "Error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class APIError(Exception):
    """Raised anywhere in a request handler; the error middleware turns it into a response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.body()), content_type="application/json",
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
