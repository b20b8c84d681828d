"""The dashboard's trio driver: refresh the run's history on a timer and serve it via hypercorn.

Two children of one nursery, both in the coordinator's trio loop (so a request reads the
history while nothing else changes it): ``_refresh`` calls ``read`` (the coordinator's read of
the DHT, ``swarmtrain.commands.coordinator.read_run``) every ``interval_s``, each read under its
own deadline, and hands the result to ``RunHistory.observe``; ``_serve`` runs
``hypercorn.trio.serve`` on the already bound socket (``fd://``, hypercorn's own way to take a
listening socket). Neither may take the coordinator down: a read that fails or times out is
recorded for the page to show, and a server that dies after it started is logged. Cancellation
(Ctrl+C, SIGTERM) stops both, and with them every ``/api/events`` stream (``events``): each read,
good or failed, wakes those streams through ``RunChanges``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarmtrain.dashboard.app import dashboard_app
from swarmtrain.dashboard.events import EventStreams, RunChanges, StreamLimits
from swarmtrain.dashboard.history import Reading, RunHistory
from swarmtrain.dashboard.options import DashboardListener

log = logging.getLogger(__name__)
# Hypercorn's own lines ("Running on ...") repeat ours; its warnings and errors still show.
HYPERCORN_LOG = logging.getLogger(f"{__name__}.hypercorn")
HYPERCORN_LOG.setLevel(logging.WARNING)

READ_INTERVAL_S = 1.0
READ_TIMEOUT_S = 10.0
STREAM_LIMITS = StreamLimits()


class Dashboard:
    """Serve ``history`` on ``listener`` and refresh it with ``read()`` every ``interval_s``."""

    def __init__(
        self,
        history: RunHistory,
        read: Callable[[], Awaitable[Reading]],
        listener: DashboardListener,
        *,
        interval_s: float = READ_INTERVAL_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        stream_limits: StreamLimits = STREAM_LIMITS,
    ) -> None:
        self.history = history
        self.read = read
        self.listener = listener
        self.interval_s = interval_s
        self.read_timeout_s = read_timeout_s
        self.reads = 0  # reads that succeeded
        self.changes = RunChanges()  # told after every read; wakes the /api/events streams

        def snapshot() -> dict[str, Any]:
            return history.to_json(time.time())

        self.streams = EventStreams(snapshot, self.changes, stream_limits)
        self.app = dashboard_app(snapshot, self.streams)

    @property
    def url(self) -> str:
        return self.listener.url

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ready (the URL) once the server accepts connections."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._serve)
            nursery.start_soon(self._refresh)
            log.info("serving the dashboard at %s", self.url)
            task_status.started(self.url)

    async def refresh_once(self) -> None:
        """One bounded read into the history; a failure is recorded there, never raised. The
        event streams are told either way (the page shows a failed read too)."""
        try:
            await self._read_once()
        finally:
            self.changes.notify()

    async def _read_once(self) -> None:
        with trio.move_on_after(self.read_timeout_s) as scope:
            try:
                reading = await self.read()
            except Exception as exc:  # a P2PError, or a bug in a read: the page shows it
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                log.debug("dashboard read failed: %r", exc)
                self.history.failed(reason, time.time())
                return
            self.history.observe(reading)
            self.reads += 1
        if scope.cancelled_caught:
            self.history.failed(f"no answer within {self.read_timeout_s:g} s", time.time())

    async def _refresh(self) -> None:
        while True:
            await self.refresh_once()
            await trio.sleep(self.interval_s)

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # Imported here: every swarmtrain command imports this package's flags, few serve it.
        from hypercorn.config import Config
        from hypercorn.trio import serve

        config = Config()
        # Hypercorn adopts the descriptor; detaching leaves it one owner to close it.
        config.bind = [f"fd://{self.listener.sock.detach()}"]
        config.accesslog = None
        config.errorlog = HYPERCORN_LOG
        # Whether hypercorn got as far as serving: a failure before that is the caller's (the
        # coordinator does not start), one after it only the dashboard's.
        started = False

        class _Ready:
            def started(self, value: object = None) -> None:
                nonlocal started
                started = True
                task_status.started()

        try:
            await serve(self.app, config, task_status=_Ready())  # type: ignore[arg-type]
        except Exception as exc:
            if not started:
                raise
            log.error("the dashboard stopped serving (the coordinator goes on): %r", exc)
