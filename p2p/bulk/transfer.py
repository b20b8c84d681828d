"""Bulk data plane, the pieces every part shares: ``BulkConfig``, ``BulkTransferFailed``, socket
and control-stream helpers, and the loops that move the bytes (over data connections, one per
stripe, or over the libp2p stream). ``p2p.bulk.payload`` (one payload) and ``p2p.bulk.channel``
(many) have the entry points.

Concurrency
-----------
AEAD runs inline on the trio thread: a 1 MiB frame takes about 0.4 ms here, too short to stall
heartbeats, and a worker-thread hop per frame cannot buy CPU on a 2-core box where sender and
receiver already keep both cores busy (measuring it here was lost in other jobs' load). Every
wait is bounded: control messages by ``control_timeout_s``, dials and the arrival of data
connections by ``connect_timeout_s``, each frame's progress by ``idle_timeout_s``, a connection's
hello by the listener's ``hello_timeout_s``; at most ``max_unauthenticated`` connections may be
waiting for their hello at once (more are closed at accept), so a flood cannot pile up sockets.

Memory against any sender
-------------------------
A receive buffer is anonymous memory the kernel maps on first write (``lazy_buffer``): an offer
of 64 MiB held open costs nothing until its bytes arrive (a zero-filled ``bytearray`` of the
offered size cost the whole size at once: 16 offers held open took a process from 389 to 1413
MiB). A trickle cannot hold a transfer open either: ``idle_timeout_s`` bounds each frame, and
the whole payload must arrive by ``rate_grace_s + size / min_rate_bytes_per_s``
(``progress_deadline``), which no byte resets. Callers that accept offers from anyone bound
how many run at once and how many bytes they may take with a ``ReceiveBudget``.
"""

from __future__ import annotations

import mmap
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio

from p2p.bulk.control import ControlMessage, control_limit, decode_control, encode_control
from p2p.bulk.frames import (
    DEFAULT_FRAME_BYTES,
    FRAME_HEADER_BYTES,
    BulkReceiver,
    BulkSender,
    TransferLayout,
)
from p2p.errors import P2PError, RemoteProtocolError
from p2p.wire import Message, read_frame

M = TypeVar("M", bound=Message)


class BulkTransferFailed(P2PError):
    """A transfer could not complete: a timeout, a lost connection, or a dial that failed."""


class ReceiveBudget:
    """Receptions at once and bytes they may take, per peer and in all (sans-IO accounting).

    ``reserve`` raises ``RemoteProtocolError`` (the sender is told it is busy) rather than
    queueing: a sender that is refused tries later, where a queue would hold its stream open.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        max_transfers: int,
        max_bytes_per_peer: int,
        max_transfers_per_peer: int = 1,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_transfers = max_transfers
        self.max_bytes_per_peer = max_bytes_per_peer
        self.max_transfers_per_peer = max_transfers_per_peer
        self.bytes = 0
        self.transfers = 0
        self.refused = 0
        self._peers: dict[str, list[int]] = {}  # peer -> [transfers, bytes]

    def reserve(self, peer: str, nbytes: int) -> None:
        held = self._peers.get(peer, [0, 0])
        if (
            self.transfers + 1 > self.max_transfers
            or self.bytes + nbytes > self.max_bytes
            or held[0] + 1 > self.max_transfers_per_peer
            or held[1] + nbytes > self.max_bytes_per_peer
        ):
            self.refused += 1
            raise RemoteProtocolError("busy: too many transfers in progress, try later")
        self._peers[peer] = [held[0] + 1, held[1] + nbytes]
        self.transfers += 1
        self.bytes += nbytes

    def release(self, peer: str, nbytes: int) -> None:
        held = self._peers[peer]
        held[0] -= 1
        held[1] -= nbytes
        if held[0] <= 0:
            del self._peers[peer]
        self.transfers -= 1
        self.bytes -= nbytes


def lazy_buffer(nbytes: int) -> bytearray | memoryview:
    """A writable zeroed buffer of ``nbytes`` whose pages the kernel maps as they are written."""
    if nbytes == 0:
        return bytearray()
    return memoryview(mmap.mmap(-1, nbytes))


def progress_deadline(config: BulkConfig, nbytes: int) -> float:
    """When a payload of ``nbytes`` that starts now must have arrived (trio time)."""
    return trio.current_time() + config.rate_grace_s + nbytes / config.min_rate_bytes_per_s


def too_slow(config: BulkConfig, nbytes: int) -> BulkTransferFailed:
    return BulkTransferFailed(
        f"{nbytes} bytes did not arrive within {config.rate_grace_s:g} s + "
        f"{config.min_rate_bytes_per_s / 1024:g} KiB/s"
    )


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
    # A payload arrives whole by rate_grace_s + size / min_rate_bytes_per_s (0.5 Mbit/s: a
    # volunteer's slowest link), whatever pace its bytes keep.
    min_rate_bytes_per_s: float = 64 << 10
    rate_grace_s: float = 30.0

    def __post_init__(self) -> None:
        TransferLayout(0, self.frame_bytes, self.stripes)
        if not 0 < self.stream_chunk_bytes <= 16 << 20:
            raise ValueError("stream_chunk_bytes out of range")


DEFAULT_CONFIG = BulkConfig()


# ---------------------------------------------------------------------------------------------
# Socket and stream helpers


async def send_all(sock: trio.socket.SocketType, data: memoryview) -> None:
    sent = 0
    while sent < len(data):
        sent += await sock.send(data[sent:])


async def recv_into_exactly(sock: trio.socket.SocketType, view: memoryview) -> int:
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


async def write_control(stream: ByteStream, message: ControlMessage, timeout_s: float) -> None:
    """Send one control message within ``timeout_s``; raises ``BulkTransferFailed`` (or
    ``StreamEnded``) if the stream fails or stalls."""
    with _stream_errors(f"sending {type(message).__name__}"), trio.fail_after(timeout_s):
        await stream.write(encode_control(message))


async def read_control(stream: ByteStream, timeout_s: float | None, *expected: type[M]) -> M:
    """Read one control message of the ``expected`` types (one at least), its length checked
    against their largest limit before the body is read. ``timeout_s`` None: only for reads
    raced inside a scope that has a deadline. Raises ``RemoteProtocolError`` (malformed,
    oversized or unexpected), ``StreamEnded``, ``BulkTransferFailed`` (stalled, broken)."""
    with (
        _stream_errors("reading a control message"),
        trio.fail_after(timeout_s) if timeout_s is not None else nullcontext(),
    ):
        payload = await read_frame(stream, control_limit(*expected))
        return decode_control(payload, *expected)  # type: ignore[return-value]


def peer_ids_of(stream: Any) -> tuple[bytes, bytes]:
    """(local, remote) peer id bytes of a libp2p ``NetStream``."""
    secured = stream.muxed_conn.secured_conn
    return secured.get_local_peer().to_bytes(), secured.get_remote_peer().to_bytes()


def remote_ip_of(stream: Any) -> str | None:
    try:
        address = stream.get_remote_address()
    except Exception:
        return None
    return address[0] if address else None


def address_family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def close_all(socks: list[trio.socket.SocketType | None]) -> None:
    for sock in socks:
        if sock is not None:
            sock.close()


# ---------------------------------------------------------------------------------------------
# Moving the bytes


async def send_stripe(
    sock: trio.socket.SocketType, sender: BulkSender, source: memoryview, idle_timeout_s: float
) -> None:
    out = bytearray(sender.layout.frame_buffer_bytes)
    while (frame := sender.next_frame(source, out)) is not None:
        with trio.fail_after(idle_timeout_s):
            await send_all(sock, frame)


async def receive_stripe(
    sock: trio.socket.SocketType,
    receiver: BulkReceiver,
    dest: bytearray | memoryview,
    idle_timeout_s: float,
) -> None:
    header = bytearray(FRAME_HEADER_BYTES)
    body = memoryview(bytearray(receiver.layout.frame_buffer_bytes))
    while not receiver.done:
        with trio.fail_after(idle_timeout_s):
            if await recv_into_exactly(sock, memoryview(header)) < FRAME_HEADER_BYTES:
                receiver.receive_eof()
            body_len = receiver.receive_header(header)
            if await recv_into_exactly(sock, body[:body_len]) < body_len:
                receiver.receive_eof()
        receiver.receive_body(body[:body_len], dest)


async def run_stripes(
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
        leaf = first_leaf(group)
        raise leaf from None
    finally:
        close_all(socks)


def first_leaf(group: BaseExceptionGroup) -> BaseException:
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


def io_failure(what: str, exc: BaseException) -> BulkTransferFailed:
    if isinstance(exc, trio.TooSlowError):
        return BulkTransferFailed(f"{what}: stalled past the idle timeout")
    return BulkTransferFailed(f"{what}: {exc!r}")


async def send_on_stream(stream: ByteStream, source: memoryview, config: BulkConfig) -> None:
    chunk = config.stream_chunk_bytes
    with _stream_errors("sending on the libp2p stream"):
        for offset in range(0, len(source), chunk):
            with trio.fail_after(config.idle_timeout_s):
                await stream.write(bytes(source[offset : offset + chunk]))


async def receive_on_stream(
    stream: ByteStream, dest: bytearray | memoryview, config: BulkConfig
) -> None:
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
