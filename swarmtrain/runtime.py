"""``PeerRuntime``: a p2p node and its trio loop in a background thread, for torch code.

``swarm.BlockingAverager`` does the same for the averager alone; a volunteer needs more on the
same loop: fetch the run spec before it knows the run id (the averager's config needs it), serve
its state to joiners, download state, and read and write progress records. So the runtime owns
the loop, and everything runs in it through ``call`` (``trio.from_thread.run``). Services are
started in the runtime's nursery; ``close`` cancels the nursery: shutdown is cancellation.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from p2p import Node, NodeConfig, PeerID, open_node, subkey_values

T = TypeVar("T")


class PeerRuntime:
    """``with PeerRuntime(node_config) as runtime: runtime.call(async_fn, *args)``.

    Raises whatever ``open_node`` raised (P2PError when the node cannot join) from the
    constructor, or TimeoutError when it does not start within ``start_timeout_s``."""

    def __init__(self, node_config: NodeConfig, *, start_timeout_s: float = 60.0) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self.node: Node | None = None
        self._thread = threading.Thread(
            target=self._main, args=(node_config,), name="swarmtrain-p2p", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise TimeoutError(f"the node did not start within {start_timeout_s} s")
        if self._error is not None:
            raise self._error

    def _main(self, node_config: NodeConfig) -> None:
        async def main() -> None:
            try:
                async with open_node(node_config) as node, trio.open_nursery() as nursery:
                    self.node = node
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

    @property
    def peer_id(self) -> PeerID:
        assert self.node is not None
        return self.node.host.peer_id

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the loop; its result or exception comes back here.
        Raises RuntimeError when the loop is gone."""
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError(f"the p2p node is not running: {self._error!r}")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` in the loop's thread (it must not block)."""
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError(f"the p2p node is not running: {self._error!r}")
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def start(self, service: Callable[..., Awaitable[Any]]) -> None:
        """Start ``service`` (``async def service(*, task_status)``) in the runtime's nursery and
        wait until it reports started."""

        async def start() -> None:
            assert self._nursery is not None
            await self._nursery.start(service)

        self.call(start)

    # -- DHT conveniences ----------------------------------------------------------------------

    def store(
        self, key: str, value: bytes, ttl_s: float, *, version: int = 0, tag: bytes = b""
    ) -> int:
        """Store ``value`` as our signed subkey of ``key`` (``tag``: one of several subkeys of
        ours, ``peer_id/tag``); returns how many peers hold it."""
        assert self.node is not None
        dht = self.node.dht

        async def store() -> int:
            return await dht.store(key, value, time.time() + ttl_s, version=version, tag=tag)

        return self.call(store)

    def read(self, key: str) -> dict[str, bytes]:
        """``{owner peer id: value}`` of the unexpired signed entries of ``key`` (every replica
        asked, so a store that is still spreading is seen); one per owner (its last subkey)."""
        return dict(self.read_all(key))

    def read_all(self, key: str) -> list[tuple[str, bytes]]:
        """``(owner peer id, value)`` of every unexpired signed entry of ``key``: all of an
        owner's tagged subkeys, where ``read`` keeps one per owner."""
        assert self.node is not None
        dht = self.node.dht

        async def read() -> list[tuple[str, bytes]]:
            records = await dht.get_records(key, latest=True)
            values = subkey_values(records, now=time.time())
            return [(str(PeerID(records[s].owner)), v) for s, v in sorted(values.items())]

        return self.call(read)

    def close(self) -> None:
        if self._token is not None and self._nursery is not None and self._thread.is_alive():
            scope = self._nursery.cancel_scope
            with contextlib.suppress(trio.RunFinishedError, RuntimeError):
                trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
        self._thread.join(timeout=10)

    def __enter__(self) -> PeerRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
