"""Bulk data plane: tensors at close to plain-TCP cost, keyed through the libp2p channel.

A py-libp2p TCP+Noise+yamux stream costs about ten times the CPU per GiB of a plain TCP socket
(DESIGN.md). So a transfer is negotiated on a libp2p stream (authenticated by Noise, giving us the
peer ids and a confidential channel for key shares) and its bytes move over separate TCP
connections as large AES-256-OCB3 frames (``p2p.bulk.frames`` has the format and the reasoning).

The parts: ``p2p.bulk.transfer`` (``BulkConfig``, deadlines, the byte-moving loops),
``p2p.bulk.listener`` (``BulkListener``), ``p2p.bulk.connect`` (who dials whom, NAT, the punch).
This module is the data plane's public face: the two entry points, ``send_bulk`` and
``receive_bulk``, and the tensor helpers over them. It runs past 400 lines because each entry
point walks all four data modes in one function, in protocol order, for its side.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import trio

from p2p.bulk.connect import (
    _await_connections,
    _dial_or_fall_back,
    _open_punch_ports,
    _punch_as_receiver,
    _punch_as_sender,
)
from p2p.bulk.frames import (
    DEFAULT_FRAME_BYTES,
    Accept,
    BulkReceiver,
    BulkSender,
    ControlMessage,
    DataMode,
    Fallback,
    Offer,
    Outcome,
    Reject,
    TransferLayout,
    derive_session_key,
    encode_control,
)
from p2p.bulk.listener import BulkListener
from p2p.bulk.transfer import (
    DEFAULT_CONFIG,
    BulkConfig,
    BulkTransferFailed,
    ByteStream,
    ReceiveBudget,
    _close_all,
    _io_failure,
    _peer_ids,
    _read_control,
    _receive_on_stream,
    _receive_stripe,
    _recv_into_exactly,
    _remote_ip,
    _run_stripes,
    _send_all,
    _send_on_stream,
    _send_stripe,
    _write_control,
    lazy_buffer,
    progress_deadline,
    too_slow,
)
from p2p.errors import LocalProtocolError, RemoteError, RemoteProtocolError
from p2p.tensors import TensorHeader, as_wire_bytes, from_wire_bytes, header_for
from p2p.wire import decode, encode

log = logging.getLogger(__name__)

PROTOCOL = "/swarmtrain/bulk/1"
# Linux's SO_MAX_PACING_RATE (include/uapi/asm-generic/socket.h); Python does not name it.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
# Congestion controls for a paced channel, in order of preference (``BulkChannel.limit_rate``):
# loss-based ones, which run at the cap. Linux lets unprivileged processes choose reno and the
# system default (net.ipv4.tcp_allowed_congestion_control).
PACED_CONGESTION_CONTROL = ("cubic", "reno")


@dataclass(frozen=True, slots=True)
class BulkReceived:
    """What ``receive_bulk`` returns: the sender's ``meta``, the payload, and how it came."""

    meta: bytes
    data: bytearray | memoryview
    mode: DataMode


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
    link = await _connect_as_sender(
        stream, len(source), config.stripes, meta, direct, listener, config, peer_ids, remote_ip
    )
    if link.socks is not None:
        key, layout, socks = link.key, link.layout, link.socks

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
    return link.mode


async def receive_bulk(
    stream: ByteStream,
    *,
    direct: bool,
    listener: BulkListener | None = None,
    config: BulkConfig = DEFAULT_CONFIG,
    check_meta: Callable[[bytes, int], None] | None = None,
    into: bytearray | memoryview | None = None,
    peer_ids: tuple[bytes, bytes] | None = None,
    remote_ip: str | None = None,
    budget: ReceiveBudget | None = None,
) -> BulkReceived:
    """Receive one transfer that the peer at the other end of ``stream`` sends with
    ``send_bulk``. The caller owns ``stream`` and closes it.

    ``listener``: ours, where the sender should dial (preferred over dialing the sender's).
    ``check_meta(meta, total_bytes)`` runs before the payload is allocated; it raises
    ``RemoteProtocolError`` to refuse. ``into``: a writable byte buffer to receive into (exactly
    ``total_bytes`` long, else the offer is refused) instead of a fresh one, which is mapped as
    its bytes arrive (``lazy_buffer``). ``budget``: refuse the offer unless it fits (reserved
    until this returns). The payload must arrive within ``progress_deadline``. Returns
    ``BulkReceived`` with every byte authenticated.
    Raises ``RemoteProtocolError`` (malformed, tampered, truncated or oversized input; the sender
    is told why), ``BulkTransferFailed`` (timeout, lost connection, failed dial).
    """
    offer = await _read_control(stream, config.control_timeout_s)
    if not isinstance(offer, Offer):
        raise RemoteProtocolError(f"expected Offer, got {type(offer).__name__}")
    peer = str(getattr(getattr(stream, "muxed_conn", None), "peer_id", "?"))
    try:
        if offer.total_bytes > config.max_bytes:
            raise RemoteProtocolError(
                f"offer of {offer.total_bytes} bytes exceeds our limit {config.max_bytes}"
            )
        if offer.meta == CHANNEL_META:
            raise RemoteProtocolError("a channel was offered where one transfer was expected")
        if listener is not None and listener.is_pending(offer.transfer_id):
            raise RemoteProtocolError("transfer id already in use")
        if check_meta is not None:
            check_meta(offer.meta, offer.total_bytes)
        if into is not None and len(into) != offer.total_bytes:
            raise RemoteProtocolError(f"offer of {offer.total_bytes} bytes, expected {len(into)}")
        if budget is not None:
            budget.reserve(peer, offer.total_bytes)
    except RemoteProtocolError as exc:
        await _write_control(stream, Reject(str(exc)[:200]), config.control_timeout_s)
        raise
    try:
        return await _receive_offered(
            stream, offer, direct, listener, config, into, peer_ids, remote_ip
        )
    finally:
        if budget is not None:
            budget.release(peer, offer.total_bytes)


async def _receive_offered(
    stream: ByteStream,
    offer: Offer,
    direct: bool,
    listener: BulkListener | None,
    config: BulkConfig,
    into: bytearray | memoryview | None,
    peer_ids: tuple[bytes, bytes] | None,
    remote_ip: str | None,
) -> BulkReceived:
    dest = into if into is not None else lazy_buffer(offer.total_bytes)
    try:
        with trio.move_on_at(progress_deadline(config, offer.total_bytes)) as slow:
            link = await _connect_as_receiver(
                stream, offer, direct, listener, config, peer_ids, remote_ip
            )
            if link.socks is not None:
                key, layout = link.key, link.layout

                async def receive_one(stripe: int, sock: trio.socket.SocketType) -> None:
                    await _receive_stripe(
                        sock, BulkReceiver(key, layout, stripe), dest, config.idle_timeout_s
                    )

                try:
                    await _run_stripes(link.socks, receive_one)
                except (OSError, trio.TooSlowError) as exc:
                    raise _io_failure("receiving bulk data", exc) from None
            else:
                await _receive_on_stream(stream, dest, config)
        if slow.cancelled_caught:
            raise too_slow(config, offer.total_bytes)
    except (RemoteProtocolError, BulkTransferFailed) as exc:
        with trio.move_on_after(config.control_timeout_s):
            try:
                await stream.write(encode_control(Outcome(False, str(exc)[:200])))
            except Exception as write_exc:
                log.debug("could not tell the sender why: %r", write_exc)
        raise
    await _write_control(stream, Outcome(True), config.control_timeout_s)
    return BulkReceived(offer.meta, dest, link.mode)


# ---------------------------------------------------------------------------------------------
# Channels: many payloads, one negotiation


CHANNEL_META = b"swarmtrain/bulk-channel/1"
_READY = b"\x01"
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut its side down


class BulkChannel:
    """Payloads sent back to back over one negotiated data connection, in order.

    ``send_bulk`` pays a negotiation (offer, accept, dial: two to three round trips), a fresh
    TCP connection (slow start) and a confirmation round trip per payload; on a 50 ms link that
    idles each pair for most of a second per payload. A channel pays them once: afterwards a
    payload is frames on a warm connection, and the next one follows without waiting. Both ends
    count payloads, and each payload's frames are sealed under its own key (derived from the
    channel key and its index), so frames cannot be replayed or moved between payloads; its END
    frame checks its length. Over a relayed connection the payloads ride the libp2p stream.

    There is no per-payload confirmation: the caller's own protocol says when the receiver has
    what it needs. ``send``/``receive`` must each be called from one task at a time. Raises as
    ``send_bulk`` / ``receive_bulk`` do; after any error the channel is unusable (close it).

    A channel over a data connection outlives the stream it was negotiated on, so a caller may
    keep it for later payloads (``swarm``'s all-reduce keeps one per pair across rounds): both
    ends know it by ``channel_id`` and count its payloads (``payloads_sent``,
    ``payloads_received``); the next payload's key follows from that count, so the two ends must
    agree on it before using a kept channel, and ``reusable`` says whether this end is intact.
    """

    def __init__(self, stream: ByteStream, link: _Link, config: BulkConfig) -> None:
        self.stream = stream
        self.mode = link.mode
        self.channel_id = link.transfer_id
        self._key = link.key
        self._sock = None if link.socks is None else link.socks[0]
        self._config = config
        self._sent = 0
        self._received = 0
        self._broken = False
        self._loss_based = False

    def _item_key(self, index: int) -> bytes:
        return hmac.new(self._key, b"item" + index.to_bytes(8, "big"), hashlib.sha256).digest()

    def _layout(self, nbytes: int) -> TransferLayout:
        return TransferLayout(nbytes, self._config.frame_bytes, 1)

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send one payload; returns when its last byte is handed to the connection."""
        source = memoryview(data).cast("B")
        self._check()
        index, self._sent = self._sent, self._sent + 1
        self._broken = True  # until the payload is out whole
        if self._sock is None:
            await _send_on_stream(self.stream, source, self._config)
        else:
            sender = BulkSender(self._item_key(index), self._layout(len(source)), 0)
            try:
                await _send_stripe(self._sock, sender, source, self._config.idle_timeout_s)
            except (OSError, trio.TooSlowError) as exc:
                raise _io_failure("sending on the bulk channel", exc) from None
        self._broken = False

    async def receive(self, into: bytearray | memoryview) -> None:
        """Receive the next payload into ``into``, which must be exactly its length (the
        caller learned it from its own protocol and checked it before allocating)."""
        dest = memoryview(into).cast("B")
        self._check()
        index, self._received = self._received, self._received + 1
        self._broken = True
        with trio.move_on_at(progress_deadline(self._config, len(dest))) as slow:
            if self._sock is None:
                await _receive_on_stream(self.stream, dest, self._config)
            else:
                receiver = BulkReceiver(self._item_key(index), self._layout(len(dest)), 0)
                try:
                    await _receive_stripe(self._sock, receiver, dest, self._config.idle_timeout_s)
                except (OSError, trio.TooSlowError) as exc:
                    raise _io_failure("receiving on the bulk channel", exc) from None
        if slow.cancelled_caught:
            raise too_slow(self._config, len(dest))
        self._broken = False

    def limit_rate(self, bytes_per_s: float) -> bool:
        """Cap this channel's sending rate (the kernel paces the TCP connection: Linux's
        ``SO_MAX_PACING_RATE``). Several senders into one receiver each paced at their share of
        its link never overflow its queue, where unpaced flows lose packets and back off (TCP
        incast). Returns False where it cannot pace (a relayed channel rides the libp2p stream;
        a platform without the option).

        A paced connection also leaves BBR for a loss-based congestion control
        (``PACED_CONGESTION_CONTROL``, the first the kernel allows): under a cap BBR still
        cycles its pacing gain, a round trip at 0.75 in every eight, so it averages about 3%
        below the cap, where a loss-based one whose window never binds runs at the cap itself
        (bench.allreduce_netlab, 4 peers at 100 Mbit/s: 13.30 s with BBR, 13.08 s with cubic)."""
        if self._sock is None or not bytes_per_s > 0:
            return False
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(bytes_per_s))
        except OSError as exc:
            log.debug("cannot pace the bulk channel: %s", exc)
            return False
        if not self._loss_based:
            for name in PACED_CONGESTION_CONTROL:
                try:
                    self._sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, name.encode())
                except OSError as exc:  # not built, or not allowed to unprivileged processes
                    log.debug("congestion control %s refused: %s", name, exc)
                    continue
                self._loss_based = True
                break
        return True

    @property
    def closed(self) -> bool:
        """``close`` was called (or the channel rides a stream and failed)."""
        return self._sock is None and self._broken

    @property
    def payloads_sent(self) -> int:
        return self._sent

    @property
    def payloads_received(self) -> int:
        return self._received

    def reusable(self) -> bool:
        """Whether a later payload may use this channel: it has a data connection of its own
        (a relayed channel rides the stream it was negotiated on), no payload failed or stopped
        halfway, and the connection holds nothing unread, no end and no error. Between payloads
        neither side writes (the acceptor's ready byte comes before the first one), so anything
        readable means the peer closed it or something is left over: either way not reusable."""
        if self._broken or self._sock is None:
            return False
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN | select.POLLPRI | _POLLRDHUP)
        return not poller.poll(0)

    def _check(self) -> None:
        if self._broken:
            raise LocalProtocolError("the bulk channel failed earlier; close it")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._broken = True


async def open_channel(
    stream: ByteStream,
    *,
    direct: bool,
    listener: BulkListener | None = None,
    config: BulkConfig = DEFAULT_CONFIG,
    peer_ids: tuple[bytes, bytes] | None = None,
    remote_ip: str | None = None,
) -> BulkChannel:
    """The sending end of a ``BulkChannel`` to the peer running ``accept_channel`` on ``stream``
    (arguments as ``send_bulk``'s). Raises ``RemoteError`` if the peer refuses."""
    link = await _connect_as_sender(
        stream, 0, 1, CHANNEL_META, direct, listener, config, peer_ids, remote_ip
    )
    if link.socks is not None:
        sock = link.socks[0]
        assert sock is not None
        ready = bytearray(len(_READY))
        try:
            with trio.fail_after(config.control_timeout_s):
                got = await _recv_into_exactly(sock, memoryview(ready))
        except (OSError, trio.TooSlowError) as exc:
            _close_all(link.socks)
            raise _io_failure("opening the bulk channel", exc) from None
        if got != len(_READY) or ready != _READY:
            _close_all(link.socks)
            raise RemoteProtocolError("the receiver did not confirm the bulk channel")
    return BulkChannel(stream, link, config)


async def accept_channel(
    stream: ByteStream,
    *,
    direct: bool,
    listener: BulkListener | None = None,
    config: BulkConfig = DEFAULT_CONFIG,
    peer_ids: tuple[bytes, bytes] | None = None,
    remote_ip: str | None = None,
) -> BulkChannel:
    """The receiving end of a channel the peer opens with ``open_channel`` on ``stream``."""
    offer = await _read_control(stream, config.control_timeout_s)
    if not isinstance(offer, Offer):
        raise RemoteProtocolError(f"expected Offer, got {type(offer).__name__}")
    reason = None
    if offer.meta != CHANNEL_META or offer.total_bytes or offer.stripe_count != 1:
        reason = "expected a channel offer (its meta, no bytes, one stripe)"
    elif listener is not None and listener.is_pending(offer.transfer_id):
        reason = "transfer id already in use"
    if reason is not None:
        await _write_control(stream, Reject(reason), config.control_timeout_s)
        raise RemoteProtocolError(reason)
    link = await _connect_as_receiver(stream, offer, direct, listener, config, peer_ids, remote_ip)
    if link.socks is not None:
        # We stopped reading the control stream for a Fallback (connecting does that): only now
        # may the sender write its next message there, so it waits for this byte.
        sock = link.socks[0]
        assert sock is not None
        try:
            with trio.fail_after(config.control_timeout_s):
                await _send_all(sock, memoryview(_READY))
        except (OSError, trio.TooSlowError) as exc:
            _close_all(link.socks)
            raise _io_failure("opening the bulk channel", exc) from None
    return BulkChannel(stream, link, replace(config, frame_bytes=offer.frame_bytes))


# ---------------------------------------------------------------------------------------------
# Negotiation: who connects to whom, shared by transfers and channels


@dataclass(slots=True)
class _Link:
    """A negotiated data path: its key, mode, and connections (None: the libp2p stream)."""

    key: bytes
    layout: TransferLayout
    mode: DataMode
    socks: list[trio.socket.SocketType | None] | None
    transfer_id: bytes = b""


async def _connect_as_sender(
    stream: ByteStream,
    total_bytes: int,
    stripes: int,
    meta: bytes,
    direct: bool,
    listener: BulkListener | None,
    config: BulkConfig,
    peer_ids: tuple[bytes, bytes] | None,
    remote_ip: str | None,
) -> _Link:
    """Offer, read the answer, and connect the way the receiver chose (walks all four modes)."""
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
                punch_socks = await _open_punch_ports(ip, stripes)
            except OSError as exc:
                log.warning("cannot open bulk punch ports (%r): not offering a punch", exc)
            registration.callback(_close_all, list(punch_socks))
        offer = Offer(
            os.urandom(16),
            total_bytes,
            config.frame_bytes,
            stripes,
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
        elif mode is DataMode.DIAL_SENDER:
            if pending is None:
                raise RemoteProtocolError("receiver chose DIAL_SENDER but we offered no listener")
            pending.set_key(key)
            arrived = await _await_connections(pending, stream, config)
            if isinstance(arrived, Fallback):
                log.warning(
                    "receiver could not dial us (%s); using the libp2p stream", arrived.reason
                )
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
    return _Link(
        key, layout, mode if socks is not None else DataMode.STREAM, socks, offer.transfer_id
    )


async def _connect_as_receiver(
    stream: ByteStream,
    offer: Offer,
    direct: bool,
    listener: BulkListener | None,
    config: BulkConfig,
    peer_ids: tuple[bytes, bytes] | None,
    remote_ip: str | None,
) -> _Link:
    """Choose the data mode for ``offer``, answer, and connect (walks all four modes)."""
    local_id, remote_id = peer_ids or _peer_ids(stream)
    share = os.urandom(32)
    key = derive_session_key(
        sender_share=offer.share,
        receiver_share=share,
        sender_peer_id=remote_id,
        receiver_peer_id=local_id,
        transfer_id=offer.transfer_id,
    )
    layout = offer.layout
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
        else:
            socks = list(punched)
    else:
        await _write_control(stream, accept, config.control_timeout_s)
        if mode is DataMode.DIAL_SENDER:
            socks = await _dial_or_fall_back(
                stream, remote_ip, offer.listen_port, key, offer.transfer_id, layout, config
            )
    return _Link(
        key, layout, mode if socks is not None else DataMode.STREAM, socks, offer.transfer_id
    )


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
