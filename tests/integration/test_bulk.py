"""Bulk data plane on loopback: real libp2p hosts, real TCP data connections, real listeners."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import outcome
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p.bulk.channel import (
    PACED_CONGESTION_CONTROL,
    TCP_CONGESTION,
    accept_channel,
    open_channel,
)
from p2p.bulk.control import (
    PROTOCOL,
    Accept,
    Offer,
    Outcome,
    control_limit,
    decode_control,
    encode_control,
)
from p2p.bulk.frames import (
    FRAME_HEADER_BYTES,
    HELLO_BYTES,
    BulkSender,
    Hello,
    TransferLayout,
    derive_session_key,
    seal_hello,
)
from p2p.bulk.listener import BulkListener
from p2p.bulk.negotiate import DataMode
from p2p.bulk.payload import receive_array, receive_bulk, send_array, send_bulk
from p2p.bulk.transfer import BulkConfig, BulkTransferFailed
from p2p.errors import LocalProtocolError, RemoteError, RemoteProtocolError
from p2p.host import Host, HostConfig, open_host
from p2p.wire import read_exactly, read_frame

MiB = 1 << 20
TEST_DEADLINE_S = 90


@dataclass
class Peers:
    receiver: Host
    sender: Host
    receiver_listener: BulkListener
    sender_listener: BulkListener


@asynccontextmanager
async def two_peers() -> AsyncIterator[Peers]:
    async with (
        open_host(HostConfig(create_new_key_pair())) as receiver,
        open_host(HostConfig(create_new_key_pair())) as sender,
        trio.open_nursery() as nursery,
    ):
        receiver_listener = BulkListener("127.0.0.1", hello_timeout_s=2.0)
        sender_listener = BulkListener("127.0.0.1", hello_timeout_s=2.0)
        await nursery.start(receiver_listener.run)
        await nursery.start(sender_listener.run)
        await sender.connect(receiver.peer_id, receiver.addrs())
        yield Peers(receiver, sender, receiver_listener, sender_listener)
        nursery.cancel_scope.cancel()


async def exchange(
    peers: Peers,
    receive: Callable[[Any], Awaitable[Any]],
    send: Callable[[Any], Awaitable[Any]],
) -> tuple[outcome.Outcome, outcome.Outcome]:
    """Run ``receive`` in the receiver's stream handler and ``send`` on a stream to it."""
    send_channel, receive_channel = trio.open_memory_channel[outcome.Outcome](1)

    async def handler(stream: Any) -> None:
        result = await outcome.acapture(receive, stream)
        await send_channel.send(result)
        await stream.close()

    peers.receiver.set_handler(PROTOCOL, handler)
    stream = await peers.sender.open_stream(peers.receiver.peer_id, PROTOCOL)
    sent = await outcome.acapture(send, stream)
    with trio.fail_after(30):
        received = await receive_channel.receive()
    await stream.close()
    return received, sent


def array_64mib() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((4096, 4096), dtype=np.float32)


async def test_64mib_array_over_the_bulk_path() -> None:
    array = array_64mib()
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_array(s, direct=True, listener=peers.receiver_listener),
                lambda s: send_array(s, array, direct=True),
            )
    assert sent.unwrap() is DataMode.DIAL_RECEIVER
    got = received.unwrap()
    assert got.dtype == np.float32 and got.shape == (4096, 4096)
    assert np.array_equal(got, array)


async def test_64mib_over_the_libp2p_fallback() -> None:
    payload = os.urandom(64 * MiB)
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                # Relayed: the receiver has a listener, but the connection is not direct.
                lambda s: receive_bulk(s, direct=False, listener=peers.receiver_listener),
                lambda s: send_bulk(s, payload, direct=False, listener=peers.sender_listener),
            )
    assert sent.unwrap() is DataMode.STREAM
    got = received.unwrap()
    assert got.mode is DataMode.STREAM and got.data == payload


async def test_striped_and_dialing_the_sender() -> None:
    payload = os.urandom(9 * MiB + 123)
    config = BulkConfig(frame_bytes=MiB, stripes=3)
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                # The receiver has no listener (behind NAT): it dials the sender's.
                lambda s: receive_bulk(s, direct=True, config=config),
                lambda s: send_bulk(
                    s,
                    payload,
                    direct=True,
                    listener=peers.sender_listener,
                    meta=b"hello",
                    config=config,
                ),
            )
    assert sent.unwrap() is DataMode.DIAL_SENDER
    got = received.unwrap()
    assert (got.mode, got.meta, got.data) == (DataMode.DIAL_SENDER, b"hello", payload)
    assert peers.sender_listener.statistics["accepted"] == 3


async def test_failed_dial_falls_back_to_the_stream(caplog: pytest.LogCaptureFixture) -> None:
    payload = os.urandom(3 * MiB)
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, listener=peers.receiver_listener),
                # The listener is bound to 127.0.0.1 only: 127.0.0.2 refuses the connection.
                lambda s: send_bulk(s, payload, direct=True, remote_ip="127.0.0.2"),
            )
    assert sent.unwrap() is DataMode.STREAM
    assert received.unwrap().data == payload
    assert "using the libp2p stream" in caplog.text


async def test_oversized_offer_refused_before_allocation() -> None:
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, config=BulkConfig(max_bytes=MiB)),
                lambda s: send_bulk(s, bytes(MiB + 1), direct=True),
            )
    with pytest.raises(RemoteProtocolError, match="exceeds our limit"):
        received.unwrap()
    with pytest.raises(RemoteError, match="rejected"):
        sent.unwrap()


async def test_tensor_header_that_lies_is_refused() -> None:
    from p2p.tensors import TensorHeader
    from p2p.wire import encode

    lying = encode(TensorHeader("float32", [10], 40, MiB))
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_array(s, direct=True, listener=peers.receiver_listener),
                lambda s: send_bulk(s, bytes(80), direct=True, meta=lying),
            )
    with pytest.raises(RemoteProtocolError, match="disagrees"):
        received.unwrap()
    with pytest.raises(RemoteError):
        sent.unwrap()


async def _rejected(port: int, data: bytes, *, hang_up: bool = False) -> None:
    """Connect, send ``data`` (then half-close if ``hang_up``), wait until the listener closes."""
    sock = trio.socket.socket()
    with sock:
        await sock.connect(("127.0.0.1", port))
        if data:
            await sock.send(data)
        if hang_up:
            sock.shutdown(socket.SHUT_WR)
        with trio.fail_after(10):
            while await sock.recv(4096):
                pass


async def test_unauthenticated_connections_rejected_and_listener_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2p.bulk.listener")
    key, wrong_key, transfer_id = os.urandom(32), os.urandom(32), os.urandom(16)
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            listener = peers.receiver_listener
            port = listener.port
            with listener.expect(transfer_id, 1, key) as pending:
                await _rejected(port, b"")  # connects and says nothing: hello timeout
                await _rejected(port, b"GET / HTTP/1.1\r\n\r\n".ljust(HELLO_BYTES, b"x"))
                await _rejected(port, seal_hello(key, Hello(os.urandom(16), 0, 1)))
                await _rejected(port, seal_hello(wrong_key, Hello(transfer_id, 0, 1)))
                await _rejected(port, b"STBK\x01", hang_up=True)  # ends mid-hello
                assert pending.socks == [None]
                assert listener.statistics["rejected"] == 5
            for reason in (
                "no hello within",
                "bad magic",
                "unknown or expired transfer id",
                "wrong key",
                "connection closed after 5 hello bytes",
            ):
                assert reason in caplog.text, reason
            # Still serving: a real transfer goes through the same listener.
            payload = os.urandom(2 * MiB)
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, listener=listener),
                lambda s: send_bulk(s, payload, direct=True),
            )
            assert sent.unwrap() is DataMode.DIAL_RECEIVER
            assert received.unwrap().data == payload


async def _read_control(stream: Any) -> Any:
    return decode_control(await read_frame(stream, control_limit()))


async def test_truncated_data_connection_detected() -> None:
    """A sender that stops before its END frame: the receiver refuses and says why."""
    layout = TransferLayout(4 * MiB, MiB, 1)
    payload = os.urandom(layout.total_bytes)

    async def truncating_sender(stream: Any) -> Outcome:
        local, remote = peers.sender.peer_id.to_bytes(), peers.receiver.peer_id.to_bytes()
        offer = Offer(os.urandom(16), layout.total_bytes, MiB, 1, os.urandom(32), True, 0, b"")
        await stream.write(encode_control(offer))
        accept = await _read_control(stream)
        assert isinstance(accept, Accept) and accept.mode is DataMode.DIAL_RECEIVER
        key = derive_session_key(
            sender_share=offer.share,
            receiver_share=accept.share,
            sender_peer_id=local,
            receiver_peer_id=remote,
            transfer_id=offer.transfer_id,
        )
        sender = BulkSender(key, layout, 0)
        out = bytearray(layout.frame_buffer_bytes)
        sock = trio.socket.socket()
        with sock:
            await sock.connect(("127.0.0.1", accept.listen_port))
            await sock.send(seal_hello(key, Hello(offer.transfer_id, 0, 1)))
            for _ in range(2):  # two of four data frames, then hang up
                frame = sender.next_frame(memoryview(payload), out)
                assert frame is not None and len(frame) > FRAME_HEADER_BYTES
                view = memoryview(bytes(frame))
                while view:
                    view = view[await sock.send(view) :]
        return await _read_control(stream)

    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, listener=peers.receiver_listener),
                truncating_sender,
            )
    with pytest.raises(RemoteProtocolError, match="closed after 2 of 5 frames"):
        received.unwrap()
    verdict = sent.unwrap()
    assert isinstance(verdict, Outcome) and not verdict.ok and "closed after" in verdict.reason


async def test_reset_control_stream_surfaces_as_a_p2p_error() -> None:
    """Whether libp2p reports the reset as EOF or as StreamReset, no libp2p exception escapes."""

    async def rude_receiver(stream: Any) -> None:
        await stream.read(4)
        await stream.reset()

    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            _, sent = await exchange(
                peers, rude_receiver, lambda s: send_bulk(s, bytes(MiB), direct=True)
            )
    with pytest.raises((RemoteProtocolError, BulkTransferFailed)):
        sent.unwrap()


async def test_listener_caps_connections_waiting_for_their_hello() -> None:
    listener = BulkListener("127.0.0.1", hello_timeout_s=30.0, max_unauthenticated=1)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(listener.run)
            silent = trio.socket.socket()
            with silent:
                await silent.connect(("127.0.0.1", port))
                await _rejected(port, b"")  # closed at once: the one slot is taken
                assert listener.statistics["refused_busy"] == 1
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("dtype", "shape"), [("bfloat16", (3, 1000)), ("float32", (7, 11, 13)), ("int64", (0, 5))]
)
async def test_torch_tensors_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    import torch

    from p2p.bulk.payload import receive_tensor, send_tensor

    generator = torch.Generator().manual_seed(3)
    tensor = (torch.randn(shape, generator=generator) * 100).to(getattr(torch, dtype))
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_tensor(s, direct=True, listener=peers.receiver_listener),
                lambda s: send_tensor(s, tensor, direct=True),
            )
    sent.unwrap()
    got = received.unwrap()
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)


async def test_punched_connection_when_neither_side_listens() -> None:
    """Two NATed peers joined directly (DCUtR): no listener anywhere, so both connect at once
    between announced ports; on loopback one SYN meets the other side's listening socket."""
    payload = os.urandom(5 * MiB + 17)
    config = BulkConfig(frame_bytes=MiB, stripes=2)
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, config=config),
                lambda s: send_bulk(s, payload, direct=True, meta=b"m", config=config),
            )
    assert sent.unwrap() is DataMode.PUNCH
    got = received.unwrap()
    assert (got.mode, got.meta, got.data) == (DataMode.PUNCH, b"m", payload)


async def test_failed_punch_falls_back_to_the_stream_in_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Neither side can reach the other's punch port (both aim at an address nobody answers
    on, TEST-NET-1): the sender gives up after its window and both use the libp2p stream."""
    payload = os.urandom(2 * MiB)
    config = BulkConfig(punch_timeout_s=1.0)
    nowhere = "192.0.2.1"
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            start = trio.current_time()
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, config=config, remote_ip=nowhere),
                lambda s: send_bulk(s, payload, direct=True, config=config, remote_ip=nowhere),
            )
            elapsed = trio.current_time() - start
    assert sent.unwrap() is DataMode.STREAM
    got = received.unwrap()
    assert got.mode is DataMode.STREAM and got.data == payload
    assert "punch" in caplog.text and "using the libp2p stream" in caplog.text
    # The window plus the stream transfer: well under the receiver's own deadline (4 s more).
    assert elapsed < config.punch_timeout_s + 2.5, elapsed


async def test_relayed_connection_never_punches() -> None:
    payload = os.urandom(MiB)
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=False),
                lambda s: send_bulk(s, payload, direct=False),
            )
    assert sent.unwrap() is DataMode.STREAM
    assert received.unwrap().mode is DataMode.STREAM


# ---- channels: several payloads over one negotiation --------------------------------------


CHANNEL_SIZES = (3 * MiB + 5, 17, 1 * MiB, 300_001)


@pytest.mark.parametrize(
    ("mode", "direct", "receiver_listens", "sender_listens"),
    [
        (DataMode.DIAL_RECEIVER, True, True, True),
        (DataMode.DIAL_SENDER, True, False, True),
        (DataMode.PUNCH, True, False, False),
        (DataMode.STREAM, False, True, True),
    ],
)
async def test_channel_carries_payloads_in_order_between_stream_messages(
    mode: DataMode, direct: bool, receiver_listens: bool, sender_listens: bool
) -> None:
    """Each payload is announced by a length on the control stream right before it, as the
    all-reduce does, so a control read racing the connection setup would corrupt the next."""
    payloads = [os.urandom(n) for n in CHANNEL_SIZES]

    async def send(stream: Any) -> DataMode:
        listener = peers.sender_listener if sender_listens else None
        channel = await open_channel(stream, direct=direct, listener=listener)
        try:
            for payload in payloads:
                await stream.write(len(payload).to_bytes(4, "big"))
                await channel.send(payload)
        finally:
            channel.close()
        return channel.mode

    async def receive(stream: Any) -> tuple[DataMode, list[bytes]]:
        listener = peers.receiver_listener if receiver_listens else None
        channel = await accept_channel(stream, direct=direct, listener=listener)
        got = []
        try:
            for _ in payloads:
                size = int.from_bytes(await read_exactly(stream, 4), "big")
                buffer = bytearray(size)
                await channel.receive(buffer)
                got.append(bytes(buffer))
        finally:
            channel.close()
        return channel.mode, got

    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(peers, receive, send)
    assert sent.unwrap() is mode
    got_mode, got = received.unwrap()
    assert got_mode is mode and got == payloads


async def test_channel_and_single_transfer_refuse_each_others_offers() -> None:
    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers,
                lambda s: receive_bulk(s, direct=True, listener=peers.receiver_listener),
                lambda s: open_channel(s, direct=True),
            )
            with pytest.raises(RemoteError, match="channel"):
                sent.unwrap()
            with pytest.raises(RemoteProtocolError):
                received.unwrap()
            received, sent = await exchange(
                peers,
                lambda s: accept_channel(s, direct=True, listener=peers.receiver_listener),
                lambda s: send_bulk(s, b"x" * MiB, direct=True),
            )
            with pytest.raises(RemoteError, match="channel offer"):
                sent.unwrap()
            with pytest.raises(RemoteProtocolError):
                received.unwrap()


async def test_channel_payload_of_the_wrong_length_is_refused() -> None:
    """The receiver's length (from its own protocol) disagrees with the sender's: the END frame
    or the frame layout gives it away, and the channel refuses further use."""

    async def send(stream: Any) -> None:
        channel = await open_channel(stream, direct=True)
        try:
            await channel.send(os.urandom(2 * MiB))
            await trio.sleep(1)  # keep the connection open while the receiver reads
        finally:
            channel.close()

    async def receive(stream: Any) -> None:
        channel = await accept_channel(stream, direct=True, listener=peers.receiver_listener)
        try:
            with pytest.raises(RemoteProtocolError):
                await channel.receive(bytearray(MiB))
            with pytest.raises(LocalProtocolError):
                await channel.receive(bytearray(MiB))
        finally:
            channel.close()

    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(peers, receive, send)
    received.unwrap()
    sent.unwrap()


async def test_a_rate_limited_channel_is_paced_and_a_relayed_one_says_it_cannot() -> None:
    """``limit_rate`` caps what the kernel sends: 3 MiB at 2 MiB/s cannot arrive in under a
    second (unpaced, loopback moves it in milliseconds), under a loss-based congestion control.
    A channel riding the libp2p stream cannot be paced and says so."""
    payload = os.urandom(3 * MiB)

    async def send(stream: Any, direct: bool) -> bool:
        channel = await open_channel(stream, direct=direct)
        try:
            paced = channel.limit_rate(2 * MiB)
            if paced:  # and left BBR, which cycles below the cap, for a loss-based control
                name = channel._sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16)
                assert name.rstrip(b"\0").decode() in PACED_CONGESTION_CONTROL
            await channel.send(payload)
            await trio.sleep(0.5 if direct else 0)  # the receiver reads what is in flight
        finally:
            channel.close()
        return paced

    async def receive(stream: Any, direct: bool) -> float:
        listener = peers.receiver_listener if direct else None
        channel = await accept_channel(stream, direct=direct, listener=listener)
        try:
            buffer = bytearray(len(payload))
            started = trio.current_time()
            await channel.receive(buffer)
            assert buffer == payload
            return trio.current_time() - started
        finally:
            channel.close()

    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(
                peers, lambda s: receive(s, True), lambda s: send(s, True)
            )
            assert sent.unwrap() is True
            assert received.unwrap() > 1.0
            received, sent = await exchange(
                peers, lambda s: receive(s, False), lambda s: send(s, False)
            )
            assert sent.unwrap() is False


async def test_a_kept_channel_outlives_its_stream_and_is_not_reusable_once_cut() -> None:
    """A channel outlives the stream it was negotiated on (the all-reduce keeps each pair's
    between rounds): after clean payloads both ends count them alike, are reusable and carry the
    next one. A payload cut off halfway leaves neither end reusable: its rest would otherwise
    be read as the next payload."""
    first, second, big = os.urandom(MiB + 3), os.urandom(300_001), os.urandom(32 * MiB)
    ends: dict[str, Any] = {}

    async def send(stream: Any) -> None:
        ends["out"] = await open_channel(stream, direct=True)
        await ends["out"].send(first)

    async def receive(stream: Any) -> bytes:
        ends["in"] = await accept_channel(stream, direct=True, listener=peers.receiver_listener)
        buffer = bytearray(len(first))
        await ends["in"].receive(buffer)
        return bytes(buffer)

    with trio.fail_after(TEST_DEADLINE_S):
        async with two_peers() as peers:
            received, sent = await exchange(peers, receive, send)
            sent.unwrap()
            assert received.unwrap() == first
            out, into = ends["out"], ends["in"]
            try:
                assert out.channel_id == into.channel_id
                assert out.payloads_sent == into.payloads_received == 1
                assert out.reusable() and into.reusable()
                buffer = bytearray(len(second))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(out.send, second)
                    await into.receive(buffer)
                assert buffer == second and out.reusable() and into.reusable()

                async def cut_send() -> None:
                    with trio.move_on_after(0.5):
                        await out.send(big)

                out.limit_rate(MiB)  # 32 MiB cannot leave in a second
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cut_send)
                    with trio.move_on_after(1.0):
                        await into.receive(bytearray(len(big)))
                assert out.payloads_sent == into.payloads_received == 3
                assert not out.reusable() and not into.reusable()
            finally:
                out.close()
                into.close()
            assert out.closed and into.closed
