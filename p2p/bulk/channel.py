"""Bulk data plane: ``BulkChannel``, payloads sent back to back over one negotiated data
connection, and its two ends (``open_channel``, ``accept_channel``).

The negotiation is the one-shot payload's (``p2p.bulk.link``, with ``CHANNEL_META`` marking the
offer); what differs is after it: the acceptor confirms the data connection with a ready byte,
each payload's frames are sealed under a key of its own, and there is no ``Outcome``. The
channel can also pace its connection (``limit_rate``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
from dataclasses import replace

import trio

from p2p.bulk.control import CHANNEL_META, Offer, Reject
from p2p.bulk.frames import BulkReceiver, BulkSender, TransferLayout
from p2p.bulk.link import Link, connect_as_receiver, connect_as_sender
from p2p.bulk.listener import BulkListener
from p2p.bulk.transfer import (
    DEFAULT_CONFIG,
    BulkConfig,
    ByteStream,
    close_all,
    io_failure,
    progress_deadline,
    read_control,
    receive_on_stream,
    receive_stripe,
    recv_into_exactly,
    send_all,
    send_on_stream,
    send_stripe,
    too_slow,
    write_control,
)
from p2p.errors import LocalProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)

# Linux's SO_MAX_PACING_RATE (include/uapi/asm-generic/socket.h); Python does not name it.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
# Congestion controls for a paced channel, in order of preference (``BulkChannel.limit_rate``):
# loss-based ones, which run at the cap. Linux lets unprivileged processes choose reno and the
# system default (net.ipv4.tcp_allowed_congestion_control).
PACED_CONGESTION_CONTROL = ("cubic", "reno")

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

    def __init__(self, stream: ByteStream, link: Link, config: BulkConfig) -> None:
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
            await send_on_stream(self.stream, source, self._config)
        else:
            sender = BulkSender(self._item_key(index), self._layout(len(source)), 0)
            try:
                await send_stripe(self._sock, sender, source, self._config.idle_timeout_s)
            except (OSError, trio.TooSlowError) as exc:
                raise io_failure("sending on the bulk channel", exc) from None
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
                await receive_on_stream(self.stream, dest, self._config)
            else:
                receiver = BulkReceiver(self._item_key(index), self._layout(len(dest)), 0)
                try:
                    await receive_stripe(self._sock, receiver, dest, self._config.idle_timeout_s)
                except (OSError, trio.TooSlowError) as exc:
                    raise io_failure("receiving on the bulk channel", exc) from None
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
    link = await connect_as_sender(
        stream, 0, 1, CHANNEL_META, direct, listener, config, peer_ids, remote_ip
    )
    if link.socks is not None:
        sock = link.socks[0]
        assert sock is not None
        ready = bytearray(len(_READY))
        try:
            with trio.fail_after(config.control_timeout_s):
                got = await recv_into_exactly(sock, memoryview(ready))
        except (OSError, trio.TooSlowError) as exc:
            close_all(link.socks)
            raise io_failure("opening the bulk channel", exc) from None
        if got != len(_READY) or ready != _READY:
            close_all(link.socks)
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
    offer = await read_control(stream, config.control_timeout_s, Offer)
    reason = None
    if offer.meta != CHANNEL_META or offer.total_bytes or offer.stripe_count != 1:
        reason = "expected a channel offer (its meta, no bytes, one stripe)"
    elif listener is not None and listener.is_pending(offer.transfer_id):
        reason = "transfer id already in use"
    if reason is not None:
        await write_control(stream, Reject(reason), config.control_timeout_s)
        raise RemoteProtocolError(reason)
    link = await connect_as_receiver(stream, offer, direct, listener, config, peer_ids, remote_ip)
    if link.socks is not None:
        # We stopped reading the control stream for a Fallback (connecting does that): only now
        # may the sender write its next message there, so it waits for this byte.
        sock = link.socks[0]
        assert sock is not None
        try:
            with trio.fail_after(config.control_timeout_s):
                await send_all(sock, memoryview(_READY))
        except (OSError, trio.TooSlowError) as exc:
            close_all(link.socks)
            raise io_failure("opening the bulk channel", exc) from None
    return BulkChannel(stream, link, replace(config, frame_bytes=offer.frame_bytes))
