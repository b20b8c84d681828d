"""Bulk data plane: the negotiated data path (``Link``) and the two drivers that negotiate it.

``connect_as_sender`` and ``connect_as_receiver`` carry out one side each of the conversation in
``p2p.bulk.control`` (offer, answer, connect): they gather the facts, ask ``p2p.bulk.negotiate``
what to offer, which mode to choose or whether the peer's choice is legal, open what that mode
needs (``p2p.bulk.connect``: dial, await the peer's dial, punch) and report the mode the
transfer settled in. Every protocol decision is ``negotiate``'s; these move bytes and sockets.
A one-shot payload (``p2p.bulk.payload``) and a channel (``p2p.bulk.channel``) share them.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass

import trio

from p2p.bulk.connect import (
    await_connections,
    dial_or_fall_back,
    open_punch_ports,
    punch_as_receiver,
    punch_as_sender,
)
from p2p.bulk.control import Accept, Fallback, Offer, Reject
from p2p.bulk.frames import TransferLayout, derive_session_key
from p2p.bulk.listener import BulkListener
from p2p.bulk.negotiate import (
    DataMode,
    ReceiverPaths,
    check_reply,
    choose_mode,
    offer_paths,
    settled_mode,
)
from p2p.bulk.transfer import (
    BulkConfig,
    ByteStream,
    close_all,
    peer_ids_of,
    read_control,
    remote_ip_of,
    write_control,
)
from p2p.errors import RemoteError

log = logging.getLogger(__name__)

Sockets = list[trio.socket.SocketType | None]


@dataclass(slots=True)
class Link:
    """A negotiated data path: its key, layout, the mode it settled in, and its connections, one
    per stripe (None: the payload rides the libp2p stream). The caller owns the sockets."""

    key: bytes
    layout: TransferLayout
    mode: DataMode
    socks: Sockets | None
    transfer_id: bytes = b""


async def connect_as_sender(
    stream: ByteStream,
    total_bytes: int,
    stripes: int,
    meta: bytes,
    direct: bool,
    listener: BulkListener | None,
    config: BulkConfig,
    peer_ids: tuple[bytes, bytes] | None,
    remote_ip: str | None,
) -> Link:
    """Offer, read the answer, and connect the way the receiver chose. Raises ``RemoteError``
    (rejected), ``RemoteProtocolError`` (an illegal answer), ``BulkTransferFailed``."""
    local_id, remote_id = peer_ids or peer_ids_of(stream)
    share = os.urandom(32)
    ip = remote_ip or remote_ip_of(stream)
    paths = offer_paths(
        direct=direct,
        listener_port=listener.port if listener is not None else 0,
        remote_ip_known=ip is not None,
    )
    with ExitStack() as registration:
        # Punch ports are bound before the offer names them.
        punch_socks: list[trio.socket.SocketType] = []
        if paths.punch:
            assert ip is not None
            try:
                punch_socks = await open_punch_ports(ip, stripes)
            except OSError as exc:
                log.warning("cannot open bulk punch ports (%r): not offering a punch", exc)
            registration.callback(close_all, list(punch_socks))
        offer = Offer(
            os.urandom(16),
            total_bytes,
            config.frame_bytes,
            stripes,
            share,
            paths.direct,
            paths.listen_port,
            meta,
            tuple(sock.getsockname()[1] for sock in punch_socks),
        )
        layout = offer.layout
        # Register before offering: the receiver may dial the moment it has answered.
        pending = (
            registration.enter_context(listener.expect(offer.transfer_id, layout.stripe_count))
            if listener is not None and offer.listen_port
            else None
        )
        await write_control(stream, offer, config.control_timeout_s)
        reply = await read_control(stream, config.control_timeout_s, Accept, Reject)
        if isinstance(reply, Reject):
            raise RemoteError("rejected", reply.reason)
        check_reply(
            offer.paths,
            reply.mode,
            stripe_count=layout.stripe_count,
            reply_punch_ports=len(reply.punch_ports),
        )
        key = derive_session_key(
            sender_share=share,
            receiver_share=reply.share,
            sender_peer_id=local_id,
            receiver_peer_id=remote_id,
            transfer_id=offer.transfer_id,
        )
        socks: Sockets | None = None
        if reply.mode is DataMode.DIAL_RECEIVER:
            registration.close()  # nobody will dial us
            socks = await dial_or_fall_back(
                stream, remote_ip, reply.listen_port, key, offer.transfer_id, layout, config
            )
        elif reply.mode is DataMode.DIAL_SENDER:
            assert pending is not None  # check_reply: we offered our listener
            pending.set_key(key)
            arrived = await await_connections(pending, stream, config)
            if isinstance(arrived, Fallback):
                log.warning(
                    "receiver could not dial us (%s); using the libp2p stream", arrived.reason
                )
            else:
                socks = list(arrived)
                pending.socks = [None] * layout.stripe_count  # now ours to close
        elif reply.mode is DataMode.PUNCH:
            assert ip is not None  # check_reply: we offered punch ports
            socks = await punch_as_sender(
                stream, ip, punch_socks, reply.punch_ports, key, offer.transfer_id, layout, config
            )
    mode = settled_mode(reply.mode, connected=socks is not None)
    return Link(key, layout, mode, socks, offer.transfer_id)


async def connect_as_receiver(
    stream: ByteStream,
    offer: Offer,
    direct: bool,
    listener: BulkListener | None,
    config: BulkConfig,
    peer_ids: tuple[bytes, bytes] | None,
    remote_ip: str | None,
) -> Link:
    """Choose the data mode for ``offer``, answer, and connect. Raises ``RemoteProtocolError``
    (the sender broke the protocol), ``BulkTransferFailed``."""
    local_id, remote_id = peer_ids or peer_ids_of(stream)
    share = os.urandom(32)
    key = derive_session_key(
        sender_share=offer.share,
        receiver_share=share,
        sender_peer_id=remote_id,
        receiver_peer_id=local_id,
        transfer_id=offer.transfer_id,
    )
    layout = offer.layout
    ip = remote_ip or remote_ip_of(stream)
    ours = ReceiverPaths(
        direct, listener.port if listener is not None else 0, remote_ip_known=ip is not None
    )
    mode = choose_mode(offer.paths, ours)
    punch_socks: list[trio.socket.SocketType] = []
    if mode is DataMode.PUNCH:
        assert ip is not None
        try:
            punch_socks = await open_punch_ports(ip, layout.stripe_count)
        except OSError as exc:
            mode = choose_mode(offer.paths, ours, failed=(DataMode.PUNCH,))
            log.warning("cannot open bulk punch ports (%r); using %s", exc, mode.name)
    accept = Accept(
        share,
        mode,
        ours.listen_port if mode is DataMode.DIAL_RECEIVER else 0,
        tuple(sock.getsockname()[1] for sock in punch_socks),
    )

    socks: Sockets | None = None
    if mode is DataMode.DIAL_RECEIVER:
        assert listener is not None
        # Register before answering, so a fast sender's connection finds its transfer.
        with listener.expect(offer.transfer_id, layout.stripe_count, key) as pending:
            await write_control(stream, accept, config.control_timeout_s)
            arrived = await await_connections(pending, stream, config)
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
            await write_control(stream, accept, config.control_timeout_s)
            punched = await punch_as_receiver(
                stream, ip, punch_socks, offer.punch_ports, key, offer.transfer_id, layout, config
            )
        finally:
            close_all(list(punch_socks))
        if isinstance(punched, Fallback):
            log.warning(
                "punch with the sender failed (%s); using the libp2p stream", punched.reason
            )
        else:
            socks = list(punched)
    else:
        await write_control(stream, accept, config.control_timeout_s)
        if mode is DataMode.DIAL_SENDER:
            socks = await dial_or_fall_back(
                stream, remote_ip, offer.listen_port, key, offer.transfer_id, layout, config
            )
    mode = settled_mode(mode, connected=socks is not None)
    return Link(key, layout, mode, socks, offer.transfer_id)
