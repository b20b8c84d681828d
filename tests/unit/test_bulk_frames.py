"""The bulk data plane's sans-IO core: keys, hello, frames and control messages, no sockets.

Hypothesis deadlines are off: a loaded 2-core box must not turn a slow example into a failure.
"""

from __future__ import annotations

import contextlib
import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.bulk.control import (
    MAX_CONTROL_BYTES,
    Accept,
    Fallback,
    Offer,
    Outcome,
    Reject,
    control_limit,
    decode_control,
    encode_control,
)
from p2p.bulk.frames import (
    FRAME_HEADER_BYTES,
    HELLO_BYTES,
    MIN_FRAME_BYTES,
    TAG_BYTES,
    BulkReceiver,
    BulkSender,
    Hello,
    ReceiverState,
    TransferLayout,
    derive_session_key,
    parse_hello,
    seal_hello,
    verify_hello,
)
from p2p.bulk.negotiate import DataMode
from p2p.errors import LocalProtocolError, RemoteProtocolError
from p2p.wire import PROTOCOL_VERSION, FrameDecoder

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def frames_of(payload: bytes, layout: TransferLayout, stripe: int, key: bytes = KEY) -> list[bytes]:
    sender = BulkSender(key, layout, stripe)
    out = bytearray(layout.frame_buffer_bytes)
    frames = []
    while (frame := sender.next_frame(memoryview(payload), out)) is not None:
        frames.append(bytes(frame))
    assert sender.done
    return frames


def feed(receiver: BulkReceiver, frame: bytes, dest: bytearray) -> None:
    body_len = receiver.receive_header(frame[:FRAME_HEADER_BYTES])
    body = frame[FRAME_HEADER_BYTES:]
    assert len(body) == body_len
    receiver.receive_body(body, dest)


def transfer(payload: bytes, layout: TransferLayout) -> bytearray:
    dest = bytearray(layout.total_bytes)
    for stripe in range(layout.stripe_count):
        receiver = BulkReceiver(KEY, layout, stripe)
        for frame in frames_of(payload, layout, stripe):
            feed(receiver, frame, dest)
        receiver.receive_eof()
        assert receiver.done
    return dest


@pytest.mark.parametrize(
    ("total", "frame", "stripes"),
    [
        (0, 4096, 1),
        (1, 4096, 1),
        (4096, 4096, 1),
        (4097, 4096, 1),
        (50_000, 4096, 3),
        (100, 4096, 4),
    ],
)
def test_round_trip(total: int, frame: int, stripes: int) -> None:
    payload = os.urandom(total)
    layout = TransferLayout(total, frame, stripes)
    assert sum(layout.stripe_bytes(s) for s in range(stripes)) == total
    assert transfer(payload, layout) == payload


@given(
    total=st.integers(0, 40_000),
    frame=st.integers(MIN_FRAME_BYTES, 9000),
    stripes=st.integers(1, 5),
)
@settings(max_examples=40, deadline=None)
def test_round_trip_any_layout(total: int, frame: int, stripes: int) -> None:
    payload = os.urandom(total)
    assert transfer(payload, TransferLayout(total, frame, stripes)) == payload


def two_frames() -> tuple[TransferLayout, list[bytes]]:
    layout = TransferLayout(3 * 4096 + 10, 4096, 1)
    return layout, frames_of(os.urandom(layout.total_bytes), layout, 0)


def test_tampered_ciphertext_rejected() -> None:
    layout, frames = two_frames()
    bad = bytearray(frames[0])
    bad[FRAME_HEADER_BYTES + 100] ^= 1
    receiver = BulkReceiver(KEY, layout, 0)
    with pytest.raises(RemoteProtocolError, match="authentication"):
        feed(receiver, bytes(bad), bytearray(layout.total_bytes))
    assert receiver.state is ReceiverState.ERROR
    with pytest.raises(LocalProtocolError):  # latched: nothing more is accepted
        receiver.receive_header(frames[1][:FRAME_HEADER_BYTES])


def test_tampered_tag_rejected() -> None:
    layout, frames = two_frames()
    bad = bytearray(frames[0])
    bad[-1] ^= 0x80
    with pytest.raises(RemoteProtocolError, match="authentication"):
        feed(BulkReceiver(KEY, layout, 0), bytes(bad), bytearray(layout.total_bytes))


def test_tampered_length_rejected_from_header() -> None:
    layout, frames = two_frames()
    bad = bytearray(frames[0])
    bad[7] ^= 1  # body length off by one
    with pytest.raises(RemoteProtocolError, match="body length"):
        BulkReceiver(KEY, layout, 0).receive_header(bytes(bad[:FRAME_HEADER_BYTES]))


def test_tampered_header_is_aad() -> None:
    # A reserved header byte is checked structurally; the kind byte is covered by the AAD too.
    layout, frames = two_frames()
    bad = bytearray(frames[0])
    bad[2] = 1
    with pytest.raises(RemoteProtocolError, match="reserved"):
        BulkReceiver(KEY, layout, 0).receive_header(bytes(bad[:FRAME_HEADER_BYTES]))


def test_oversized_length_rejected_before_body() -> None:
    layout = TransferLayout(1 << 20, 1 << 20, 1)
    header = bytes([1, 0, 0, 0]) + (0xFFFFFFFF).to_bytes(4, "big")
    receiver = BulkReceiver(KEY, layout, 0)
    with pytest.raises(RemoteProtocolError, match="body length 4294967295"):
        receiver.receive_header(header)


def test_unknown_kind_rejected() -> None:
    layout, _ = two_frames()
    with pytest.raises(RemoteProtocolError, match="unknown frame kind"):
        BulkReceiver(KEY, layout, 0).receive_header(bytes([9, 0, 0, 0, 0, 0, 16, 16]))


def test_truncation_detected() -> None:
    layout, frames = two_frames()
    receiver = BulkReceiver(KEY, layout, 0)
    dest = bytearray(layout.total_bytes)
    for frame in frames[:-1]:  # everything but the END frame
        feed(receiver, frame, dest)
    with pytest.raises(RemoteProtocolError, match="closed after"):
        receiver.receive_eof()


def test_early_end_is_truncation() -> None:
    layout, frames = two_frames()
    end = frames[-1]
    with pytest.raises(RemoteProtocolError, match="truncated"):
        BulkReceiver(KEY, layout, 0).receive_header(end[:FRAME_HEADER_BYTES])


def test_reorder_rejected() -> None:
    layout, frames = two_frames()
    receiver = BulkReceiver(KEY, layout, 0)
    with pytest.raises(RemoteProtocolError, match="authentication"):
        feed(receiver, frames[1], bytearray(layout.total_bytes))


def test_replay_rejected() -> None:
    layout, frames = two_frames()
    receiver = BulkReceiver(KEY, layout, 0)
    dest = bytearray(layout.total_bytes)
    feed(receiver, frames[0], dest)
    with pytest.raises(RemoteProtocolError, match="authentication"):
        feed(receiver, frames[0], dest)


def test_cross_stripe_frame_rejected() -> None:
    layout = TransferLayout(8 * 4096, 4096, 2)
    payload = os.urandom(layout.total_bytes)
    stripe1 = frames_of(payload, layout, 1)
    with pytest.raises(RemoteProtocolError, match="authentication"):
        feed(BulkReceiver(KEY, layout, 0), stripe1[0], bytearray(layout.total_bytes))


def test_wrong_key_rejected() -> None:
    layout, _ = two_frames()
    frames = frames_of(os.urandom(layout.total_bytes), layout, 0, key=OTHER_KEY)
    with pytest.raises(RemoteProtocolError, match="authentication"):
        feed(BulkReceiver(KEY, layout, 0), frames[0], bytearray(layout.total_bytes))


def test_data_after_end_rejected_and_receiver_misuse_is_local() -> None:
    layout, frames = two_frames()
    receiver = BulkReceiver(KEY, layout, 0)
    dest = bytearray(layout.total_bytes)
    for frame in frames:
        feed(receiver, frame, dest)
    assert receiver.done
    with pytest.raises(LocalProtocolError):
        receiver.receive_header(frames[0][:FRAME_HEADER_BYTES])
    with pytest.raises(LocalProtocolError):
        BulkReceiver(KEY, layout, 0).receive_body(frames[0][FRAME_HEADER_BYTES:], dest)


def test_sender_checks_its_inputs() -> None:
    layout = TransferLayout(10_000, 4096, 1)
    sender = BulkSender(KEY, layout, 0)
    with pytest.raises(LocalProtocolError):
        sender.next_frame(memoryview(bytes(9_999)), bytearray(layout.frame_buffer_bytes))
    with pytest.raises(LocalProtocolError):
        sender.next_frame(memoryview(bytes(10_000)), bytearray(100))
    with pytest.raises(LocalProtocolError):
        TransferLayout(10, 100, 1)  # frame below the minimum
    with pytest.raises(LocalProtocolError):
        BulkSender(KEY, layout, 1)


@given(st.binary(min_size=0, max_size=FRAME_HEADER_BYTES + 5000))
@settings(max_examples=300, deadline=None)
def test_garbage_frames_raise_remote_protocol_error(garbage: bytes) -> None:
    layout = TransferLayout(6000, 4096, 1)
    receiver = BulkReceiver(KEY, layout, 0)
    dest = bytearray(layout.total_bytes)
    try:
        n = receiver.receive_header(garbage[:FRAME_HEADER_BYTES])
        receiver.receive_body(garbage[FRAME_HEADER_BYTES : FRAME_HEADER_BYTES + n], dest)
    except RemoteProtocolError:
        return
    pytest.fail("garbage was accepted")


# --- keys and hello ------------------------------------------------------------------------


def test_session_key_binds_everything() -> None:
    a, b, tid = os.urandom(32), os.urandom(32), os.urandom(16)
    base = dict(sender_share=a, receiver_share=b, sender_peer_id=b"A", receiver_peer_id=b"B")
    key = derive_session_key(**base, transfer_id=tid)
    assert len(key) == 32
    assert key == derive_session_key(**base, transfer_id=tid)
    assert key != derive_session_key(**base, transfer_id=os.urandom(16))
    swapped = dict(base, sender_peer_id=b"B", receiver_peer_id=b"A")
    assert key != derive_session_key(**swapped, transfer_id=tid)
    # Length prefixes keep ("AB", "") and ("A", "B") apart.
    shifted = dict(base, sender_peer_id=b"AB", receiver_peer_id=b"")
    assert derive_session_key(**shifted, transfer_id=tid) != derive_session_key(
        **dict(base, sender_peer_id=b"A", receiver_peer_id=b"B"), transfer_id=tid
    )
    with pytest.raises(RemoteProtocolError):
        derive_session_key(**dict(base, receiver_share=a), transfer_id=tid)


def test_hello_round_trip_and_wrong_key() -> None:
    hello = Hello(os.urandom(16), 1, 3)
    data = seal_hello(KEY, hello)
    assert len(data) == HELLO_BYTES
    assert parse_hello(data) == hello
    assert verify_hello(KEY, data) == hello
    with pytest.raises(RemoteProtocolError, match="wrong key"):
        verify_hello(OTHER_KEY, data)
    forged = bytearray(data)
    forged[5] = 2  # claim another stripe: the tag covers the header
    with pytest.raises(RemoteProtocolError):
        verify_hello(KEY, bytes(forged))


@given(st.binary(min_size=0, max_size=HELLO_BYTES + 4))
@settings(deadline=None)
def test_garbage_hello_raises_remote_protocol_error(garbage: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        verify_hello(KEY, garbage)


def test_http_request_is_not_a_hello() -> None:
    with pytest.raises(RemoteProtocolError, match="bad magic"):
        parse_hello(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(HELLO_BYTES, b"x"))


# --- control messages ------------------------------------------------------------------------

ports = st.integers(1, 65535)


@st.composite
def offers(draw: st.DrawFn) -> Offer:
    stripes = draw(st.integers(1, 16))
    punch = draw(st.booleans())
    return Offer(
        transfer_id=draw(st.binary(min_size=16, max_size=16)),
        total_bytes=draw(st.integers(0, 1 << 40)),
        frame_bytes=draw(st.integers(MIN_FRAME_BYTES, 16 << 20)),
        stripe_count=stripes,
        share=draw(st.binary(min_size=32, max_size=32)),
        direct=draw(st.booleans()),
        listen_port=draw(st.integers(0, 65535)),
        meta=draw(st.binary(max_size=200)),
        punch_ports=tuple(draw(st.lists(ports, min_size=stripes, max_size=stripes)))
        if punch
        else (),
    )


messages = st.one_of(
    offers(),
    st.builds(
        Accept,
        share=st.binary(min_size=32, max_size=32),
        mode=st.just(DataMode.PUNCH),
        listen_port=st.just(0),
        punch_ports=st.lists(ports, min_size=1, max_size=16).map(tuple),
    ),
    st.builds(
        Accept,
        share=st.binary(min_size=32, max_size=32),
        mode=st.just(DataMode.DIAL_RECEIVER),
        listen_port=st.integers(1, 65535),
    ),
    st.builds(
        Accept,
        share=st.binary(min_size=32, max_size=32),
        mode=st.sampled_from([DataMode.STREAM, DataMode.DIAL_SENDER]),
        listen_port=st.just(0),
    ),
    st.builds(Reject, reason=st.text(max_size=50)),
    st.builds(Fallback, reason=st.text(max_size=50)),
    st.builds(Outcome, ok=st.booleans(), reason=st.text(max_size=50)),
)


@given(messages)
@settings(deadline=None)
def test_control_round_trip(message: object) -> None:
    data = encode_control(message)  # type: ignore[arg-type]
    frames = FrameDecoder(control_limit(type(message)))  # type: ignore[arg-type]
    frames.receive_data(data)
    payload = frames.next_frame()
    assert payload is not None and len(payload) == len(data) - 4
    assert decode_control(payload) == message
    assert decode_control(payload, type(message)) == message  # type: ignore[arg-type]


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_control_garbage_raises_remote_protocol_error(garbage: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):  # anything else escaping is a bug
        decode_control(garbage)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.binary(max_size=40)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=6),
    max_leaves=10,
)


V = PROTOCOL_VERSION
OFFER, ACCEPT, OUTCOME = Offer.TYPE_CODE, Accept.TYPE_CODE, Outcome.TYPE_CODE


@given(
    code=st.sampled_from([OFFER, ACCEPT]),
    fields=st.lists(_msgpack_values, min_size=9, max_size=10),
    mutate=st.integers(0, 9),
)
@settings(max_examples=200, deadline=None)
def test_control_well_framed_garbage_raises_remote_protocol_error(
    code: int, fields: list[object], mutate: int
) -> None:
    """Garbage inside a well-formed message frame (right version, Offer or Accept code), so the
    field checks are exercised, not just msgpack's: still only RemoteProtocolError."""
    good = [os.urandom(16), 10, 4096, 1, os.urandom(32), True, 0, b"", [4000]]
    if code == ACCEPT:
        good = [os.urandom(32), 3, 0, [4000]]
    obj = list(good)
    obj[mutate % len(obj)] = fields[mutate % len(fields)]
    for candidate in ([V, code, obj], [V, code, fields[: len(good)]]):
        with contextlib.suppress(RemoteProtocolError):
            decode_control(msgpack.packb(candidate, use_bin_type=True))


def test_control_limits() -> None:
    # The length prefix is checked before any body byte is read.
    frames = FrameDecoder(control_limit())
    frames.receive_data((MAX_CONTROL_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError):
        frames.next_frame()
    assert control_limit() == MAX_CONTROL_BYTES
    assert control_limit(Accept, Reject) < 2048  # an answer is small: so is what we read for it
    with pytest.raises(RemoteProtocolError):
        decode_control(b"")  # an empty frame
    with pytest.raises(RemoteProtocolError):
        decode_control(b"\x00" * (MAX_CONTROL_BYTES + 1))
    with pytest.raises(LocalProtocolError):
        encode_control(Reject("x" * 300))  # built locally: our bug, not the peer's

    share = os.urandom(32)
    bad = [
        [2, OUTCOME, [True, ""]],  # unknown version (the old hand-made encoding was 2)
        [V, 99, [True, ""]],  # unknown code
        [V, 1, ["a", [], None]],  # a registered code that is not a control message
        [V, OUTCOME, [1, ""]],  # wrong type
        [V, OUTCOME, True, ""],  # fields not in a body list
        [V, ACCEPT, [share, 7, 0, []]],  # unknown mode
        [V, ACCEPT, [share, True, 0, []]],  # bool for a mode
        [V, ACCEPT, [share, 1, 0, []]],  # DIAL_RECEIVER without a port
        [V, ACCEPT, [share, 0, 0]],  # Accept without its punch ports field
        [V, ACCEPT, [share, 3, 0, []]],  # PUNCH without ports
        [V, ACCEPT, [share, 0, 0, [5000]]],  # ports without PUNCH
        [V, ACCEPT, [share, 3, 0, [0]]],  # port 0
        [V, ACCEPT, [share, 3, 0, [70000]]],  # port out of range
        [V, ACCEPT, [share, 3, 0, [True]]],  # bool for a port
        [V, ACCEPT, [share, 3, 0, [b"\x10\x00"]]],  # bytes for a port
        [V, ACCEPT, [share, 3, 0, list(range(1000, 1017))]],  # more ports than stripes allow
        [V, ACCEPT, [share, 3, 0, 5000]],  # a port, not a list
        [V, ACCEPT, [share, 0, 0, [], 1]],  # an extra field
        [V, OFFER, [b"short", 10, 4096, 1, share, True, 0, b"", []]],  # bad transfer id
        [V, OFFER, [os.urandom(16), -1, 4096, 1, share, True, 0, b"", []]],  # negative size
        [V, OFFER, [os.urandom(16), 10, 4096, 1, share, 1, 0, b"", []]],  # int for bool
        [V, OFFER, [os.urandom(16), 10, 4096, 2, share, True, 0, b"", [9]]],  # 1 port, 2 stripes
        [V, OFFER, [os.urandom(16), 10, 4096, 1, share, True, 0, b"x" * 17_000, []]],  # big meta
    ]
    for obj in bad:
        with pytest.raises(RemoteProtocolError):
            decode_control(msgpack.packb(obj, use_bin_type=True))
    assert TAG_BYTES == 16


def test_an_unexpected_control_message_is_refused() -> None:
    payload = encode_control(Outcome(True))[4:]
    with pytest.raises(RemoteProtocolError, match="unexpected"):
        decode_control(payload, Accept, Reject)


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([b"\xab" * 17_000, 1], use_bin_type=True),  # a version made of bytes
        msgpack.packb([1, "x" * 17_000], use_bin_type=True),  # a code made of text
        msgpack.packb(1, use_bin_type=True) + b"\xcc" * 17_000,  # ExtraData carries the rest
        msgpack.packb([b"\xab" * 17_000, OUTCOME, []], use_bin_type=True),  # version of bytes
        msgpack.packb([PROTOCOL_VERSION, "x" * 17_000, []], use_bin_type=True),  # code of text
        msgpack.packb([PROTOCOL_VERSION, ACCEPT, [b"s" * 32, "m" * 150, 0, []]]),  # mode
    ],
)
def test_a_rejected_control_message_is_not_echoed(body: bytes) -> None:
    """Issue 15: a 17 KiB input made one 60,053-character rejection line (repr of its bytes)."""
    with pytest.raises(RemoteProtocolError) as info:
        decode_control(body[:MAX_CONTROL_BYTES])
    assert len(str(info.value)) < 120, str(info.value)[:300]
