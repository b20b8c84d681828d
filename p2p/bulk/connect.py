"""Bulk data plane: opening the data connections (dialing a listener, awaiting the peer's dial,
or a TCP simultaneous open), with a ``Fallback`` to the libp2p stream when that fails. Which of
them a transfer uses is ``p2p.bulk.negotiate``'s choice, carried out by ``p2p.bulk.link``.

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
"""

from __future__ import annotations

import logging
import socket

import trio

from p2p.bulk.control import Fallback, brief_reason
from p2p.bulk.frames import HELLO_BYTES, Hello, TransferLayout, seal_hello, verify_hello
from p2p.bulk.listener import PendingTransfer
from p2p.bulk.transfer import (
    BulkConfig,
    BulkTransferFailed,
    ByteStream,
    address_family,
    close_all,
    first_leaf,
    read_control,
    recv_into_exactly,
    remote_ip_of,
    send_all,
    write_control,
)
from p2p.errors import RemoteProtocolError

log = logging.getLogger(__name__)


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
                await send_all(sock, memoryview(hello))
    except BaseException:
        close_all(socks)
        raise
    return socks


async def dial_or_fall_back(
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
    ip = remote_ip or remote_ip_of(stream)
    try:
        if ip is None:
            raise OSError("no remote IP for the libp2p connection")
        socks = await _dial(ip, port, key, transfer_id, layout, config.connect_timeout_s)
        return socks
    except (OSError, trio.TooSlowError) as exc:
        log.warning("bulk dial to %s:%d failed (%r); using the libp2p stream", ip, port, exc)
        reason = brief_reason(f"dial failed: {exc!r}")
        await write_control(stream, Fallback(reason), config.control_timeout_s)
        return None


async def await_connections(
    pending: PendingTransfer,
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
        # A dialer that connected writes nothing here, so only a Fallback may come.
        message = await read_control(stream, None, Fallback)
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
        raise first_leaf(group) from None
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


async def open_punch_ports(ip: str, count: int) -> list[trio.socket.SocketType]:
    """One listening socket per stripe on a fresh ephemeral port, for a punch toward ``ip``.

    Listening as well as connecting means the punch also completes when the peer's SYN arrives
    before ours left (loopback, or a NAT that filters only by address). Raises ``OSError``."""
    family = address_family(ip)
    socks: list[trio.socket.SocketType] = []
    try:
        for _ in range(count):
            sock = _punch_socket(family)
            socks.append(sock)
            await sock.bind((_ANY_ADDRESS[family], 0))
            sock.listen(1)
    except BaseException:
        close_all(list(socks))
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


async def punch_as_sender(
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
                await send_all(sock, memoryview(hello))
        return socks
    except BaseExceptionGroup as group:
        close_all(socks)
        leaf = first_leaf(group)
        if not isinstance(leaf, OSError):
            raise leaf from None
        failure: BaseException = leaf
    except (OSError, trio.TooSlowError) as exc:
        close_all(socks)
        failure = exc
    except BaseException:
        close_all(socks)
        raise
    log.warning("bulk punch to %s failed (%r); using the libp2p stream", ip, failure)
    await write_control(
        stream, Fallback(brief_reason(f"punch failed: {failure!r}")), config.control_timeout_s
    )
    return None


async def punch_as_receiver(
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
    pending = PendingTransfer(key, layout.stripe_count, [None] * layout.stripe_count)
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
                    got = await recv_into_exactly(sock, memoryview(data))
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
            arrived = await await_connections(pending, stream, config, config.punch_timeout_s)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        close_all(pending.socks)
        raise first_leaf(group) from None
    except BaseException:
        close_all(pending.socks)
        raise
    if isinstance(arrived, Fallback):
        close_all(pending.socks)
    return arrived
