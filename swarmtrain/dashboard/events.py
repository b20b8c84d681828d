"""``GET /api/events``: the dashboard's JSON as server-sent events (``text/event-stream``).

A page with ``EventSource`` gets the run's document the moment the coordinator's read changes it,
instead of up to one poll interval later and without a request per poll. Each event's ``data`` is
exactly the document ``/api/run.json`` serves at that moment (one line: compact JSON holds no
newline). An event goes out when the stream opens, after every change of the history
(``RunChanges.notify``: the driver calls it after each read, good or failed), and at least every
``every_s`` even without one, so a page's "read N s ago" stays true when reads hang; between
events, a keep-alive comment every ``keepalive_s`` keeps proxies from closing a quiet stream.

Bounded: at most ``max_streams`` streams at once (each is a task and a socket in the
coordinator's process); one more is answered 503 with a one-line reason, which an
``EventSource`` treats as final, so the page falls back to polling ``/api/run.json``. A stream
ends when its client disconnects (``http.disconnect``, watched beside the sender: hypercorn
drops what is sent to a closed connection silently, so the sender alone would never notice) or
when the server stops (cancellation reaches the stream's task).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:  # the app imports this module; the aliases are only annotations here
    from swarmtrain.dashboard.app import Receive, Send

EVENT_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    # nginx and friends buffer responses unless told not to; an event must not wait in a proxy.
    (b"x-accel-buffering", b"no"),
]
KEEPALIVE = b": keep-alive\n\n"


@dataclass(frozen=True)
class StreamLimits:
    """How many streams at once, and how often an idle stream hears from the server."""

    max_streams: int = 16
    every_s: float = 30.0  # an event at least this often, changed or not
    keepalive_s: float = 10.0  # a comment after this long without anything sent

    def __post_init__(self) -> None:
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {self.max_streams}")
        if not (self.every_s > 0 and self.keepalive_s > 0):
            raise ValueError("every_s and keepalive_s must be positive")


class RunChanges:
    """A broadcast "the history changed": ``notify`` wakes every stream waiting in ``wait``.

    One ``trio.Event`` per change, replaced when set: a waiter holds the event of the moment it
    began waiting, so a change between two waits is never lost and never seen twice.
    """

    def __init__(self) -> None:
        self._event = trio.Event()
        self.changes = 0

    def notify(self) -> None:
        self.changes += 1
        self._event.set()
        self._event = trio.Event()

    def current(self) -> trio.Event:
        return self._event


def sse_event(document: dict[str, Any]) -> bytes:
    """One ``message`` event whose data is ``document`` as compact JSON (no NaN: the page's
    ``JSON.parse`` refuses it)."""
    return (
        b"data: " + json.dumps(document, allow_nan=False, separators=(",", ":")).encode() + b"\n\n"
    )


class EventStreams:
    """Serves ``/api/events`` for the ASGI app: counts the open streams and runs each one."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        changes: RunChanges,
        limits: StreamLimits | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.changes = changes
        self.limits = limits or StreamLimits()
        self.open = 0  # streams being served now
        self.refused = 0  # requests answered 503 because ``max_streams`` were open

    async def serve(self, receive: Receive, send: Send) -> None:
        """Answer one ``GET /api/events``: 503 when full, else stream until the client leaves
        or the server is cancelled. Returns normally in both cases; ``Cancelled`` propagates."""
        if self.open >= self.limits.max_streams:
            self.refused += 1
            body = (
                f"too many event streams open ({self.limits.max_streams}); "
                "poll /api/run.json instead"
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", b"30"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.open += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": EVENT_HEADERS})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                await self._send_events(send)
        finally:
            self.open -= 1
            # End the body properly (the last chunk), so a client sees the stream end rather
            # than a cut connection: shielded, as the server's stop is a cancellation, and short.
            # To a client already gone hypercorn sends nothing.
            with trio.move_on_after(1.0) as cleanup:
                cleanup.shield = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # the (empty) request body of a GET
        scope.cancel()

    async def _send_events(self, send: Send) -> None:
        limits = self.limits
        while True:
            changed = self.changes.current()  # taken before the snapshot: no change is missed
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_event(self.snapshot()),
                    "more_body": True,
                }
            )
            next_event_at = trio.current_time() + limits.every_s
            while not changed.is_set():
                wait_s = min(limits.keepalive_s, next_event_at - trio.current_time())
                with trio.move_on_after(max(wait_s, 0.0)):
                    await changed.wait()
                if changed.is_set() or trio.current_time() >= next_event_at:
                    break
                await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
