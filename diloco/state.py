"""The global state every peer of a run holds bit-identically, its hash, and its byte encoding.

The global state is the flat float32 global parameters, the flat float32 outer momentum buffer and
the round number, tied to a parameter layout (names, shapes) by ``layout_digest``. Every peer
publishes ``state_hash()`` each round; peers that disagree with the majority re-sync by downloading
``to_bytes()`` from others, so the encoding is also a wire format: nothing from it is trusted.

Encoding (all integers little-endian; no pickle, no torch.save)::

    magic      8 bytes  b"DLCSTATE"
    version    u32      1
    round      u64
    layout     32 bytes sha256 of the parameter layout
    count      u32      number of tensors (2: "params", then "momentum")
    per tensor: name_len u16, name utf-8, dtype u8 (1 = float32), ndim u8, dims u64 each,
                nbytes u64, raw little-endian data
    digest     32 bytes sha256 of everything above

``state_hash()`` is that trailing digest: the hash of the canonical encoding (names in fixed order,
dtype, shape, raw bytes), so the bytes a joiner downloads carry the hash it must match.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"DLCSTATE"
VERSION = 1
TENSOR_NAMES = ("params", "momentum")
_DTYPE_FLOAT32 = 1
_HEADER = struct.Struct("<8sIQ32sI")
_DIGEST_BYTES = 32
# A flat vector longer than this is refused before anything is allocated (8 GiB of float32).
MAX_ELEMENTS = 2**31


def layout_digest(named_shapes: Sequence[tuple[str, Sequence[int]]]) -> bytes:
    """sha256 over parameter names and shapes in order: two peers with equal digests flatten
    their models the same way."""
    hasher = hashlib.sha256(b"swarmtrain/diloco/layout/1")
    for name, shape in named_shapes:
        hasher.update(struct.pack("<H", len(name.encode())) + name.encode())
        hasher.update(struct.pack(f"<B{len(shape)}Q", len(shape), *shape))
    return hasher.digest()


def _le_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as little-endian float32: its own memory on a little-endian host (no
    copy: the state of a 100M-parameter model is 800 MB), a converted copy elsewhere."""
    return np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype="<f4")


def tensor_head(name: str, numel: int) -> bytes:
    """The bytes before a flat float32 tensor's data in the encoding."""
    encoded = name.encode()
    return (
        struct.pack("<H", len(encoded))
        + encoded
        + struct.pack("<BBQQ", _DTYPE_FLOAT32, 1, numel, 4 * numel)
    )


def encoded_size(numel: int) -> int:
    """Length of the encoding of a state of ``numel`` parameters."""
    names = sum(2 + len(name.encode()) + 18 for name in TENSOR_NAMES)
    return _HEADER.size + names + 8 * numel + _DIGEST_BYTES


@dataclass
class GlobalState:
    """Flat float32 global parameters and outer momentum (CPU, equal length) at ``round``."""

    round: int
    params: torch.Tensor
    momentum: torch.Tensor
    layout: bytes

    def __post_init__(self) -> None:
        for name in TENSOR_NAMES:
            tensor = getattr(self, name)
            if tensor.dtype != torch.float32 or tensor.dim() != 1 or tensor.device.type != "cpu":
                raise ValueError(f"GlobalState.{name} must be a 1-D float32 CPU tensor")
        if self.params.shape != self.momentum.shape:
            raise ValueError("GlobalState params and momentum differ in length")
        if not 0 <= self.round < 2**64 or len(self.layout) != 32:
            raise ValueError("GlobalState round out of range or layout digest not 32 bytes")

    def _pieces(self) -> Iterator[bytes | np.ndarray]:
        """The encoding without its digest, piece by piece; the tensors' pieces are views of
        their memory, so hashing or writing the state never holds a second copy of it."""
        yield _HEADER.pack(MAGIC, VERSION, self.round, self.layout, len(TENSOR_NAMES))
        for name in TENSOR_NAMES:
            tensor = getattr(self, name)
            yield tensor_head(name, tensor.numel())
            yield _le_view(tensor)

    def encoded_size(self) -> int:
        """Length of ``to_bytes()``, without encoding."""
        return encoded_size(self.params.numel())

    def write_to(self, write: Callable[[bytes], object]) -> bytes:
        """Hand ``to_bytes()`` to ``write`` piece by piece (the tensors as views of their
        memory); returns the digest (the state hash)."""
        hasher = hashlib.sha256()
        for piece in self._pieces():
            hasher.update(piece)
            write(piece)  # type: ignore[arg-type]  # an ndarray is bytes-like
        digest = hasher.digest()
        write(digest)
        return digest

    def to_bytes(self) -> bytes:
        pieces = list(self._pieces())
        hasher = hashlib.sha256()
        for piece in pieces:
            hasher.update(piece)
        return b"".join([*pieces, hasher.digest()])  # one copy: the pieces are views

    def state_hash(self) -> str:
        """SHA-256 hex of the canonical encoding; equal hashes mean bit-identical states."""
        hasher = hashlib.sha256()
        for piece in self._pieces():
            hasher.update(piece)
        return hasher.hexdigest()

    def clone(self) -> GlobalState:
        return GlobalState(self.round, self.params.clone(), self.momentum.clone(), self.layout)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> GlobalState:
        """Decode and verify ``data``. Every length is checked against what remains before a
        tensor is built. Raises ValueError naming what is wrong: short input, bad magic or
        version, unexpected names, dtype or shape, trailing bytes, or a digest mismatch."""
        round_, layout, arrays = parse(data)
        # astype copies into native order and owns the memory, so the tensor outlives ``data``.
        params, momentum = (torch.from_numpy(a.astype(np.float32)) for a in arrays)
        return cls(round_, params, momentum, layout)


def parse(data: bytes | bytearray | memoryview) -> tuple[int, bytes, tuple[np.ndarray, ...]]:
    """Verify an encoded state without copying it: (round, layout, (params, momentum)) with the
    two vectors as little-endian float32 views of ``data``. ValueError as ``from_bytes``."""
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size + _DIGEST_BYTES:
        raise ValueError(f"state bytes too short ({len(view)} bytes)")
    body, digest = view[:-_DIGEST_BYTES], bytes(view[-_DIGEST_BYTES:])
    magic, version, round_, layout, count = _HEADER.unpack_from(body, 0)
    if magic != MAGIC:
        raise ValueError("state bytes do not start with the DLCSTATE magic")
    if version != VERSION:
        raise ValueError(f"state encoding version {version} is not {VERSION}")
    if count != len(TENSOR_NAMES):
        raise ValueError(f"state holds {count} tensors, expected {len(TENSOR_NAMES)}")
    position = _HEADER.size
    arrays = []
    for expected in TENSOR_NAMES:
        position, array = _read_tensor(body, position, expected)
        arrays.append(array)
    if position != len(body):
        raise ValueError(f"{len(body) - position} unexpected bytes after the tensors")
    if arrays[0].shape != arrays[1].shape:
        raise ValueError("GlobalState params and momentum differ in length")
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("state digest mismatch: the bytes are corrupt or tampered with")
    return round_, layout, tuple(arrays)


def _need(body: memoryview, position: int, size: int, what: str) -> None:
    if size < 0 or position + size > len(body):
        raise ValueError(f"state bytes end inside {what}")


def _read_tensor(body: memoryview, position: int, expected: str) -> tuple[int, np.ndarray]:
    _need(body, position, 2, "a tensor name length")
    (name_len,) = struct.unpack_from("<H", body, position)
    position += 2
    _need(body, position, name_len, "a tensor name")
    name = bytes(body[position : position + name_len])
    position += name_len
    if name != expected.encode():
        raise ValueError(f"expected tensor {expected!r}, found {name!r}")
    _need(body, position, 2, f"{expected}'s dtype and ndim")
    dtype, ndim = struct.unpack_from("<BB", body, position)
    position += 2
    if dtype != _DTYPE_FLOAT32 or ndim != 1:
        raise ValueError(f"{expected} must be 1-D float32 (dtype code {dtype}, ndim {ndim})")
    _need(body, position, 16, f"{expected}'s shape and size")
    numel, nbytes = struct.unpack_from("<QQ", body, position)
    position += 16
    if numel > MAX_ELEMENTS or nbytes != 4 * numel:
        raise ValueError(f"{expected}: {numel} elements do not match {nbytes} bytes")
    _need(body, position, nbytes, f"{expected}'s data")
    return position + nbytes, np.frombuffer(body, dtype="<f4", count=numel, offset=position)
