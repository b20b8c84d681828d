"""GlobalState: canonical hash, byte encoding round trip, and a loader that trusts nothing."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import GlobalState, layout_digest

torch.set_num_threads(1)
LAYOUT = layout_digest([("w", (2, 3)), ("b", (3,))])


def _state(round: int = 7) -> GlobalState:
    generator = torch.Generator().manual_seed(round)
    return GlobalState(round, torch.randn(9, generator=generator), torch.randn(9), LAYOUT)


def test_round_trip_keeps_every_bit_and_the_hash() -> None:
    state = _state()
    data = state.to_bytes()
    again = GlobalState.from_bytes(data)
    assert again.round == 7 and again.layout == LAYOUT
    assert again.params.numpy().tobytes() == state.params.numpy().tobytes()
    assert again.momentum.numpy().tobytes() == state.momentum.numpy().tobytes()
    assert again.state_hash() == state.state_hash()
    # The encoding ends with the hash, so downloaded bytes carry what they must match.
    assert data[-32:].hex() == state.state_hash()


def test_hash_changes_with_round_one_bit_or_layout() -> None:
    state = _state()
    assert GlobalState(8, state.params, state.momentum, LAYOUT).state_hash() != state.state_hash()
    flipped = state.params.clone()
    flipped.view(torch.int32)[3] ^= 1
    assert GlobalState(7, flipped, state.momentum, LAYOUT).state_hash() != state.state_hash()
    other_layout = layout_digest([("w", (3, 2)), ("b", (3,))])
    assert other_layout != LAYOUT
    assert GlobalState(7, state.params, state.momentum, other_layout).state_hash() != (
        state.state_hash()
    )


def test_constructor_refuses_bad_tensors() -> None:
    with pytest.raises(ValueError):
        GlobalState(0, torch.zeros(3), torch.zeros(4), LAYOUT)
    with pytest.raises(ValueError):
        GlobalState(0, torch.zeros(3, dtype=torch.float64), torch.zeros(3), LAYOUT)
    with pytest.raises(ValueError):
        GlobalState(0, torch.zeros(3), torch.zeros(3), b"short")


def test_every_truncation_and_every_bit_flip_is_a_value_error() -> None:
    data = _state().to_bytes()
    for length in range(len(data)):
        with pytest.raises(ValueError):
            GlobalState.from_bytes(data[:length])
    for index in range(len(data)):
        corrupted = bytearray(data)
        corrupted[index] ^= 0x10
        with pytest.raises(ValueError):
            GlobalState.from_bytes(bytes(corrupted))
    with pytest.raises(ValueError, match=r"unexpected bytes|digest"):
        GlobalState.from_bytes(data[:-32] + b"x" + data[-32:])


def test_a_huge_size_claim_is_refused_before_allocating() -> None:
    data = bytearray(_state().to_bytes())
    # The first tensor's (numel, nbytes) follow header, name length, "params", dtype and ndim.
    offset = struct.calcsize("<8sIQ32sI") + 2 + len(b"params") + 2
    struct.pack_into("<QQ", data, offset, 2**40, 2**42)
    with pytest.raises(ValueError, match="elements"):
        GlobalState.from_bytes(bytes(data))
    struct.pack_into("<QQ", data, offset, 2**30, 2**32)
    with pytest.raises(ValueError, match="end inside"):
        GlobalState.from_bytes(bytes(data))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        GlobalState.from_bytes(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=300), st.binary(min_size=1, max_size=8))
def test_spliced_garbage_is_a_value_error(position: int, junk: bytes) -> None:
    data = _state().to_bytes()
    spliced = data[:position] + junk + data[position + len(junk) :]
    if spliced == data:
        return
    with pytest.raises(ValueError):
        GlobalState.from_bytes(spliced)
