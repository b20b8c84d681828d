"""All-reduce codecs, no sockets: round trips within each codec's documented bound, exact sizes,
bit-for-bit determinism, and garbage either decodes or is a RemoteProtocolError."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from p2p import RemoteProtocolError
from swarm.averaging.codec import (
    INT8_BLOCK_SIZE,
    Compression,
    choose,
    decode,
    encode,
    wire_bytes,
)

ALL = list(Compression)
FP16_MAX = 65504.0


def _float32_arrays(max_abs: float | None = None, max_size: int = 3000) -> st.SearchStrategy:
    max_abs = None if max_abs is None else float(np.float32(max_abs))
    elements = st.floats(
        width=32,
        allow_nan=False,
        allow_infinity=False,
        min_value=None if max_abs is None else -max_abs,
        max_value=max_abs,
    )
    return hnp.arrays(np.float32, st.integers(0, max_size), elements=elements)


def _int8_scales(data: bytes, numel: int) -> np.ndarray:
    blocks = -(-numel // INT8_BLOCK_SIZE)
    return np.frombuffer(data, dtype="<f4", count=blocks).astype(np.float64)


# --- round trips within the documented bounds -------------------------------------------------


@given(_float32_arrays())
def test_none_is_exact(x: np.ndarray) -> None:
    y = decode(encode(x, Compression.NONE), Compression.NONE, x.size)
    assert y.dtype == np.float32 and y.flags.writeable
    assert y.tobytes() == x.tobytes()


@given(_float32_arrays(max_abs=FP16_MAX))
def test_fp16_error_is_half_an_ulp(x: np.ndarray) -> None:
    y = decode(encode(x, Compression.FP16), Compression.FP16, x.size)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = np.maximum(2.0**-11 * np.abs(x.astype(np.float64)), 2.0**-25)
    assert (err <= bound).all()


@given(_float32_arrays(max_abs=3.0e38))
def test_bf16_error_is_half_an_ulp(x: np.ndarray) -> None:
    y = decode(encode(x, Compression.BF16), Compression.BF16, x.size)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = np.maximum(2.0**-8 * np.abs(x.astype(np.float64)), 2.0**-134)
    assert (err <= bound).all()


@given(_float32_arrays(max_abs=2.0e38))
def test_int8_error_is_half_a_step_per_block(x: np.ndarray) -> None:
    data = encode(x, Compression.INT8)
    y = decode(data, Compression.INT8, x.size)
    scales = np.repeat(_int8_scales(data, x.size), INT8_BLOCK_SIZE)[: x.size]
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert (err <= scales * (0.5 + 2.0**-16) + 2.0**-150).all()
    # The scale is max|x| / 127 rounded up, by at most one float32 ulp.
    for block, scale in enumerate(_int8_scales(data, x.size)):
        max_abs = np.abs(x[block * INT8_BLOCK_SIZE : (block + 1) * INT8_BLOCK_SIZE]).max()
        assert 127 * scale >= max_abs
        assert scale <= np.nextafter(np.float32(max_abs / 127.0), np.float32(np.inf))


@pytest.mark.parametrize("numel", [1, 1023, 1024, 1025, 3 * 1024, 5000])
def test_int8_block_edges_and_zero_blocks(numel: int) -> None:
    x = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    x[: min(numel, INT8_BLOCK_SIZE)] = 0  # the first block is all zeros
    data = encode(x, Compression.INT8)
    assert _int8_scales(data, numel)[0] == 0
    y = decode(data, Compression.INT8, numel)
    assert (y[:INT8_BLOCK_SIZE] == 0).all()
    assert np.abs(y - x).max() <= _int8_scales(data, numel).max() * 0.5 * (1 + 2**-15)


def test_int8_subnormal_blocks_keep_the_bound() -> None:
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    x = (np.arange(-300, 300, dtype=np.float32) * tiny).astype(np.float32)
    data = encode(x, Compression.INT8)
    scale = _int8_scales(data, x.size)[0]
    assert scale > 0 and 127 * scale >= 300 * float(tiny)
    y = decode(data, Compression.INT8, x.size)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert (err <= scale * (0.5 + 2.0**-16) + 2.0**-150).all()


def test_int8_cosine_similarity_on_gaussian_data() -> None:
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    y = decode(encode(x, Compression.INT8), Compression.INT8, x.size)
    cosine = float(np.dot(x, y.astype(np.float64)) / (np.linalg.norm(x) * np.linalg.norm(y)))
    assert cosine >= 0.999, cosine


# --- sizes and determinism ----------------------------------------------------------------------


@settings(max_examples=50)
@given(_float32_arrays(max_abs=FP16_MAX), st.sampled_from(ALL))
def test_wire_bytes_is_the_encoded_length(x: np.ndarray, compression: Compression) -> None:
    assert len(encode(x, compression)) == wire_bytes(x.size, compression)


def test_wire_bytes_values() -> None:
    assert wire_bytes(0, Compression.INT8) == 0
    assert wire_bytes(1025, Compression.NONE) == 4100
    assert wire_bytes(1025, Compression.FP16) == 2050
    assert wire_bytes(1025, Compression.BF16) == 2050
    assert wire_bytes(1025, Compression.INT8) == 8 + 1025
    with pytest.raises(ValueError):
        wire_bytes(-1, Compression.NONE)


@given(_float32_arrays(max_abs=FP16_MAX), st.sampled_from(ALL))
def test_encoding_is_deterministic_and_shape_blind(x: np.ndarray, compression: Compression) -> None:
    data = encode(x, compression)
    assert encode(x.copy(), compression) == data
    if x.size % 2 == 0 and x.size:
        assert encode(x.reshape(2, -1), compression) == data
        assert encode(np.asfortranarray(x.reshape(2, -1).T).T, compression) == data


@given(_float32_arrays())
def test_bf16_matches_torch_bit_for_bit(x: np.ndarray) -> None:
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16)
    if not torch.isfinite(expected).all():
        return  # rounded past bfloat16's max: our encoder refuses, tested below
    ours = np.frombuffer(encode(x, Compression.BF16), dtype="<u2")
    assert ours.tobytes() == expected.view(torch.int16).numpy().astype("<i2").tobytes()


@given(_float32_arrays(max_abs=FP16_MAX))
def test_fp16_matches_torch_bit_for_bit(x: np.ndarray) -> None:
    expected = torch.from_numpy(x.copy()).to(torch.float16).numpy().astype("<f2")
    assert encode(x, Compression.FP16) == expected.tobytes()


def test_golden_bytes() -> None:
    """Pinned bytes: a change here breaks compatibility with peers running the old code."""
    x = np.array([1.0, -2.5, 1 / 3, 1e-3, 0.0, 100.0], dtype=np.float32)
    assert encode(x, Compression.FP16).hex() == "003c00c15535191400004056"
    assert encode(x, Compression.BF16).hex() == "803f20c0ab3e833a0000c842"
    assert encode(x, Compression.INT8).hex() == "2793493f01fd0000007f"
    # Ties go to even: 1 + 2**-8 is halfway between two bfloat16 values.
    tie = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)
    assert encode(tie, Compression.BF16).hex() == "803f823f"
    # int8 codes use round-half-to-even too: 0.5 and 1.5 steps.
    halves = np.array([127.0, 0.5, 1.5, -0.5, -2.5], dtype=np.float32)
    codes = np.frombuffer(encode(halves, Compression.INT8)[4:], dtype=np.int8)
    assert codes.tolist() == [127, 0, 2, 0, -2]


# --- encoder refusals (our input) ---------------------------------------------------------------


@pytest.mark.parametrize("compression", ALL)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_non_finite(compression: Compression, bad: float) -> None:
    with pytest.raises(ValueError):
        encode(np.array([1.0, bad], dtype=np.float32), compression)


def test_encode_refuses_wrong_dtype_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        encode(np.zeros(3, dtype=np.float64), Compression.NONE)
    with pytest.raises(ValueError):
        encode(np.array([65520.0], dtype=np.float32), Compression.FP16)
    assert encode(np.array([65519.0], dtype=np.float32), Compression.FP16) == b"\xff\x7b"
    with pytest.raises(ValueError):
        encode(np.array([np.finfo(np.float32).max], dtype=np.float32), Compression.BF16)
    with pytest.raises(ValueError):
        encode(np.array([np.finfo(np.float32).max], dtype=np.float32), Compression.INT8)


# --- decoder refusals (the peer's input) --------------------------------------------------------


@pytest.mark.parametrize("compression", ALL)
def test_decode_refuses_wrong_length(compression: Compression) -> None:
    data = encode(np.ones(1500, dtype=np.float32), compression)
    for bad in (data[:-1], data + b"\0", b"", data * 2):
        with pytest.raises(RemoteProtocolError):
            decode(bad, compression, 1500)
    # A huge claimed numel is refused by length, before anything that size is allocated.
    with pytest.raises(RemoteProtocolError):
        decode(data, compression, 1 << 60)


@pytest.mark.parametrize(
    "compression, payload",
    [
        (Compression.NONE, np.array([1.0, np.nan], dtype="<f4").tobytes()),
        (Compression.NONE, np.array([np.inf, 1.0], dtype="<f4").tobytes()),
        (Compression.FP16, np.array([1.0, np.inf], dtype="<f2").tobytes()),
        (Compression.FP16, b"\x01\x7e\x00\x00"),  # a NaN pattern
        (Compression.BF16, b"\x80\x7f\x00\x00"),  # +inf
        (Compression.BF16, b"\x00\x00\xc1\xff"),  # a NaN pattern
    ],
)
def test_decode_refuses_non_finite_values(compression: Compression, payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(payload, compression, 2)


@pytest.mark.parametrize(
    "scale", [math.nan, math.inf, -math.inf, -1.0, -0.0, float(np.finfo(np.float32).max)]
)
def test_decode_refuses_bad_int8_scales(scale: float) -> None:
    payload = np.array([scale], dtype="<f4").tobytes() + bytes([1, 2, 3])
    with pytest.raises(RemoteProtocolError):
        decode(payload, Compression.INT8, 3)


def test_decode_refuses_int8_code_minus_128() -> None:
    payload = np.array([1.0], dtype="<f4").tobytes() + bytes([0x80])
    with pytest.raises(RemoteProtocolError):
        decode(payload, Compression.INT8, 1)


@given(st.binary(max_size=6000), st.sampled_from(ALL), st.integers(0, 6000))
def test_garbage_decodes_or_is_a_remote_protocol_error(
    data: bytes, compression: Compression, numel: int
) -> None:
    try:
        y = decode(data, compression, numel)
    except RemoteProtocolError:
        return
    assert y.dtype == np.float32 and y.shape == (numel,) and np.isfinite(y).all()


@given(st.sampled_from(ALL), st.integers(0, 4000), st.data())
def test_garbage_of_the_right_length_decodes_or_is_a_remote_protocol_error(
    compression: Compression, numel: int, data: st.DataObject
) -> None:
    size = wire_bytes(numel, compression)
    payload = data.draw(st.binary(min_size=size, max_size=size))
    try:
        y = decode(payload, compression, numel)
    except RemoteProtocolError:
        return
    assert y.shape == (numel,) and np.isfinite(y).all()


def test_compression_codes_from_the_wire() -> None:
    assert [Compression.from_wire(c.value) for c in ALL] == ALL
    for bad in (4, -1, True, 1.0, "1", None):
        with pytest.raises(RemoteProtocolError):
            Compression.from_wire(bad)


# --- the default ---------------------------------------------------------------------------------


def test_choose_keeps_small_tensors_exact_and_quantizes_large_ones() -> None:
    assert choose(0) is Compression.NONE
    assert choose(1 << 16) is Compression.NONE
    assert choose((1 << 16) + 1) is Compression.INT8
    assert choose(25_000_000) is Compression.INT8
    with pytest.raises(ValueError):
        choose(-1)


def test_bf16_and_fp16_match_torch_on_random_bit_patterns_and_ties() -> None:
    """Every exponent, subnormals and exact ties, which Hypothesis's float draws rarely hit."""
    bits = np.random.default_rng(1).integers(0, 1 << 32, size=1 << 18, dtype=np.uint32)
    bits[::3] = (bits[::3] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # bf16 ties
    bits[1::3] = (bits[1::3] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # fp16 ties
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < np.float32(3.0e38))]
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    assert encode(x, Compression.BF16) == expected.astype("<i2").tobytes()
    small = x[np.abs(x) <= FP16_MAX]
    expected_half = torch.from_numpy(small.copy()).to(torch.float16).numpy()
    assert encode(small, Compression.FP16) == expected_half.astype("<f2").tobytes()
