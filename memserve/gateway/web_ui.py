"""The web pages the gateway serves (``--no-web-ui`` turns them off): a chat page at
``/`` and a live cache dashboard at ``/dashboard``, with their scripts and styles under
``/web/``. The files live in ``web/`` inside the package and load nothing from outside
it; a Content-Security-Policy allows only this origin's scripts, styles and requests."""

from __future__ import annotations

import re
from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).with_name("web")
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_NAME = re.compile(r"^[a-z0-9_-]+\.(html|js|css|txt)$")
_TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css", "txt": "text/plain"}


def _file_response(name: str) -> web.Response:
    match = _NAME.match(name)
    path = WEB_DIR / name
    if match is None or not path.is_file():
        raise web.HTTPNotFound()
    return web.Response(body=path.read_bytes(), content_type=_TYPES[match.group(1)], charset="utf-8",
                        headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
                                 "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})


async def _index(request: web.Request) -> web.Response:
    return _file_response("index.html")


async def _dashboard(request: web.Request) -> web.Response:
    return _file_response("dashboard.html")


async def _asset(request: web.Request) -> web.Response:
    return _file_response(request.match_info["name"])


def add_web_routes(app: web.Application) -> None:
    app.add_routes([web.get("/", _index), web.get("/dashboard", _dashboard), web.get("/web/{name}", _asset)])
