"""The dashboard's server in process, on a real loopback socket (cheap: no child process, well
under a second): its flags' one-line errors, hypercorn serving the page and the JSON on trio,
failed and hung reads recorded instead of raised, the socket closed on cancellation, and the
``/api/events`` stream read by httpx: events per read, keep-alives, the 503 cap, the end on a
stop."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import httpx
import pytest
import trio

from p2p import P2PError
from swarmtrain.dashboard.events import StreamLimits
from swarmtrain.dashboard.history import Reading, RunHistory, RunInfo
from swarmtrain.dashboard.options import DashboardOptions
from swarmtrain.dashboard.server import Dashboard

INFO = RunInfo("run-x", "ab" * 32, "12D3KooWcoordinator", rounds=4)


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


def _read_events(url: str, count: int) -> tuple[str, list[dict[str, Any]], list[str]]:
    """Open ``/api/events`` with httpx over the socket; ``count`` events' JSON and the
    comments seen before them (blocking: run in a thread)."""
    events: list[dict[str, Any]] = []
    comments: list[str] = []
    with httpx.stream("GET", url, timeout=10) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == count:
                    return response.headers["content-type"], events, comments
            elif line.startswith(":"):
                comments.append(line)
    raise AssertionError(f"the stream ended after {len(events)} events")


async def test_events_stream_the_json_on_each_read_and_a_full_server_refuses_with_503() -> None:
    at = [100.0]

    async def read() -> Reading:
        at[0] += 1
        return Reading(at[0])

    listener = DashboardOptions(0).listen()
    limits = StreamLimits(max_streams=1, every_s=30, keepalive_s=0.05)
    # Reads far apart (the test triggers them), so keep-alive comments come between events.
    dashboard = Dashboard(RunHistory(INFO), read, listener, interval_s=0.3, stream_limits=limits)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(dashboard.run) + "api/events"
            kind, events, comments = await trio.to_thread.run_sync(_read_events, url, 3)
            assert kind.startswith("text/event-stream")
            assert [e["run_id"] for e in events] == ["run-x"] * 3
            # Each event after the first came from another read: the document moved on.
            stamps = [e["updated_at"] for e in events]
            assert stamps == sorted(stamps) and len(set(stamps)) == 3, stamps
            assert ": keep-alive" in comments
            # The client left: its stream is closed and its slot free again.
            while dashboard.streams.open:
                await trio.sleep(0.01)
            async with trio.open_nursery() as clients:
                # One client holds the only slot; a second one is refused at once.
                clients.start_soon(trio.to_thread.run_sync, _read_events, url, 2)
                while dashboard.streams.open == 0:
                    await trio.sleep(0.01)
                refused = await trio.to_thread.run_sync(lambda: httpx.get(url, timeout=5))
                assert refused.status_code == 503 and "poll /api/run.json" in refused.text
                assert dashboard.streams.refused == 1
            nursery.cancel_scope.cancel()
    assert dashboard.streams.open == 0


async def test_an_open_stream_ends_when_the_server_stops() -> None:
    async def read() -> Reading:
        return Reading(1.0)

    dashboard = Dashboard(RunHistory(INFO), read, DashboardOptions(0).listen(), interval_s=60)
    ended: list[str] = []

    def listen(url: str) -> None:
        with httpx.stream("GET", url, timeout=10) as response:
            for _ in response.iter_lines():
                pass  # until the server closes the stream
        ended.append("closed")

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(dashboard.run) + "api/events"
            async with trio.open_nursery() as client:
                client.start_soon(trio.to_thread.run_sync, listen, url)
                while dashboard.streams.open == 0:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()  # the coordinator stops: the stream must end
    assert ended == ["closed"]
