"""The dashboard's ASGI app, called in memory (no sockets): the page, the JSON, the refusals,
a failing handler, the lifespan protocol. Its server on a real socket:
``tests/integration/test_dashboard_server.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from swarmtrain.commands.local import LocalOptions, dashboard_flags
from swarmtrain.dashboard.app import dashboard_app


async def _call(app: Any, method: str, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through the ASGI interface: ``(status, headers, body)``."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    start, body = sent
    return start["status"], dict(start["headers"]), body["body"]


async def test_the_app_serves_the_page_the_json_and_refuses_the_rest() -> None:
    app = dashboard_app(lambda: {"run_id": "run-x", "series": []})
    status, headers, body = await _call(app, "GET", "/")
    assert status == 200 and headers[b"content-type"].startswith(b"text/html")
    # Self-contained: the browser is told to load nothing but the page and its own JSON.
    assert b"default-src 'none'" in headers[b"content-security-policy"]
    assert b"connect-src 'self'" in headers[b"content-security-policy"]
    assert b'id="loss-curve"' in body and b"/api/run.json" in body
    assert b'new EventSource("/api/events")' in body  # live, with polling as the fallback
    assert b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
    status, headers, body = await _call(app, "GET", "/api/run.json")
    assert status == 200 and headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {"run_id": "run-x", "series": []}
    assert int(headers[b"content-length"]) == len(body)
    status, _, body = await _call(app, "HEAD", "/api/run.json")
    assert (status, body) == (200, b"")
    assert (await _call(app, "GET", "/etc/passwd"))[0] == 404
    assert (await _call(app, "GET", "/api/events"))[0] == 404  # an app given no EventStreams
    assert (await _call(app, "POST", "/api/run.json"))[0] == 405


async def test_a_failing_handler_answers_500_in_one_line_and_the_app_goes_on() -> None:
    calls = []

    def snapshot() -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("history broke\nsecond line")
        return {"ok": True}

    app = dashboard_app(snapshot)
    status, _, body = await _call(app, "GET", "/api/run.json")
    assert (status, body) == (500, b"dashboard error: RuntimeError: history broke")
    status, _, body = await _call(app, "GET", "/api/run.json")
    assert (status, json.loads(body)) == (200, {"ok": True})
    # A NaN would be invalid JSON for the page's parser: refused as a 500, never sent.
    nan = dashboard_app(lambda: {"loss": float("nan")})
    assert (await _call(nan, "GET", "/api/run.json"))[0] == 500


async def test_the_app_answers_the_lifespan_protocol() -> None:
    to_app = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return to_app.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await dashboard_app(dict)({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_local_passes_its_dashboard_port_to_the_coordinator_and_checks_it() -> None:
    assert dashboard_flags(None) == ()
    assert dashboard_flags(0) == ("--dashboard-port", "0")
    with pytest.raises(ValueError, match=r"^--dashboard-port must be 0-65535, got 70000$"):
        LocalOptions(dashboard_port=70000)
