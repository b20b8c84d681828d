"""Bulk data plane: tensors at close to plain-TCP cost, keyed through the libp2p channel.

A py-libp2p TCP+Noise+yamux stream costs about ten times the CPU per GiB of a plain TCP socket
(DESIGN.md). So a transfer is negotiated on a libp2p stream (authenticated by Noise, giving us the
peer ids and a confidential channel for key shares) and its bytes move over separate TCP
connections as large AES-256-OCB3 frames (``p2p.bulk_frames`` has the format and the reasoning).

Who dials whom, and NAT
-----------------------
A data connection is dialed *toward the side that runs a reachable* ``BulkListener``, to the IP the
libp2p connection reached that peer on (``stream.get_remote_address()``), so it crosses NATs exactly
as an outbound libp2p dial does: the NATed side dials out. The data direction is independent of the
dial direction: the receiver answers ``DIAL_RECEIVER`` (sender dials us) when it has a listener,
else ``DIAL_SENDER`` when the sender offered one. Give a ``BulkListener`` only to a peer whose
reachability is public (our dial-back check), and open its port where the libp2p port is open.

We do not share the libp2p TCP port. py-libp2p 0.8.1 does set SO_REUSEPORT on its listener (for
DCUtR hole punching), so we could bind beside it, but Linux then spreads new incoming connections
over both sockets by hash, and some libp2p dials would land on the bulk listener. One port serving
both would need a demultiplexer that sniffs the first bytes (our ``STBK`` versus multistream) and
hands libp2p an accepted socket, which 0.8.1's TCP transport has no entry for. Reusing the libp2p
port on the *dialing* side would not help either: the 4-tuple toward the peer's libp2p port is
taken by the libp2p connection, and toward any other port the peer's NAT has no mapping. So when
neither side has a listener but the libp2p connection is direct (both NATed, joined by a DCUtR
hole punch), we punch the data connections the same way (``DataMode.PUNCH``): each side binds one
fresh port per stripe (SO_REUSEADDR/SO_REUSEPORT, listening on it as well), the ports travel in
``Offer``/``Accept``, and both connect from their port to the peer's port at the IP the libp2p
connection sees (the peer NAT's public address) at the same time, retrying within
``punch_timeout_s``. Each side's outgoing SYN opens its own NAT for the other's; a port-preserving
cone NAT keeps the announced port. Whichever of connect (simultaneous open) or accept (the peer's
SYN reached our listening socket first, as on loopback) yields the one connection of that
4-tuple, the sender sends the hello. A punch that fails in the window (a symmetric NAT maps our
SYN to another port) ends with the sender's ``Fallback``, as a failed dial does. When the
connection is relayed (``direct=False``) the payload rides the libp2p stream itself
(``DataMode.STREAM``): slower, but it crosses whatever that connection crosses.

Concurrency
-----------
AEAD runs inline on the trio thread: a 1 MiB frame takes about 0.4 ms here, too short to stall
heartbeats, and a worker-thread hop per frame cannot buy CPU on a 2-core box where sender and
receiver already keep both cores busy (measuring it here was lost in other jobs' load). Every
wait is bounded: control messages by ``control_timeout_s``, dials and the arrival of data
connections by ``connect_timeout_s``, each frame's progress by ``idle_timeout_s``, a connection's
hello by the listener's ``hello_timeout_s``; at most ``max_unauthenticated`` connections may be
waiting for their hello at once (more are closed at accept), so a flood cannot pile up sockets.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from p2p.bulk_frames import (
    DEFAULT_FRAME_BYTES,
    FRAME_HEADER_BYTES,
    HELLO_BYTES,
    Accept,
    BulkReceiver,
    BulkSender,
    ControlMessage,
    DataMode,
    Fallback,
    Hello,
    Offer,
    Outcome,
    Reject,
    TransferLayout,
    control_length,
    decode_control,
    derive_session_key,
    encode_control,
    parse_hello,
    seal_hello,
    verify_hello,
)
from p2p.errors import LocalProtocolError, P2PError, RemoteError, RemoteProtocolError
from p2p.tensors import TensorHeader, as_wire_bytes, from_wire_bytes, header_for
from p2p.wire import decode, encode, read_exactly

log = logging.getLogger(__name__)

PROTOCOL = "/swarmtrain/bulk/1"


class BulkTransferFailed(P2PError):
    """A transfer could not complete: a timeout, a lost connection, or a dial that failed."""


class ByteStream(Protocol):
    """What we need of a libp2p ``INetStream``."""

    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class BulkConfig:
    """Sender side: ``frame_bytes``, ``stripes`` (TCP connections per transfer). Receiver side:
    ``max_bytes``, the largest offer accepted (it is allocated up front, so keep it as small as
    the caller's largest expected tensor). Both: the deadlines, see the module docstring."""

    frame_bytes: int = DEFAULT_FRAME_BYTES
    stripes: int = 1
    max_bytes: int = 1 << 30
    control_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    # A punch needs both sides' SYNs to cross: the first usually dies at the far NAT, the kernel
    # retransmits after 1 s, so 3 s covers a few SYNs and still falls back soon enough.
    punch_timeout_s: float = 3.0
    idle_timeout_s: float = 30.0
    stream_chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        TransferLayout(0, self.frame_bytes, self.stripes)
        if not 0 < self.stream_chunk_bytes <= 16 << 20:
            raise ValueError("stream_chunk_bytes out of range")


DEFAULT_CONFIG = BulkConfig()


@dataclass(frozen=True, slots=True)
class BulkReceived:
    """What ``receive_bulk`` returns: the sender's ``meta``, the payload, and how it came."""

    meta: bytes
    data: bytearray
    mode: DataMode


# ---------------------------------------------------------------------------------------------
# Socket and stream helpers


async def _send_all(sock: trio.socket.SocketType, data: memoryview) -> None:
    sent = 0
    while sent < len(data):
        sent += await sock.send(data[sent:])


async def _recv_into_exactly(sock: trio.socket.SocketType, view: memoryview) -> int:
    """Fill ``view``; return fewer bytes only if the peer closed the connection."""
    got = 0
    while got < len(view):
        n = await sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


@contextmanager
def _stream_errors(what: str) -> Iterator[None]:
    """Turn libp2p's stream exceptions (StreamReset, StreamClosed, ...) and our own deadlines
    into ``BulkTransferFailed``, so callers see only the ``P2PError`` family."""
    try:
        yield
    except P2PError:
        raise
    except trio.TooSlowError:
        raise BulkTransferFailed(f"{what}: timed out") from None
    except Exception as exc:
        raise BulkTransferFailed(f"{what}: {exc!r}") from exc


async def _write_control(stream: ByteStream, message: ControlMessage, timeout_s: float) -> None:
    with _stream_errors(f"sending {type(message).__name__}"), trio.fail_after(timeout_s):
        await stream.write(encode_control(message))


async def _read_control(stream: ByteStream, timeout_s: float | None) -> ControlMessage:
    with (
        _stream_errors("reading a control message"),
        trio.fail_after(timeout_s) if timeout_s is not None else _no_deadline(),
    ):
        length = control_length(await read_exactly(stream, 4))
        return decode_control(await read_exactly(stream, length))


@contextmanager
def _no_deadline() -> Iterator[None]:
    # Only for reads raced inside a scope that already has a deadline.
    yield


def _peer_ids(stream: Any) -> tuple[bytes, bytes]:
    """(local, remote) peer id bytes of a libp2p ``NetStream``."""
    secured = stream.muxed_conn.secured_conn
    return secured.get_local_peer().to_bytes(), secured.get_remote_peer().to_bytes()


def _remote_ip(stream: Any) -> str | None:
    try:
        address = stream.get_remote_address()
    except Exception:
        return None
    return address[0] if address else None


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def _close_all(socks: list[trio.socket.SocketType | None]) -> None:
    for sock in socks:
        if sock is not None:
            sock.close()


# ---------------------------------------------------------------------------------------------
# Listener


@dataclass
class _PendingTransfer:
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
        self._pending: dict[bytes, _PendingTransfer] = {}

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
                got = await _recv_into_exactly(sock, memoryview(data))
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
    ) -> Iterator[_PendingTransfer]:
        """Register a transfer whose data connections will arrive (``key`` may follow through
        ``set_key``); unregister, closing any connection nobody took, on exit."""
        if transfer_id in self._pending:
            raise LocalProtocolError("transfer id already registered")
        pending = _PendingTransfer(None, stripe_count, [None] * stripe_count)
        if key is not None:
            pending.set_key(key)
        self._pending[transfer_id] = pending
        try:
            yield pending
        finally:
            del self._pending[transfer_id]
            _close_all(pending.socks)


# ---------------------------------------------------------------------------------------------
# Data connection setup


async def _dial(
    ip: str, port: int, key: bytes, transfer_id: bytes, layout: TransferLayout, timeout_s: float
) -> list[trio.socket.SocketType | None]:
    socks: list[trio.socket.SocketType | None] = []
    try:
        with trio.fail_after(timeout_s):
            for stripe in range(layout.stripe_count):
                family = socket.AF_INET6 if ":" in ip else socket.AF_INET
                sock = trio.socket.socket(family, socket.SOCK_STREAM)
                socks.append(sock)
                await sock.connect((ip, port))
                hello = seal_hello(key, Hello(transfer_id, stripe, layout.stripe_count))
                await _send_all(sock, memoryview(hello))
    except BaseException:
        _close_all(socks)
        raise
    return socks


async def _dial_or_fall_back(
    stream: ByteStream,
    remote_ip: str | None,
    port: int,
    key: bytes,
    transfer_id: bytes,
    layout: TransferLayout,
    config: BulkConfig,
) -> list[trio.socket.SocketType | None] | None:
    """Dial the peer's listener; on failure tell it (``Fallback``) and return None: the payload
    then rides the libp2p stream."""
    ip = remote_ip or _remote_ip(stream)
    try:
        if ip is None:
            raise OSError("no remote IP for the libp2p connection")
        socks = await _dial(ip, port, key, transfer_id, layout, config.connect_timeout_s)
        return socks
    except (OSError, trio.TooSlowError) as exc:
        log.warning("bulk dial to %s:%d failed (%r); using the libp2p stream", ip, port, exc)
        reason = f"dial failed: {exc!r}"[:200]
        await _write_control(stream, Fallback(reason), config.control_timeout_s)
        return None


async def _await_connections(
    pending: _PendingTransfer,
    stream: ByteStream,
    config: BulkConfig,
    dialer_timeout_s: float | None = None,
) -> list[trio.socket.SocketType | None] | Fallback:
    """Wait for all data connections, or for the dialer's ``Fallback`` on the control stream.

    The wait outlasts the dialer's own connect timeout (``dialer_timeout_s``, by default
    ``connect_timeout_s``) by a control timeout, so a dialer that gives up is heard (and both
    fall back) rather than both sides timing out together.

    Cancelling the control read is safe: the dialer writes nothing on the control stream between
    a successful dial and the end of the data, so no message can be half-read.
    """
    result: list[trio.socket.SocketType | None] | Fallback | None = None

    async def watch_control(cancel_scope: trio.CancelScope) -> None:
        nonlocal result
        message = await _read_control(stream, None)
        if not isinstance(message, Fallback):
            raise RemoteProtocolError(f"expected data connections, got {type(message).__name__}")
        result = message
        cancel_scope.cancel()

    if dialer_timeout_s is None:
        dialer_timeout_s = config.connect_timeout_s
    timeout_s = dialer_timeout_s + config.control_timeout_s
    try:
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_control, nursery.cancel_scope)
                await pending.arrived.wait()
                result = pending.socks
                nursery.cancel_scope.cancel()
    except trio.TooSlowError:
        raise BulkTransferFailed(f"data connections did not arrive within {timeout_s} s") from None
    except BaseExceptionGroup as group:  # the control watcher failed: report it as itself
        raise _first_leaf(group) from None
    assert result is not None
    return result


# ---------------------------------------------------------------------------------------------
# Hole punching (DataMode.PUNCH)

_ANY_ADDRESS = {socket.AF_INET: "0.0.0.0", socket.AF_INET6: "::"}
# Between connect attempts that failed at once (refused, 4-tuple taken by a connection our
# listening socket is about to accept, no route yet): short, the window bounds the total.
_PUNCH_RETRY_S = 0.05


def _punch_socket(family: socket.AddressFamily) -> trio.socket.SocketType:
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    # Both options on every socket of the port: the listening one and each connect attempt bind
    # the same port, which Linux allows only when all of them set SO_REUSEPORT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


async def _open_punch_ports(ip: str, count: int) -> list[trio.socket.SocketType]:
    """One listening socket per stripe on a fresh ephemeral port, for a punch toward ``ip``.

    Listening as well as connecting means the punch also completes when the peer's SYN arrives
    before ours left (loopback, or a NAT that filters only by address). Raises ``OSError``."""
    family = _family(ip)
    socks: list[trio.socket.SocketType] = []
    try:
        for _ in range(count):
            sock = _punch_socket(family)
            socks.append(sock)
            await sock.bind((_ANY_ADDRESS[family], 0))
            sock.listen(1)
    except BaseException:
        _close_all(list(socks))
        raise
    return socks


async def _punch(listen_sock: trio.socket.SocketType, ip: str, port: int) -> trio.socket.SocketType:
    """The TCP connection between ``listen_sock``'s port and ``(ip, port)``: connect to it from
    that port again and again while accepting on it; the first connection wins. Unbounded:
    the caller's deadline ends it."""
    family = listen_sock.family
    local_port = listen_sock.getsockname()[1]
    result: trio.socket.SocketType | None = None

    def won(sock: trio.socket.SocketType, scope: trio.CancelScope) -> None:
        nonlocal result
        if result is None:  # both loops may finish in the same scheduling round
            result = sock
            scope.cancel()
        else:
            sock.close()

    async def accept_loop(scope: trio.CancelScope) -> None:
        while True:
            sock, address = await listen_sock.accept()
            if address[0] != ip:  # not our peer: the hello would fail anyway, keep the port
                log.warning("punch port %d: connection from %s refused", local_port, address)
                sock.close()
                continue
            won(sock, scope)
            return

    async def connect_loop(scope: trio.CancelScope) -> None:
        while True:
            sock = _punch_socket(family)
            try:
                await sock.bind((_ANY_ADDRESS[family], local_port))
                await sock.connect((ip, port))
            except OSError as exc:
                sock.close()
                log.debug("punch %d -> %s:%d: %r; retrying", local_port, ip, port, exc)
                await trio.sleep(_PUNCH_RETRY_S)
                continue
            except BaseException:
                sock.close()
                raise
            won(sock, scope)
            return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_loop, nursery.cancel_scope)
        nursery.start_soon(connect_loop, nursery.cancel_scope)
    assert result is not None
    return result


async def _punch_as_sender(
    stream: ByteStream,
    ip: str,
    listen_socks: list[trio.socket.SocketType],
    peer_ports: tuple[int, ...],
    key: bytes,
    transfer_id: bytes,
    layout: TransferLayout,
    config: BulkConfig,
) -> list[trio.socket.SocketType | None] | None:
    """Punch every stripe within ``punch_timeout_s`` and send each its hello; else close what
    was punched, tell the receiver (``Fallback``) and return None: the stream carries the data."""
    socks: list[trio.socket.SocketType | None] = [None] * layout.stripe_count

    async def punch_stripe(stripe: int) -> None:
        socks[stripe] = await _punch(listen_socks[stripe], ip, peer_ports[stripe])

    try:
        with trio.move_on_after(config.punch_timeout_s):
            async with trio.open_nursery() as nursery:
                for stripe in range(layout.stripe_count):
                    nursery.start_soon(punch_stripe, stripe)
        if any(sock is None for sock in socks):
            raise trio.TooSlowError(f"no connection within {config.punch_timeout_s} s")
        with trio.fail_after(config.connect_timeout_s):
            for stripe, sock in enumerate(socks):
                assert sock is not None
                hello = seal_hello(key, Hello(transfer_id, stripe, layout.stripe_count))
                await _send_all(sock, memoryview(hello))
        return socks
    except BaseExceptionGroup as group:
        _close_all(socks)
        leaf = _first_leaf(group)
        if not isinstance(leaf, OSError):
            raise leaf from None
        failure: BaseException = leaf
    except (OSError, trio.TooSlowError) as exc:
        _close_all(socks)
        failure = exc
    except BaseException:
        _close_all(socks)
        raise
    log.warning("bulk punch to %s failed (%r); using the libp2p stream", ip, failure)
    await _write_control(
        stream, Fallback(f"punch failed: {failure!r}"[:200]), config.control_timeout_s
    )
    return None


async def _punch_as_receiver(
    stream: ByteStream,
    ip: str,
    listen_socks: list[trio.socket.SocketType],
    peer_ports: tuple[int, ...],
    key: bytes,
    transfer_id: bytes,
    layout: TransferLayout,
    config: BulkConfig,
) -> list[trio.socket.SocketType | None] | Fallback:
    """Punch every stripe and authenticate the sender's hello on it, until all stripes are in or
    the sender's ``Fallback`` arrives (the sender's window plus a control timeout at most)."""
    pending = _PendingTransfer(key, layout.stripe_count, [None] * layout.stripe_count)
    pending.set_key(key)

    async def punch_stripe(stripe: int) -> None:
        sock: trio.socket.SocketType | None = await _punch(
            listen_socks[stripe], ip, peer_ports[stripe]
        )
        assert sock is not None
        try:
            data = bytearray(HELLO_BYTES)
            try:
                with trio.fail_after(config.connect_timeout_s):
                    got = await _recv_into_exactly(sock, memoryview(data))
            except (OSError, trio.TooSlowError) as exc:
                got, lost = 0, exc
            else:
                lost = None
            if got < HELLO_BYTES:
                # Not fatal: at the end of its window the sender closes a connection it did not
                # see complete, and says Fallback, which we are about to read; if it never
                # does, the wait for all stripes times out.
                log.warning("punched stripe %d lost before its hello (%r)", stripe, lost)
                return
            hello = verify_hello(key, bytes(data))
            if hello.transfer_id != transfer_id or hello.stripe != stripe:
                raise RemoteProtocolError(f"punched stripe {stripe} carries another hello")
            pending.deliver(hello, sock)
            sock = None
        finally:
            if sock is not None:
                sock.close()

    try:
        async with trio.open_nursery() as nursery:
            for stripe in range(layout.stripe_count):
                nursery.start_soon(punch_stripe, stripe)
            arrived = await _await_connections(pending, stream, config, config.punch_timeout_s)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _close_all(pending.socks)
        raise _first_leaf(group) from None
    except BaseException:
        _close_all(pending.socks)
        raise
    if isinstance(arrived, Fallback):
        _close_all(pending.socks)
    return arrived


# ---------------------------------------------------------------------------------------------
# Moving the bytes


async def _send_stripe(
    sock: trio.socket.SocketType, sender: BulkSender, source: memoryview, idle_timeout_s: float
) -> None:
    out = bytearray(sender.layout.frame_buffer_bytes)
    while (frame := sender.next_frame(source, out)) is not None:
        with trio.fail_after(idle_timeout_s):
            await _send_all(sock, frame)


async def _receive_stripe(
    sock: trio.socket.SocketType, receiver: BulkReceiver, dest: bytearray, idle_timeout_s: float
) -> None:
    header = bytearray(FRAME_HEADER_BYTES)
    body = memoryview(bytearray(receiver.layout.frame_buffer_bytes))
    while not receiver.done:
        with trio.fail_after(idle_timeout_s):
            if await _recv_into_exactly(sock, memoryview(header)) < FRAME_HEADER_BYTES:
                receiver.receive_eof()
            body_len = receiver.receive_header(header)
            if await _recv_into_exactly(sock, body[:body_len]) < body_len:
                receiver.receive_eof()
        receiver.receive_body(body[:body_len], dest)


async def _run_stripes(
    socks: list[trio.socket.SocketType | None],
    work: Callable[[int, trio.socket.SocketType], Any],
) -> None:
    try:
        async with trio.open_nursery() as nursery:
            for stripe, sock in enumerate(socks):
                assert sock is not None
                nursery.start_soon(work, stripe, sock)
    except BaseExceptionGroup as group:
        # Report the first real cause, not a group: callers catch P2PError.
        leaf = _first_leaf(group)
        raise leaf from None
    finally:
        _close_all(socks)


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception in ``group`` (depth first) that is not a Cancelled, if any."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = exc.exceptions
        else:
            leaves.append(exc)
    real = [exc for exc in leaves if not isinstance(exc, trio.Cancelled)]
    return (real or leaves)[0]


def _io_failure(what: str, exc: BaseException) -> BulkTransferFailed:
    if isinstance(exc, trio.TooSlowError):
        return BulkTransferFailed(f"{what}: stalled past the idle timeout")
    return BulkTransferFailed(f"{what}: {exc!r}")


# ---------------------------------------------------------------------------------------------
# Public entry points


async def send_bulk(
    stream: ByteStream,
    data: bytes | bytearray | memoryview,
    *,
    direct: bool,
    listener: BulkListener | None = None,
    meta: bytes = b"",
    config: BulkConfig = DEFAULT_CONFIG,
    peer_ids: tuple[bytes, bytes] | None = None,
    remote_ip: str | None = None,
) -> DataMode:
    """Send ``data`` (and ``meta``, at most 16 KiB) to the peer running ``receive_bulk`` on the
    other end of ``stream``, an open libp2p stream that the caller owns and closes.

    ``direct``: the libp2p connection is direct (False when relayed: the payload then rides
    ``stream``). ``listener``: ours, offered to the receiver if it has none. ``peer_ids``
    (local, remote) and ``remote_ip`` default to what ``stream`` reports.

    Returns the ``DataMode`` used, once the receiver confirmed every byte. Raises
    ``RemoteError`` (the receiver refused or failed: ``code`` says which),
    ``RemoteProtocolError`` (it broke the protocol), ``BulkTransferFailed`` (timeout, lost
    connection), ``LocalProtocolError`` (bad arguments).
    """
    source = memoryview(data).cast("B")
    local_id, remote_id = peer_ids or _peer_ids(stream)
    share = os.urandom(32)
    our_port = listener.port if (listener is not None and direct) else 0
    ip = remote_ip or _remote_ip(stream)
    with ExitStack() as registration:
        # No listener of ours on a direct connection: offer ports to punch from, bound before
        # the offer names them. (If the receiver listens it will choose that instead.)
        punch_socks: list[trio.socket.SocketType] = []
        if direct and not our_port and ip is not None:
            try:
                punch_socks = await _open_punch_ports(ip, config.stripes)
            except OSError as exc:
                log.warning("cannot open bulk punch ports (%r): not offering a punch", exc)
            registration.callback(_close_all, list(punch_socks))
        offer = Offer(
            os.urandom(16),
            len(source),
            config.frame_bytes,
            config.stripes,
            share,
            direct,
            our_port,
            meta,
            tuple(sock.getsockname()[1] for sock in punch_socks),
        )
        layout = offer.layout
        # Register before offering: the receiver may dial the moment it has answered.
        pending = (
            registration.enter_context(listener.expect(offer.transfer_id, layout.stripe_count))
            if listener is not None and our_port
            else None
        )
        await _write_control(stream, offer, config.control_timeout_s)
        reply = await _read_control(stream, config.control_timeout_s)
        if isinstance(reply, Reject):
            raise RemoteError("rejected", reply.reason)
        if not isinstance(reply, Accept):
            raise RemoteProtocolError(f"expected Accept, got {type(reply).__name__}")
        key = derive_session_key(
            sender_share=share,
            receiver_share=reply.share,
            sender_peer_id=local_id,
            receiver_peer_id=remote_id,
            transfer_id=offer.transfer_id,
        )
        mode = reply.mode
        socks: list[trio.socket.SocketType | None] | None = None
        if mode is DataMode.DIAL_RECEIVER:
            registration.close()  # nobody will dial us
            socks = await _dial_or_fall_back(
                stream, remote_ip, reply.listen_port, key, offer.transfer_id, layout, config
            )
            if socks is None:
                mode = DataMode.STREAM
        elif mode is DataMode.DIAL_SENDER:
            if pending is None:
                raise RemoteProtocolError("receiver chose DIAL_SENDER but we offered no listener")
            pending.set_key(key)
            arrived = await _await_connections(pending, stream, config)
            if isinstance(arrived, Fallback):
                log.warning(
                    "receiver could not dial us (%s); using the libp2p stream", arrived.reason
                )
                mode = DataMode.STREAM
            else:
                socks = list(arrived)
                pending.socks = [None] * layout.stripe_count  # now ours to close
        elif mode is DataMode.PUNCH:
            if not offer.punch_ports or len(reply.punch_ports) != layout.stripe_count:
                raise RemoteProtocolError("receiver chose PUNCH without a port per stripe")
            assert ip is not None
            socks = await _punch_as_sender(
                stream,
                ip,
                punch_socks,
                reply.punch_ports,
                key,
                offer.transfer_id,
                layout,
                config,
            )
            if socks is None:
                mode = DataMode.STREAM

    if socks is not None:

        async def send_one(stripe: int, sock: trio.socket.SocketType) -> None:
            await _send_stripe(sock, BulkSender(key, layout, stripe), source, config.idle_timeout_s)

        try:
            await _run_stripes(socks, send_one)
        except (OSError, trio.TooSlowError) as exc:
            # The receiver usually closed on us because it found something wrong: get its reason.
            verdict: ControlMessage | None = None
            with trio.move_on_after(1.0):
                try:
                    verdict = await _read_control(stream, None)
                except Exception as read_exc:
                    log.debug("no verdict from the receiver: %r", read_exc)
            if isinstance(verdict, Outcome) and not verdict.ok:
                raise RemoteError("transfer_failed", verdict.reason) from exc
            raise _io_failure("sending bulk data", exc) from None
    else:
        await _send_on_stream(stream, source, config)

    outcome = await _read_control(stream, config.idle_timeout_s)
    if not isinstance(outcome, Outcome):
        raise RemoteProtocolError(f"expected Outcome, got {type(outcome).__name__}")
    if not outcome.ok:
        raise RemoteError("transfer_failed", outcome.reason)
    return mode


async def _send_on_stream(stream: ByteStream, source: memoryview, config: BulkConfig) -> None:
    chunk = config.stream_chunk_bytes
    with _stream_errors("sending on the libp2p stream"):
        for offset in range(0, len(source), chunk):
            with trio.fail_after(config.idle_timeout_s):
                await stream.write(bytes(source[offset : offset + chunk]))


async def receive_bulk(
    stream: ByteStream,
    *,
    direct: bool,
    listener: BulkListener | None = None,
    config: BulkConfig = DEFAULT_CONFIG,
    check_meta: Callable[[bytes, int], None] | None = None,
    into: bytearray | None = None,
    peer_ids: tuple[bytes, bytes] | None = None,
    remote_ip: str | None = None,
) -> BulkReceived:
    """Receive one transfer that the peer at the other end of ``stream`` sends with
    ``send_bulk``. The caller owns ``stream`` and closes it.

    ``listener``: ours, where the sender should dial (preferred over dialing the sender's).
    ``check_meta(meta, total_bytes)`` runs before the payload is allocated; it raises
    ``RemoteProtocolError`` to refuse. ``into``: a buffer to receive into (it must be exactly
    ``total_bytes`` long, else the offer is refused) instead of a fresh one. Returns
    ``BulkReceived`` with every byte authenticated.
    Raises ``RemoteProtocolError`` (malformed, tampered, truncated or oversized input; the sender
    is told why), ``BulkTransferFailed`` (timeout, lost connection, failed dial).
    """
    local_id, remote_id = peer_ids or _peer_ids(stream)
    offer = await _read_control(stream, config.control_timeout_s)
    if not isinstance(offer, Offer):
        raise RemoteProtocolError(f"expected Offer, got {type(offer).__name__}")
    try:
        if offer.total_bytes > config.max_bytes:
            raise RemoteProtocolError(
                f"offer of {offer.total_bytes} bytes exceeds our limit {config.max_bytes}"
            )
        if check_meta is not None:
            check_meta(offer.meta, offer.total_bytes)
        if listener is not None and listener.is_pending(offer.transfer_id):
            raise RemoteProtocolError("transfer id already in use")
        if into is not None and len(into) != offer.total_bytes:
            raise RemoteProtocolError(f"offer of {offer.total_bytes} bytes, expected {len(into)}")
    except RemoteProtocolError as exc:
        await _write_control(stream, Reject(str(exc)[:200]), config.control_timeout_s)
        raise

    share = os.urandom(32)
    key = derive_session_key(
        sender_share=offer.share,
        receiver_share=share,
        sender_peer_id=remote_id,
        receiver_peer_id=local_id,
        transfer_id=offer.transfer_id,
    )
    layout = offer.layout
    dest = into if into is not None else bytearray(offer.total_bytes)
    ip = remote_ip or _remote_ip(stream)
    punch_socks: list[trio.socket.SocketType] = []
    if not (direct and offer.direct):
        mode = DataMode.STREAM
    elif listener is not None and listener.port:
        mode = DataMode.DIAL_RECEIVER
    elif offer.listen_port:
        mode = DataMode.DIAL_SENDER
    elif offer.punch_ports and ip is not None:
        try:
            punch_socks = await _open_punch_ports(ip, layout.stripe_count)
            mode = DataMode.PUNCH
        except OSError as exc:
            log.warning("cannot open bulk punch ports (%r); using the libp2p stream", exc)
            mode = DataMode.STREAM
    else:
        mode = DataMode.STREAM
    accept = Accept(
        share,
        mode,
        listener.port if mode is DataMode.DIAL_RECEIVER else 0,  # type: ignore[union-attr]
        tuple(sock.getsockname()[1] for sock in punch_socks),
    )

    try:
        socks: list[trio.socket.SocketType | None] | None = None
        if mode is DataMode.DIAL_RECEIVER:
            assert listener is not None
            # Register before answering, so a fast sender's connection finds its transfer.
            with listener.expect(offer.transfer_id, layout.stripe_count, key) as pending:
                await _write_control(stream, accept, config.control_timeout_s)
                arrived = await _await_connections(pending, stream, config)
                if isinstance(arrived, Fallback):
                    log.warning(
                        "sender could not dial us (%s); using the libp2p stream", arrived.reason
                    )
                    mode = DataMode.STREAM
                else:
                    socks = list(arrived)
                    pending.socks = [None] * layout.stripe_count
        elif mode is DataMode.PUNCH:
            assert ip is not None
            try:
                await _write_control(stream, accept, config.control_timeout_s)
                punched = await _punch_as_receiver(
                    stream,
                    ip,
                    punch_socks,
                    offer.punch_ports,
                    key,
                    offer.transfer_id,
                    layout,
                    config,
                )
            finally:
                _close_all(list(punch_socks))
            if isinstance(punched, Fallback):
                log.warning(
                    "punch with the sender failed (%s); using the libp2p stream", punched.reason
                )
                mode = DataMode.STREAM
            else:
                socks = list(punched)
        else:
            await _write_control(stream, accept, config.control_timeout_s)
            if mode is DataMode.DIAL_SENDER:
                socks = await _dial_or_fall_back(
                    stream, remote_ip, offer.listen_port, key, offer.transfer_id, layout, config
                )
                if socks is None:
                    mode = DataMode.STREAM

        if socks is not None:

            async def receive_one(stripe: int, sock: trio.socket.SocketType) -> None:
                await _receive_stripe(
                    sock, BulkReceiver(key, layout, stripe), dest, config.idle_timeout_s
                )

            try:
                await _run_stripes(socks, receive_one)
            except (OSError, trio.TooSlowError) as exc:
                raise _io_failure("receiving bulk data", exc) from None
        else:
            await _receive_on_stream(stream, dest, config)
    except (RemoteProtocolError, BulkTransferFailed) as exc:
        with trio.move_on_after(config.control_timeout_s):
            try:
                await stream.write(encode_control(Outcome(False, str(exc)[:200])))
            except Exception as write_exc:
                log.debug("could not tell the sender why: %r", write_exc)
        raise
    await _write_control(stream, Outcome(True), config.control_timeout_s)
    return BulkReceived(offer.meta, dest, mode)


async def _receive_on_stream(stream: ByteStream, dest: bytearray, config: BulkConfig) -> None:
    view = memoryview(dest)
    got = 0
    with _stream_errors("receiving on the libp2p stream"):
        while got < len(dest):
            with trio.fail_after(config.idle_timeout_s):
                want = min(len(dest) - got, config.stream_chunk_bytes)
                try:
                    chunk = await stream.read(want)
                except Exception as exc:
                    if type(exc).__name__ != "StreamEOF":
                        raise
                    chunk = b""
            if not chunk:
                raise RemoteProtocolError(f"stream ended after {got} of {len(dest)} bytes")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)


# ---------------------------------------------------------------------------------------------
# Tensors: (dtype from the allow-list in ``p2p.tensors``, shape, little-endian raw bytes)


def _check_tensor_meta(meta: bytes, total_bytes: int) -> None:
    """Runs before allocation: an allowed dtype, and ``prod(shape) * itemsize == total_bytes``
    (``TensorHeader`` validates the first equation, we the second)."""

    try:
        header = decode(meta, TensorHeader)
    except (ValueError, TypeError) as exc:
        raise RemoteProtocolError(f"bad tensor header: {exc}") from None
    if header.nbytes != total_bytes:
        raise RemoteProtocolError("tensor header disagrees with the transfer size")


async def send_array(stream: ByteStream, array: Any, **kwargs: Any) -> DataMode:
    """Send a numpy array as (dtype from the allow-list, shape, little-endian bytes).

    Same keyword arguments, return value and exceptions as ``send_bulk`` (``meta`` excepted).
    Raises ``ValueError`` for a dtype outside the allow-list.
    """

    meta = encode(header_for(array))
    return await send_bulk(stream, as_wire_bytes(array), meta=meta, **kwargs)


async def receive_array(stream: ByteStream, **kwargs: Any) -> Any:
    """Receive an array sent with ``send_array``; returns a writable numpy array.

    The header (allowed dtype, shape, ``prod(shape) * itemsize == total bytes``) is checked before
    the payload is allocated. Same keyword arguments and exceptions as ``receive_bulk``.
    """

    received = await receive_bulk(stream, check_meta=_check_tensor_meta, **kwargs)
    return from_wire_bytes(decode(received.meta, TensorHeader), received.data)


async def send_tensor(stream: ByteStream, tensor: Any, **kwargs: Any) -> DataMode:
    """Send a torch tensor (CPU or not; bfloat16 included). Same contract as ``send_array``."""
    import torch

    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        # numpy has no bfloat16: its bytes travel as uint16 under the name "bfloat16".
        array = tensor.view(torch.uint16).numpy()
        header = TensorHeader("bfloat16", list(array.shape), array.nbytes, DEFAULT_FRAME_BYTES)
    else:
        array = tensor.numpy()
        header = header_for(array)
    return await send_bulk(stream, as_wire_bytes(array), meta=encode(header), **kwargs)


async def receive_tensor(stream: ByteStream, **kwargs: Any) -> Any:
    """Receive a tensor sent with ``send_tensor`` (or an array sent with ``send_array``) as a
    CPU torch tensor sharing the received buffer. Same contract as ``receive_array``."""
    import torch

    if sys.byteorder != "little":
        raise LocalProtocolError(
            "torch.frombuffer of little-endian bytes needs a little-endian host"
        )
    received = await receive_bulk(stream, check_meta=_check_tensor_meta, **kwargs)
    header = decode(received.meta, TensorHeader)
    dtype = torch.bfloat16 if header.dtype == "bfloat16" else getattr(torch, header.dtype)
    if not received.data:  # frombuffer refuses an empty buffer
        return torch.empty(header.shape, dtype=dtype)
    return torch.frombuffer(received.data, dtype=dtype).reshape(header.shape)
