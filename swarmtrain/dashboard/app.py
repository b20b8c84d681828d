"""The dashboard's ASGI application: one function over ``scope["path"]``, served by hypercorn.

``GET /`` is the page (``page.html``: inline script and SVG, nothing fetched from elsewhere; its
Content-Security-Policy tells the browser so); ``GET /api/run.json`` is
``RunHistory.to_json`` of the moment; ``GET /api/events`` streams the same document as
server-sent events when the app is given an ``EventStreams`` (``events``); anything else is 404,
a method other than GET or HEAD 405.
A handler that raises answers 500 with a one-line reason and is logged: a broken page must never
reach the coordinator it runs in. The lifespan protocol is answered so hypercorn starts cleanly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmtrain.dashboard.events import EventStreams

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

EVENTS_PATH = "/api/events"
PAGE = resources.files(__package__).joinpath("page.html").read_bytes()
# The page loads nothing but itself and its own JSON; a browser enforces that.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        b"connect-src 'self'; img-src data:",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
]


def dashboard_app(
    snapshot: Callable[[], dict[str, Any]], events: EventStreams | None = None
) -> App:
    """The ASGI app; ``snapshot()`` returns the JSON document (called per request, in the
    server's loop); ``events`` serves ``/api/events`` (without it that path is 404)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # a websocket: not served; hypercorn closes it
        if events is not None and scope["method"] == "GET" and scope["path"] == EVENTS_PATH:
            await events.serve(receive, send)
            return
        try:
            status, content_type, body = _route(scope["method"], scope["path"], snapshot)
        except Exception as exc:
            log.warning("dashboard: %s %s failed: %r", scope["method"], scope["path"], exc)
            status, content_type = 500, b"text/plain; charset=utf-8"
            body = f"dashboard error: {type(exc).__name__}: {exc}".splitlines()[0].encode()
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *SECURITY_HEADERS,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    return app


def _route(
    method: str, path: str, snapshot: Callable[[], dict[str, Any]]
) -> tuple[int, bytes, bytes]:
    """``(status, content type, body)`` for one request."""
    text = b"text/plain; charset=utf-8"
    if method not in ("GET", "HEAD"):
        return 405, text, b"only GET and HEAD are served"
    if path == "/":
        return 200, b"text/html; charset=utf-8", PAGE
    if path == "/api/run.json":
        document = json.dumps(snapshot(), allow_nan=False, separators=(",", ":"))
        return 200, b"application/json", document.encode()
    return 404, text, b"not found: the dashboard serves /, /api/run.json and /api/events"


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
