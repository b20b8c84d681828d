"""Tensors on the wire: dtype from an allow-list, shape, little-endian raw bytes.

The header is validated before a single data byte is accepted: the dtype must be allowed, the
shape non-negative, ``prod(shape) * itemsize == nbytes``, and ``nbytes`` within the reader's limit,
so the receiver allocates exactly once, exactly what the header promised.
"""

from __future__ import annotations

import math

import numpy as np

from p2p.wire import Message, message

# bfloat16 travels as its raw 2-byte pattern under the name "bfloat16"; numpy has no such dtype,
# so it is received as uint16 and reinterpreted by the torch side.
_ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        *("float64", "float32", "float16"),
        *("int64", "int32", "int16", "int8", "uint16", "uint8", "bool"),
    )
}
_ALLOWED_DTYPES["bfloat16"] = np.dtype("<u2")

MAX_TENSOR_DIMS = 8
DEFAULT_CHUNK_BYTES = 1 << 20


def wire_dtype(name: str) -> np.dtype:
    try:
        return _ALLOWED_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not allowed") from None


@message(3, max_bytes=1024)
class TensorHeader(Message):
    """Announces a tensor whose raw bytes follow in ``ceil(nbytes / chunk_bytes)`` frames."""

    dtype: str
    shape: list[int]
    nbytes: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        itemsize = wire_dtype(self.dtype).itemsize
        if len(self.shape) > MAX_TENSOR_DIMS or any(d < 0 for d in self.shape):
            raise ValueError(f"bad shape {self.shape}")
        if math.prod(self.shape) * itemsize != self.nbytes:
            raise ValueError(f"shape {self.shape} x {itemsize} B != nbytes {self.nbytes}")
        if not 0 < self.chunk_bytes <= 16 << 20:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} out of range")

    @property
    def num_chunks(self) -> int:
        return -(-self.nbytes // self.chunk_bytes)


def header_for(array: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TensorHeader:
    name = array.dtype.name
    wire_dtype(name)
    return TensorHeader(name, list(array.shape), array.nbytes, chunk_bytes)


def as_wire_bytes(array: np.ndarray) -> memoryview:
    """The array's bytes in little-endian C order, without a copy where possible."""
    wanted = wire_dtype(array.dtype.name)
    if array.size == 0:
        return memoryview(b"")  # memoryview.cast refuses a shape with a zero in it
    if array.dtype != wanted or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array, dtype=wanted)
    return memoryview(array).cast("B")


def from_wire_bytes(header: TensorHeader, data: bytearray) -> np.ndarray:
    return np.frombuffer(data, dtype=wire_dtype(header.dtype)).reshape(header.shape)
