"""Bulk data plane: the TCP listener that data connections are dialed to, and the transfers it
waits for. Only a peer whose reachability is public runs one (see ``p2p.bulk.connect``).
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from p2p.bulk.frames import HELLO_BYTES, Hello, parse_hello, verify_hello
from p2p.bulk.transfer import close_all, recv_into_exactly
from p2p.errors import LocalProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)


@dataclass
class PendingTransfer:
    """A transfer whose data connections are awaited: those that arrived, one slot per stripe,
    and the events its waiter watches (all arrived; the key is known)."""

    # The key is None while a sender that offered its listener waits for the receiver's share;
    # the receiver may dial as soon as it has answered, before we have read that answer.
    key: bytes | None
    stripe_count: int
    socks: list[trio.socket.SocketType | None]
    arrived: trio.Event = field(default_factory=trio.Event)
    key_known: trio.Event = field(default_factory=trio.Event)

    def set_key(self, key: bytes) -> None:
        self.key = key
        self.key_known.set()

    def deliver(self, hello: Hello, sock: trio.socket.SocketType) -> None:
        if hello.stripe_count != self.stripe_count:
            raise RemoteProtocolError("stripe count differs from the offer")
        if self.socks[hello.stripe] is not None:
            raise RemoteProtocolError(f"stripe {hello.stripe} connected twice")
        self.socks[hello.stripe] = sock
        if all(s is not None for s in self.socks):
            self.arrived.set()


class BulkListener:
    """Accepts data connections and hands each, once its hello authenticates, to its transfer.

    Run it in the node's nursery: ``port = await nursery.start(listener.run)``. A connection that
    sends no hello in time, garbage, an unknown transfer id or a hello under the wrong key is
    closed, logged and counted in ``statistics``; the listener keeps serving.
    """

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        hello_timeout_s: float = 10.0,
        max_unauthenticated: int = 64,
    ) -> None:
        self.host = host
        self._requested_port = port
        self.hello_timeout_s = hello_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self._unauthenticated = 0
        self.port = 0
        self.statistics: Counter[str] = Counter()
        self._pending: dict[bytes, PendingTransfer] = {}

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. ``task_status.started`` gets the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with trio.socket.socket(family, socket.SOCK_STREAM) as listen_sock:
            listen_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await listen_sock.bind((self.host, self._requested_port))
            listen_sock.listen(128)
            self.port = listen_sock.getsockname()[1]
            log.info("bulk listener on %s:%d", self.host, self.port)
            task_status.started(self.port)
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        sock, address = await listen_sock.accept()
                    except OSError as exc:  # EMFILE and friends: back off, keep serving
                        log.warning("bulk accept failed: %r", exc)
                        self.statistics["accept_errors"] += 1
                        await trio.sleep(0.1)
                        continue
                    if self._unauthenticated >= self.max_unauthenticated:
                        self.statistics["refused_busy"] += 1
                        log.warning("bulk connection from %s refused: too many pending", address)
                        sock.close()
                        continue
                    self._unauthenticated += 1
                    nursery.start_soon(self._admit, sock, address)

    async def _admit(self, sock: trio.socket.SocketType, address: object) -> None:
        owned: trio.socket.SocketType | None = sock
        try:
            with trio.fail_after(self.hello_timeout_s):
                data = bytearray(HELLO_BYTES)
                got = await recv_into_exactly(sock, memoryview(data))
            if got < HELLO_BYTES:
                raise RemoteProtocolError(f"connection closed after {got} hello bytes")
            hello = parse_hello(bytes(data))
            pending = self._pending.get(hello.transfer_id)
            if pending is None:
                raise RemoteProtocolError("unknown or expired transfer id")
            with trio.move_on_after(self.hello_timeout_s):
                await pending.key_known.wait()
            if self._pending.get(hello.transfer_id) is not pending or pending.key is None:
                raise RemoteProtocolError("transfer ended before its key was agreed")
            verify_hello(pending.key, bytes(data))
            pending.deliver(hello, sock)
            owned = None
            self.statistics["accepted"] += 1
        except RemoteProtocolError as exc:
            self.statistics["rejected"] += 1
            log.warning("bulk connection from %s rejected: %s", address, exc)
        except trio.TooSlowError:
            self.statistics["rejected"] += 1
            log.warning(
                "bulk connection from %s rejected: no hello within %.1f s",
                address,
                self.hello_timeout_s,
            )
        except Exception as exc:  # a reset connection must not end the listener
            self.statistics["errors"] += 1
            log.warning("bulk connection from %s failed: %r", address, exc)
        finally:
            self._unauthenticated -= 1
            if owned is not None:
                owned.close()

    def is_pending(self, transfer_id: bytes) -> bool:
        return transfer_id in self._pending

    @contextmanager
    def expect(
        self, transfer_id: bytes, stripe_count: int, key: bytes | None = None
    ) -> Iterator[PendingTransfer]:
        """Register a transfer whose data connections will arrive (``key`` may follow through
        ``set_key``); unregister, closing any connection nobody took, on exit."""
        if transfer_id in self._pending:
            raise LocalProtocolError("transfer id already registered")
        pending = PendingTransfer(None, stripe_count, [None] * stripe_count)
        if key is not None:
            pending.set_key(key)
        self._pending[transfer_id] = pending
        try:
            yield pending
        finally:
            del self._pending[transfer_id]
            close_all(pending.socks)
