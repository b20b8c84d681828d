"""A node and its trio loop in a background thread, for synchronous (torch) code; and ``poll``.

``NodeThread`` is the one bridge between a torch thread and trio: it opens a node in its own
thread's ``trio.run``, optionally starts services in the loop's nursery before it reports ready
(``setup``), and runs coroutines there on behalf of the calling thread (``call``, through
``trio.from_thread.run``). ``close`` cancels the nursery: shutdown is cancellation.
``swarmtrain.runtime.PeerRuntime`` and ``swarm.BlockingAverager`` are built on it.

``poll`` is the trio side of waiting for something another peer publishes: it awaits a probe
every ``interval_s`` until the probe's value is what the caller waits for, under one deadline.
A torch thread waits through ``NodeThread.poll`` instead of ``time.sleep`` loops, so the wait
is a trio sleep, cancelled with the node.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from p2p.node import Node, NodeConfig, open_node

T = TypeVar("T")


async def poll(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    interval_s: float,
    timeout_s: float,
    wait_first: bool = False,
) -> T | None:
    """Await ``probe()`` every ``interval_s`` until ``done(value)`` or ``timeout_s`` passed
    (``wait_first``: sleep one interval before the first probe, none at all when ``timeout_s``
    is not positive). The last probe is the first one at or past the deadline, as a loop of
    "probe, stop if done or late, sleep" would have it. Returns the last value probed (the one
    that was done, or the one at the deadline), None when there was no probe. Exceptions of
    ``probe`` and ``done`` propagate; cancellation (the node closing) ends the wait."""
    deadline = trio.current_time() + timeout_s
    if wait_first:
        if timeout_s <= 0:
            return None
        await trio.sleep(interval_s)
    while True:
        value = await probe()
        if done(value) or trio.current_time() >= deadline:
            return value
        await trio.sleep(interval_s)


class NodeThread:
    """``with NodeThread(node_config) as loop: loop.call(async_fn, *args)``.

    ``setup(node, nursery)``, when given, runs in the loop before the constructor returns (to
    start services the caller needs at once). Raises whatever ``open_node`` or ``setup`` raised
    (P2PError when the node cannot join) from the constructor, or TimeoutError when the node does
    not start within ``start_timeout_s``."""

    def __init__(
        self,
        node_config: NodeConfig,
        *,
        name: str = "p2p-node",
        start_timeout_s: float = 60.0,
        setup: Callable[[Node, trio.Nursery], Awaitable[None]] | None = None,
    ) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self.node: Node | None = None
        self._thread = threading.Thread(
            target=self._main, args=(node_config, setup), name=name, daemon=True
        )
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise TimeoutError(f"the node did not start within {start_timeout_s} s")
        if self._error is not None:
            raise self._error

    def _main(
        self,
        node_config: NodeConfig,
        setup: Callable[[Node, trio.Nursery], Awaitable[None]] | None,
    ) -> None:
        async def main() -> None:
            try:
                async with open_node(node_config) as node, trio.open_nursery() as nursery:
                    self.node = node
                    if setup is not None:
                        await setup(node, nursery)
                    self._nursery = nursery
                    self._token = trio.lowlevel.current_trio_token()
                    self._ready.set()
                    await trio.sleep_forever()
            except BaseException as exc:
                self._error = self._error or exc
                raise

        try:
            trio.run(main)
        except BaseException as exc:
            self._error = self._error or exc
        finally:
            self._ready.set()

    def _token_or_raise(self) -> trio.lowlevel.TrioToken:
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError(f"the p2p node is not running: {self._error!r}")
        return self._token

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the loop; its result or exception comes back here.
        Raises RuntimeError when the loop is gone."""
        return trio.from_thread.run(fn, *args, trio_token=self._token_or_raise())

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` in the loop's thread (it must not block)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token_or_raise())

    def start(self, service: Callable[..., Awaitable[Any]]) -> None:
        """Start ``service`` (``async def service(*, task_status)``) in the loop's nursery and
        wait until it reports started."""

        async def start() -> None:
            assert self._nursery is not None
            await self._nursery.start(service)

        self.call(start)

    def poll(
        self,
        probe: Callable[[], Awaitable[T]],
        done: Callable[[T], bool],
        *,
        interval_s: float,
        timeout_s: float,
        wait_first: bool = False,
    ) -> T | None:
        """``poll`` in the loop, blocking this thread until it returns (see ``poll``)."""

        async def run() -> T | None:
            return await poll(
                probe, done, interval_s=interval_s, timeout_s=timeout_s, wait_first=wait_first
            )

        return self.call(run)

    def close(self) -> None:
        if self._token is not None and self._nursery is not None and self._thread.is_alive():
            scope = self._nursery.cancel_scope
            with contextlib.suppress(trio.RunFinishedError, RuntimeError):
                trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
        self._thread.join(timeout=10)

    def __enter__(self) -> NodeThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
