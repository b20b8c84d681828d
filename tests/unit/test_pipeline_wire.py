"""Pipeline wire messages: tensors round-trip exactly, and garbage is a RemoteProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p import RemoteProtocolError, decode, encode
from swarm.pipeline.wire import (
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    HopRefused,
    ParamsReply,
    ParamsRequest,
    from_fields,
    to_fields,
)

TYPES = (ForwardRequest, ForwardReply, BackwardRequest, BackwardReply, HopRefused)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=10),
    max_leaves=20,
)  # fmt: skip
framed = st.builds(
    lambda code, body: msgpack.packb([1, code, body], use_bin_type=True),
    st.sampled_from([t.TYPE_CODE for t in (*TYPES, ParamsRequest, ParamsReply)]),
    st.lists(values, max_size=10),
)


@given(st.binary(max_size=2048) | framed)
def test_garbage_parses_or_is_a_remote_protocol_error(data: bytes) -> None:
    """Every bad body of every pipeline message type is refused the one documented way."""
    try:
        msg = decode(data, *TYPES, ParamsRequest, ParamsReply)
    except RemoteProtocolError:
        return
    assert decode(encode(msg), type(msg)) == msg


def test_tensors_round_trip_bit_exactly() -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    request = ForwardRequest("run", 1, b"m" * 16, *to_fields(x))
    back = decode(encode(request), ForwardRequest)
    y = from_fields(back.dtype, back.shape, back.data)
    assert y is not None and y.dtype == np.float32 and np.array_equal(x, y)
    assert y.flags.writeable  # torch.from_numpy wants writable memory
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    grad = np.ones((2, 3, 4), np.float32)
    request = BackwardRequest("run", 0, b"m", *to_fields(grad), *to_fields(ids))
    back = decode(encode(request), BackwardRequest)
    assert np.array_equal(from_fields(back.input_dtype, back.input_shape, back.input_data), ids)
    none = decode(encode(BackwardReply(b"m", *to_fields(None))), BackwardReply)
    assert from_fields(none.dtype, none.shape, none.data) is None


@pytest.mark.parametrize(
    "fields",
    [
        ("float64", [2], b"\x00" * 16),  # dtype not allowed
        ("float32", [2, 2], b"\x00" * 12),  # shape does not match the bytes
        ("float32", [-1], b""),  # negative dimension
        ("float32", [1] * 9, b"\x00" * 4),  # too many dimensions
    ],
)
def test_bad_tensor_fields_are_refused(fields: tuple[str, list[int], bytes]) -> None:
    with pytest.raises(ValueError):
        ForwardRequest("run", 0, b"m", *fields)
    bogus = encode(ForwardReply(b"m", "float32", [1], b"\x00" * 4)).replace(b"float32", b"float64")
    with pytest.raises(RemoteProtocolError):
        decode(bogus, ForwardReply)


def test_microbatch_id_is_bounded() -> None:
    with pytest.raises(ValueError):
        ForwardRequest("run", 0, b"x" * 33, *to_fields(np.zeros(1, np.float32)))
    with pytest.raises(ValueError):
        ForwardRequest("run", 0, b"", *to_fields(np.zeros(1, np.float32)))
