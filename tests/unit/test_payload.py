"""Per-tensor codecs over slices of the flat vector (swarm.averaging.payload.Layout): no sockets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import RemoteProtocolError
from swarm import Compression
from swarm.averaging.codec import wire_bytes
from swarm.averaging.payload import Layout

CODECS = list(Compression)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(CODECS)), min_size=1, max_size=6),
    st.data(),
)
def test_any_slice_round_trips_segment_by_segment(tensors, data):
    layout = Layout(tuple(n for n, _ in tensors), tuple(c for _, c in tensors))
    vector = np.random.default_rng(0).standard_normal(layout.numel).astype(np.float32)
    start = data.draw(st.integers(0, layout.numel))
    stop = data.draw(st.integers(start, layout.numel))
    pieces = layout.segments(start, stop)
    assert sum(b - a for a, b, _ in pieces) == stop - start
    for a, b, codec in pieces:  # each segment lies inside one tensor, with that tensor's codec
        index = max(i for i, off in enumerate(layout.offsets[:-1]) if off <= a)
        assert b <= layout.offsets[index + 1] and codec is layout.codecs[index]
    payload = layout.encode(vector[start:stop], start)
    assert len(payload) == layout.wire_bytes(start, stop)
    decoded = layout.decode(payload, start, stop)
    assert decoded.dtype == np.float32 and len(decoded) == stop - start
    # What the wire carries is stable: decoding is what round_trip promises.
    assert decoded.tobytes() == layout.round_trip(vector[start:stop], start).tobytes()
    if layout.lossless():
        assert decoded.tobytes() == vector[start:stop].tobytes()


def test_wrong_lengths_and_nan_are_the_peers_fault():
    layout = Layout((10, 3000), (Compression.NONE, Compression.INT8))
    vector = np.ones(layout.numel, dtype=np.float32)
    payload = bytes(layout.encode(vector[5:2000], 5))
    for bad in (payload[:-1], payload + b"\0"):
        with pytest.raises(RemoteProtocolError):
            layout.decode(bad, 5, 2000)
    nan = bytearray(payload)
    nan[0:4] = np.float32("nan").tobytes()
    with pytest.raises(RemoteProtocolError):
        layout.decode(nan, 5, 2000)


def test_auto_codecs_and_digest():
    auto = Layout.for_sizes([100, 1 << 17], None)
    assert auto.codecs == (Compression.NONE, Compression.INT8)
    assert auto.wire_bytes(0, auto.numel) == 400 + wire_bytes(1 << 17, Compression.INT8)
    forced = Layout.for_sizes([100, 1 << 17], Compression.NONE)
    assert forced.digest != auto.digest  # peers with different codecs refuse each other
    assert Layout.for_sizes([100, 1 << 17], None).digest == auto.digest
    with pytest.raises(ValueError):
        auto.segments(0, auto.numel + 1)
