"""Wire messages and frames, no sockets: limits first, every message round-trips, garbage is a
RemoteProtocolError whether it arrives whole or a byte at a time."""

from __future__ import annotations

import contextlib
import enum
import importlib
import pkgutil
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.network.stream.exceptions import StreamError, StreamReset

import p2p.rpc
import p2p.tensors
from p2p.bulk import control as bulk_control
from p2p.errors import LocalProtocolError, RemoteProtocolError, StreamEnded
from p2p.nat.reachability import MAX_DIALBACK_ADDRS, DialBackResponse
from p2p.wire import (
    PROTOCOL_VERSION,
    FrameDecoder,
    Message,
    decode,
    encode,
    frame,
    message,
    read_frame,
    registered_types,
    write_frame,
)

# Import every module of every package, so that every registered wire message is tested below
# whatever else the session imported, and two modules can never claim one type code unnoticed.
# Sub-packages are walked too: DHT values live in folders (swarm.averaging, swarmtrain.verified).
for _package in ("p2p", "swarm", "verify", "swarmtrain"):
    _root = importlib.import_module(_package)
    for _module in pkgutil.walk_packages(_root.__path__, prefix=f"{_package}."):
        importlib.import_module(_module.name)

from swarm.averaging import (  # noqa: E402  (imported above; named for the strategies)
    audit,
    matchmaking,
    session_wire,
)
from swarm.pipeline import records as pipeline_records  # noqa: E402
from swarm.pipeline import wire as pipeline_wire  # noqa: E402
from swarmtrain.membership import progress, state_sync  # noqa: E402
from swarmtrain.pipeline import progress as pipeline_progress  # noqa: E402
from swarmtrain.verified import plan as verified_plan  # noqa: E402


def _strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_strategy_for(a) for a in typing.get_args(hint)])
    if origin is tuple and len(typing.get_args(hint)) > 1 and typing.get_args(hint)[-1] != ...:
        return st.tuples(*[_strategy_for(a) for a in typing.get_args(hint)])
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        return st.lists(_strategy_for(item), max_size=4)
    if isinstance(hint, type) and issubclass(hint, Message):
        return _instances(hint)
    if origin is dict:
        k, v = typing.get_args(hint)
        return st.dictionaries(_strategy_for(k), _strategy_for(v), max_size=4)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return st.sampled_from(list(hint))
    return {
        int: st.integers(min_value=-(2**63), max_value=2**64 - 1),
        float: st.floats(allow_nan=False),
        str: st.text(max_size=40),
        bytes: st.binary(max_size=64),
        bool: st.booleans(),
        type(None): st.none(),
    }[hint]


def _tensor_headers() -> st.SearchStrategy[Message]:
    def build(dtype: str, shape: list[int], chunk: int) -> Message:
        itemsize = p2p.tensors.wire_dtype(dtype).itemsize
        nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
        return p2p.tensors.TensorHeader(dtype, shape, nbytes, chunk)

    dtypes = st.sampled_from(["float32", "float16", "bfloat16", "int8", "uint8", "int64"])
    shapes = st.lists(st.integers(0, 4096), max_size=4)
    return st.builds(build, dtypes, shapes, st.integers(1, 16 << 20))


def _pipeline_tensor(optional: bool = False) -> st.SearchStrategy[tuple[str, list[int], bytes]]:
    """(dtype, shape, data) that ``pipeline_wire`` accepts: the data matches the shape."""

    def build(dtype: str, shape: list[int], fill: int) -> tuple[str, list[int], bytes]:
        if dtype == "":
            return "", [], b""
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return dtype, shape, bytes([fill]) * size

    dtypes = ["float32", "float16", "int64"] + ([""] if optional else [])
    shapes = st.lists(st.integers(0, 6), max_size=pipeline_wire.MAX_DIMS)
    return st.builds(build, st.sampled_from(dtypes), shapes, st.integers(0, 255))


def _pipeline_messages() -> dict[type, Any]:
    ids = st.binary(min_size=1, max_size=pipeline_wire.MAX_MICROBATCH_ID_BYTES)
    text, ints = st.text(max_size=20), st.integers(-(2**31), 2**31)
    w = pipeline_wire

    def params(stage: int, r: int, digest: bytes, tensors: list[tuple[str, list[int], bytes]]):  # type: ignore[no-untyped-def]
        return w.ParamsReply(stage, r, digest, *(list(x) for x in zip(*tensors, strict=True)))

    return {
        w.ForwardRequest: lambda: st.builds(
            lambda r, s, i, t: w.ForwardRequest(r, s, i, *t), text, ints, ids, _pipeline_tensor()
        ),
        w.ForwardReply: lambda: st.builds(
            lambda i, t: w.ForwardReply(i, *t), ids, _pipeline_tensor()
        ),
        w.BackwardRequest: lambda: st.builds(
            lambda r, s, i, g, x: w.BackwardRequest(r, s, i, *g, *x),
            text,
            ints,
            ids,
            _pipeline_tensor(),
            _pipeline_tensor(optional=True),
        ),
        w.BackwardReply: lambda: st.builds(
            lambda i, t: w.BackwardReply(i, *t), ids, _pipeline_tensor(optional=True)
        ),
        w.ParamsReply: lambda: st.builds(
            params,
            ints,
            ints,
            st.binary(max_size=32),
            st.lists(_pipeline_tensor(), min_size=1, max_size=3),
        ),
        state_sync.StateRangeRequest: lambda: st.builds(
            state_sync.StateRangeRequest,
            text,
            st.binary(min_size=state_sync.HASH_BYTES, max_size=state_sync.HASH_BYTES),
            st.integers(0, state_sync.MAX_STATE_BYTES),
            st.integers(1, state_sync.MAX_RANGE_BYTES),
        ),
    }


def _bulk_control_messages() -> dict[type, Any]:
    c = bulk_control
    ports = st.lists(st.integers(1, 65535), min_size=1, max_size=16).map(tuple)

    def offer(stripes: int, punch: bool, **fields: Any) -> Message:
        return c.Offer(
            stripe_count=stripes, punch_ports=(4000,) * stripes if punch else (), **fields
        )

    def accept(share: bytes, mode: Any, port: int, punch_ports: tuple[int, ...]) -> Message:
        dialed = mode is c.DataMode.DIAL_RECEIVER
        punched = mode is c.DataMode.PUNCH
        return c.Accept(share, mode, port if dialed else 0, punch_ports if punched else ())

    share = st.binary(min_size=c.SHARE_BYTES, max_size=c.SHARE_BYTES)
    return {
        c.Offer: lambda: st.builds(
            offer,
            st.integers(1, c.MAX_STRIPES),
            st.booleans(),
            transfer_id=st.binary(min_size=c.TRANSFER_ID_BYTES, max_size=c.TRANSFER_ID_BYTES),
            total_bytes=st.integers(0, 1 << 48),
            frame_bytes=st.integers(4096, 16 << 20),
            share=share,
            direct=st.booleans(),
            listen_port=st.integers(0, 65535),
            meta=st.binary(max_size=c.MAX_META_BYTES),
        ),
        c.Accept: lambda: st.builds(
            accept, share, st.sampled_from(list(c.DataMode)), st.integers(1, 65535), ports
        ),
    }


def _progress_records() -> st.SearchStrategy[Message]:
    count = st.integers(0, 2**40)
    finite = st.floats(allow_nan=False, allow_infinity=False)
    return st.builds(
        progress.ProgressRecord,
        count,
        st.booleans(),
        st.binary(min_size=32, max_size=32),
        finite,
        finite,
        count,
        count,
        count,
        count,
        finite,
        st.sampled_from(progress.REACHABILITY),
        st.sampled_from([b"", bytes(progress.MEMBER_TAG_BYTES * 3)]),
    )


def _dht_values() -> dict[type, Any]:
    """The DHT values of swarm and swarmtrain: counts >= 0, finite figures, sized hashes."""
    count = st.integers(0, 2**40)
    finite = st.floats(allow_nan=False, allow_infinity=False)
    positive = st.floats(min_value=1e-9, max_value=1e9)
    peer = st.binary(min_size=1, max_size=64)
    digest = st.binary(min_size=32, max_size=32)
    text = st.text(max_size=40)
    inputs = st.tuples(peer, positive, digest, st.binary(max_size=audit.MAX_PROOF_BYTES))

    def part_audit(part: int, start: int, length: int, ins: list[Any], out: bytes) -> Message:
        return audit.PartAudit(part, start, start + length, tuple(ins), out)

    part_audits = st.builds(
        part_audit, count, count, count, st.lists(inputs, min_size=1, max_size=3), digest
    )

    def slice_dispute(part: int, start: int, length: int, item: tuple[Any, ...]) -> Message:
        return audit.SliceDispute(part, start, start + length, *item)

    slice_disputes = st.builds(slice_dispute, count, count, count, inputs)
    claim = st.tuples(peer, st.integers(1, 2**40), digest, digest)
    p = verified_plan
    verdicts = st.builds(
        p.Verdict, count, peer, peer, st.none() | peer, st.none() | count, st.none() | count,
        text, text,
    )  # fmt: skip
    return {
        matchmaking.Declaration: lambda: st.builds(
            matchmaking.Declaration, peer, count, positive, positive, finite, count
        ),
        audit.PartAudit: lambda: part_audits,
        audit.SliceDispute: lambda: slice_disputes,
        audit.AuditRecord: lambda: st.builds(
            audit.AuditRecord,
            count,
            st.binary(max_size=32),
            st.lists(peer, max_size=4).map(tuple),
            st.lists(part_audits, max_size=2).map(tuple),
            st.lists(count, max_size=4).map(tuple),
            st.lists(slice_disputes, max_size=2).map(tuple),
        ),
        p.ClaimsRecord: lambda: st.builds(
            p.ClaimsRecord, digest, st.lists(claim, max_size=p.MAX_CLAIMS).map(tuple)
        ),
        p.Verdict: lambda: verdicts,
        p.VerdictList: lambda: st.builds(p.VerdictList, st.lists(verdicts, max_size=4).map(tuple)),
        pipeline_progress.TrainerProgressRecord: lambda: st.builds(
            pipeline_progress.TrainerProgressRecord,
            count,
            st.none() | finite,
            count,
            finite,
            count,
            finite,
        ),
        progress.JoinAnnouncement: lambda: st.builds(progress.JoinAnnouncement, count),
        pipeline_records.ServerRecord: lambda: st.builds(
            pipeline_records.ServerRecord,
            st.integers(0, pipeline_records.MAX_STAGES - 1),
            st.floats(0.0, pipeline_records.MAX_THROUGHPUT),
            st.integers(0, pipeline_records.MAX_QUEUE),
            st.booleans(),
            st.integers(-1, 2**53),
            digest,
        ),
    }


# Types whose invariants tie fields together get a strategy that builds valid instances.
def _dial_back_responses() -> st.SearchStrategy[Message]:
    """Three parallel tuples of one length: random tuples almost never match, and filtering
    them out made Hypothesis give up now and then (a flaky health check)."""

    def build(ip: str, dials: list[tuple[str, bool, str]]) -> Message:
        return DialBackResponse(ip, *(tuple(col) for col in zip(*dials, strict=True)))  # type: ignore[arg-type]

    dial = st.tuples(st.text(max_size=60), st.booleans(), st.text(max_size=60))
    empty = st.just(DialBackResponse("", (), (), ()))
    dials = st.lists(dial, min_size=1, max_size=2 * MAX_DIALBACK_ADDRS)
    return st.one_of(empty, st.builds(build, st.text(max_size=40), dials))


def _hellos() -> st.SearchStrategy[Message]:
    """An all-reduce ``Hello``: leaf digests come in whole 32-byte digests."""
    return st.builds(
        session_wire.Hello,
        st.text(max_size=40),
        st.binary(max_size=40),
        st.binary(max_size=40),
        st.binary(max_size=64),
        st.integers(0, 2**20),
        st.integers(0, 2**20),
        st.integers(1, 2**20),
        st.integers(0, 40).map(lambda n: bytes(range(32)) * n),
    )


CUSTOM_STRATEGIES = {
    session_wire.Hello: _hellos,
    p2p.tensors.TensorHeader: _tensor_headers,
    **_pipeline_messages(),
    **_bulk_control_messages(),
    progress.ProgressRecord: _progress_records,
    DialBackResponse: _dial_back_responses,
    **_dht_values(),
}


def _instances(cls: type[Message]) -> st.SearchStrategy[Message]:
    if cls in CUSTOM_STRATEGIES:
        return CUSTOM_STRATEGIES[cls]()
    fields = [_strategy_for(hint) for _, hint in cls._FIELDS]

    def build(values: list[Any]) -> Message | None:
        try:
            return cls(*values)
        except (ValueError, TypeError, LocalProtocolError):
            return None  # the type's own invariants reject this combination

    return st.tuples(*fields).map(lambda vs: build(list(vs))).filter(lambda m: m is not None)


def _normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("cls", sorted(registered_types().values(), key=lambda c: c.TYPE_CODE))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_registered_message_round_trips(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(_instances(cls))
    try:
        wire = encode(msg)
    except LocalProtocolError:
        return  # over its own size limit: refused on the way out, which is the point
    back = decode(wire, cls)
    assert type(back) is cls
    assert _normalise(back.to_wire()) == _normalise(msg.to_wire())


def test_tensor_header_round_trip_with_a_real_array() -> None:
    header = p2p.tensors.header_for(np.zeros((3, 4), dtype=np.float32))
    assert decode(encode(header), p2p.tensors.TensorHeader) == header


@given(st.binary(max_size=256))
def test_garbage_decodes_or_raises_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode(data)


@given(st.binary(max_size=256), st.integers(min_value=1, max_value=8))
def test_frame_decoder_garbage_whole_or_bytewise(data: bytes, step: int) -> None:
    dec = FrameDecoder(max_frame_bytes=64)
    try:
        for i in range(0, len(data), step):
            dec.receive_data(data[i : i + step])
            while (payload := dec.next_frame()) is not None:
                assert len(payload) <= 64
        dec.receive_data(b"")
        while dec.next_frame() is not None:
            pass
    except RemoteProtocolError:
        pass


def test_frame_limit_is_checked_before_the_body_arrives() -> None:
    dec = FrameDecoder(max_frame_bytes=1024)
    dec.receive_data(struct.pack(">I", 0xFFFFFFFF))  # header only: 4 GiB announced
    with pytest.raises(RemoteProtocolError, match="exceeds limit"):
        dec.next_frame()


def test_frames_split_anywhere_reassemble() -> None:
    stream = frame(b"hello") + frame(b"") + frame(b"x" * 100)
    dec = FrameDecoder(max_frame_bytes=100)
    out = []
    for byte in stream:
        dec.receive_data(bytes([byte]))
        while (payload := dec.next_frame()) is not None:
            out.append(payload)
    assert out == [b"hello", b"", b"x" * 100]


def test_truncated_frame_at_eof_is_an_error() -> None:
    dec = FrameDecoder(max_frame_bytes=100)
    dec.receive_data(frame(b"hello")[:-1])
    assert dec.next_frame() is None
    dec.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="short"):
        dec.next_frame()


@message(9001, max_bytes=128)
class _Sample(Message):
    name: str
    sizes: list[int]
    blob: bytes | None


def test_schema_violations_are_remote_protocol_errors() -> None:
    def raw(body: Any, code: int = 9001, version: int = PROTOCOL_VERSION) -> bytes:
        return msgpack.packb([version, code, body], use_bin_type=True)

    assert decode(raw(["a", [1, 2], None]), _Sample) == _Sample("a", [1, 2], None)
    for bad, why in [
        (raw(["a", [1, "2"], None]), "expected int"),
        (raw([1, [], None]), "expected str"),
        (raw(["a", [], None, "extra"]), "list of 3"),
        (raw(["a", [True], None]), "bool"),
        (raw(["a", [], None], code=424242), "unknown message type"),
        (raw(["a", [], None], version=99), "version"),
        (raw(["a", [], b"x" * 200]), "bytes >"),
    ]:
        with pytest.raises(RemoteProtocolError, match=why):
            decode(bad)


@message(9002, max_bytes=256)
class _Inner(Message):
    pair: tuple[bytes, float]


@message(9003, max_bytes=256)
class _Outer(Message):
    items: tuple[_Inner, ...]
    best: _Inner | None


def test_nested_messages_and_fixed_tuples_travel_as_bodies_and_are_checked() -> None:
    msg = _Outer((_Inner((b"a", 1.0)), _Inner((b"b", 2))), None)
    assert msg.to_wire() == [[[(b"a", 1.0)], [(b"b", 2)]], None]  # tuples pack as arrays
    back = decode(encode(msg), _Outer)
    assert back == msg and isinstance(back.items[1], _Inner) and back.items[1].pair == (b"b", 2.0)

    def raw(body: Any) -> bytes:
        return msgpack.packb([PROTOCOL_VERSION, 9003, body], use_bin_type=True)

    for bad, why in [
        ([[[[b"a", 1.0, 3]]], None], "expected 2 items"),
        ([[[[1.0, b"a"]]], None], "expected bytes"),
        ([[[b"a", 1.0]], None], "list of 1"),  # an inner body without its list
        ([[], [[b"a"]]], "no union member matched"),
    ]:
        with pytest.raises(RemoteProtocolError, match=why):
            decode(raw(bad), _Outer)


def test_an_oversized_value_of_an_expected_type_is_refused_before_parsing() -> None:
    with pytest.raises(RemoteProtocolError, match="over its limit"):
        decode(b"\xc1" * 300, _Outer)  # garbage, but its size alone settles it


def test_unexpected_type_is_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="unexpected message"):
        decode(encode(_Sample("a", [], None)), p2p.tensors.TensorHeader)


def test_duplicate_type_code_fails_at_definition() -> None:
    with pytest.raises(LocalProtocolError, match="9001"):

        @message(9001)
        class _Clash(Message):
            x: int


def test_oversized_message_is_refused_on_send() -> None:
    with pytest.raises(LocalProtocolError):
        encode(_Sample("a" * 500, [], None))


def test_tensor_header_invariants() -> None:
    with pytest.raises(ValueError):
        p2p.tensors.TensorHeader("float32", [2, 2], 15, 1024)  # 2*2*4 != 15
    with pytest.raises(ValueError):
        p2p.tensors.TensorHeader("object", [1], 8, 1024)  # dtype not allowed
    with pytest.raises(ValueError):
        p2p.tensors.TensorHeader("float32", [-1], -4, 1024)


class _BrokenStream:
    """A stream whose transport fails the way libp2p's does when the peer dies, or with a bug."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def read(self, n: int | None = None) -> bytes:
        raise self.exc

    async def write(self, data: bytes) -> None:
        raise self.exc


def _write_then_read(stream: _BrokenStream) -> list[BaseException]:
    async def both() -> list[BaseException]:
        raised = []
        for call in (write_frame(stream, b"x"), read_frame(stream, 16)):
            try:
                await call
            except Exception as exc:
                raised.append(exc)
        return raised

    return trio.run(both)


@pytest.mark.parametrize(
    "exc",
    [
        StreamError("Write operation failed: Broken pipe"),
        StreamReset("reset by peer"),
        ConnectionClosedError("TCP connection reset by remote peer"),
        BrokenPipeError(32, "Broken pipe"),
        trio.BrokenResourceError(),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_broken_transport_is_stream_ended_on_read_and_write(exc: Exception) -> None:
    # A peer dying under a write once escaped as libp2p's StreamError and crashed a trainer that
    # catches P2PError around every hop.
    raised = _write_then_read(_BrokenStream(exc))
    assert len(raised) == 2 and all(isinstance(r, StreamEnded) for r in raised), raised
    assert all(r.__cause__ is exc for r in raised)


def test_a_bug_under_the_stream_is_not_dressed_as_a_departed_peer() -> None:
    bug = TypeError("bug")
    assert _write_then_read(_BrokenStream(bug)) == [bug, bug]
