"""The dashboard's ASGI app (in memory), its flags and socket, and its trio driver: a real
hypercorn on loopback that serves, survives failing reads and handlers, and stops on
cancellation."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
import trio

from p2p import P2PError
from swarmtrain.dashboard import (
    Dashboard,
    DashboardOptions,
    Reading,
    RunHistory,
    RunInfo,
    dashboard_app,
)

INFO = RunInfo("run-x", "ab" * 32, "12D3KooWcoordinator", rounds=4)


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
    assert b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
    status, headers, body = await _call(app, "GET", "/api/run.json")
    assert status == 200 and headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {"run_id": "run-x", "series": []}
    assert int(headers[b"content-length"]) == len(body)
    status, _, body = await _call(app, "HEAD", "/api/run.json")
    assert (status, body) == (200, b"")
    assert (await _call(app, "GET", "/etc/passwd"))[0] == 404
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


def test_a_busy_port_or_bad_flag_is_one_line_naming_it() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^--dashboard-port {port} on 127\.0\.0\.1: "):
            DashboardOptions(port).listen()
    with pytest.raises(ValueError, match=r"^--dashboard-port must be 0-65535, got 70000$"):
        DashboardOptions(70000)
    with pytest.raises(ValueError, match=r"^--dashboard-host no-such-host\.invalid: "):
        DashboardOptions(0, "no-such-host.invalid").listen()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def test_the_driver_serves_over_hypercorn_records_failed_reads_and_stops() -> None:
    reads: list[int] = []

    async def read() -> Reading:
        reads.append(1)
        if len(reads) == 1:
            raise P2PError("no peer answered")
        return Reading(123.0)

    listener = DashboardOptions(0).listen()
    port = listener.sock.getsockname()[1]
    dashboard = Dashboard(RunHistory(INFO), read, listener, interval_s=0.01)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(dashboard.run)
            assert url == f"http://127.0.0.1:{port}/"
            status, page = await trio.to_thread.run_sync(_get, url)
            assert status == 200 and b"swarmtrain dashboard" in page
            while dashboard.reads == 0:
                await trio.sleep(0.01)
            status, body = await trio.to_thread.run_sync(_get, url + "api/run.json")
            doc = json.loads(body)
            assert (status, doc["run_id"], doc["updated_at"]) == (200, "run-x", 123.0)
            assert (await trio.to_thread.run_sync(_get, url + "nope"))[0] == 404
            nursery.cancel_scope.cancel()
    assert dashboard.history.error is None  # the failed first read was followed by good ones
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # cancellation closed the listening socket


async def test_a_read_that_hangs_or_fails_is_recorded_not_raised(autojump_clock: Any) -> None:
    async def hangs() -> Reading:
        await trio.sleep_forever()
        raise AssertionError  # never reached

    listener = DashboardOptions(0).listen()
    dashboard = Dashboard(RunHistory(INFO), hangs, listener, read_timeout_s=10)
    await dashboard.refresh_once()
    assert dashboard.history.error == "no answer within 10 s"

    async def broken() -> Reading:
        raise KeyError("a bug in a read")

    dashboard.read = broken
    await dashboard.refresh_once()
    assert dashboard.history.error == "'a bug in a read'"
    listener.sock.close()
