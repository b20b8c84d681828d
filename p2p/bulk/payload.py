"""Bulk data plane: one payload, negotiated and sent on its own (``send_bulk``/``receive_bulk``),
and the array and tensor helpers over them.

A py-libp2p TCP+Noise+yamux stream costs about ten times the CPU per GiB of a plain TCP socket
(DESIGN.md). So a transfer is negotiated on a libp2p stream (authenticated by Noise, giving us the
peer ids and a confidential channel for key shares) and its bytes move over separate TCP
connections as large AES-256-OCB3 frames (``p2p.bulk.frames`` has the format and the reasoning).

The parts: ``p2p.bulk.control`` (the messages), ``p2p.bulk.negotiate`` (which data connection),
``p2p.bulk.link`` (the negotiation's drivers), ``p2p.bulk.transfer`` (``BulkConfig``, deadlines,
the byte-moving loops), ``p2p.bulk.listener`` (``BulkListener``), ``p2p.bulk.connect`` (dial,
punch). Here: the receiver's admission of an offer, the payload's bytes, and the ``Outcome``
that confirms them. Many payloads over one negotiation: ``p2p.bulk.channel``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from p2p.bulk.control import (
    CHANNEL_META,
    ControlMessage,
    Offer,
    Outcome,
    Reject,
    brief_reason,
    encode_control,
)
from p2p.bulk.frames import DEFAULT_FRAME_BYTES, BulkReceiver, BulkSender
from p2p.bulk.link import connect_as_receiver, connect_as_sender
from p2p.bulk.listener import BulkListener
from p2p.bulk.negotiate import DataMode
from p2p.bulk.transfer import (
    DEFAULT_CONFIG,
    BulkConfig,
    BulkTransferFailed,
    ByteStream,
    ReceiveBudget,
    io_failure,
    lazy_buffer,
    progress_deadline,
    read_control,
    receive_on_stream,
    receive_stripe,
    run_stripes,
    send_on_stream,
    send_stripe,
    too_slow,
    write_control,
)
from p2p.errors import LocalProtocolError, RemoteError, RemoteProtocolError
from p2p.tensors import TensorHeader, as_wire_bytes, from_wire_bytes, header_for
from p2p.wire import decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BulkReceived:
    """What ``receive_bulk`` returns: the sender's ``meta``, the payload, and how it came."""

    meta: bytes
    data: bytearray | memoryview
    mode: DataMode


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
    link = await connect_as_sender(
        stream, len(source), config.stripes, meta, direct, listener, config, peer_ids, remote_ip
    )
    if link.socks is not None:
        key, layout, socks = link.key, link.layout, link.socks

        async def send_one(stripe: int, sock: trio.socket.SocketType) -> None:
            await send_stripe(sock, BulkSender(key, layout, stripe), source, config.idle_timeout_s)

        try:
            await run_stripes(socks, send_one)
        except (OSError, trio.TooSlowError) as exc:
            # The receiver usually closed on us because it found something wrong: get its reason.
            verdict: ControlMessage | None = None
            with trio.move_on_after(1.0):
                try:
                    verdict = await read_control(stream, None, Outcome)
                except Exception as read_exc:
                    log.debug("no verdict from the receiver: %r", read_exc)
            if isinstance(verdict, Outcome) and not verdict.ok:
                raise RemoteError("transfer_failed", verdict.reason) from exc
            raise io_failure("sending bulk data", exc) from None
    else:
        await send_on_stream(stream, source, config)

    outcome = await read_control(stream, config.idle_timeout_s, Outcome)
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
    offer = await read_control(stream, config.control_timeout_s, Offer)
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
        await write_control(stream, Reject(brief_reason(str(exc))), config.control_timeout_s)
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
            link = await connect_as_receiver(
                stream, offer, direct, listener, config, peer_ids, remote_ip
            )
            if link.socks is not None:
                key, layout = link.key, link.layout

                async def receive_one(stripe: int, sock: trio.socket.SocketType) -> None:
                    await receive_stripe(
                        sock, BulkReceiver(key, layout, stripe), dest, config.idle_timeout_s
                    )

                try:
                    await run_stripes(link.socks, receive_one)
                except (OSError, trio.TooSlowError) as exc:
                    raise io_failure("receiving bulk data", exc) from None
            else:
                await receive_on_stream(stream, dest, config)
        if slow.cancelled_caught:
            raise too_slow(config, offer.total_bytes)
    except (RemoteProtocolError, BulkTransferFailed) as exc:
        with trio.move_on_after(config.control_timeout_s):
            try:
                await stream.write(encode_control(Outcome(False, brief_reason(str(exc)))))
            except Exception as write_exc:
                log.debug("could not tell the sender why: %r", write_exc)
        raise
    await write_control(stream, Outcome(True), config.control_timeout_s)
    return BulkReceived(offer.meta, dest, link.mode)


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
