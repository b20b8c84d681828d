"""How a slice of the flattened tensors becomes wire bytes: one codec per tensor.

The all-reduce works on one flat float32 vector (the caller's tensors, flattened and concatenated
in order) and cuts it into parts that ignore tensor boundaries. Compression is chosen per tensor
(issue 3, point 5), so a part's bytes are the concatenation of its *segments*, the pieces of the
part that fall in one tensor each, each encoded with that tensor's codec. Both sides derive the
segments from the same ``Layout`` and the part's bounds, so a payload needs no header of its own
and its exact length is known before a byte of it is read.

Why peers must agree on the layout: a codec changes how many bytes a range takes and how they
decode. ``Layout.digest`` travels in the all-reduce hello; a peer with another layout is refused.

A layout with a sparse codec (``swarm.averaging.sparse_codec``) *gathers*: peers' top-k sets
differ, so a reducer cannot send the mean at the slices' density, and re-sparsifying it would drop
what no peer's error feedback holds. Its reduced part travels as the contributors' own slice
payloads, concatenated in sorted contributor order (``reduced_bytes``); every receiver decodes
them and computes the weighted mean itself (``decode_reduced``, ``reduce_part``: sorted order,
float64), which is bit for bit what the reducer computed from the same decoded slices.

A pooled sparse codec (``SparseCodec(select="part")``) selects over a whole segment, so neighbouring
tensors with the same pooled codec form one segment: the largest entries of the part are sent
wherever they lie, the budget following the pseudo-gradient's energy across tensors
(docs/diloco_tuning.md).

Pure numpy, sans-IO (the driver calls it from worker threads).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from p2p import RemoteProtocolError
from swarm.averaging.aggregation import reduce_part
from swarm.averaging.codec import Compression, choose, decode, encode, wire_bytes
from swarm.averaging.sparse_codec import SparseCodec

__all__ = ["Codec", "Layout"]

Codec = Compression | SparseCodec


@dataclass(frozen=True)
class Layout:
    """Tensor sizes (elements) and each tensor's codec, in the caller's order."""

    sizes: tuple[int, ...]
    codecs: tuple[Codec, ...]
    offsets: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.codecs):
            raise ValueError("one codec per tensor")
        if any(not isinstance(n, int) or n < 0 for n in self.sizes):
            raise ValueError("tensor sizes must be ints >= 0")
        offsets, total = [], 0
        for size in self.sizes:
            offsets.append(total)
            total += size
        object.__setattr__(self, "offsets", (*offsets, total))

    @classmethod
    def for_sizes(cls, sizes: Sequence[int], compression: Codec | None) -> Layout:
        """``compression`` for every tensor, or ``None``: ``compression.choose`` per tensor."""
        sizes = tuple(int(n) for n in sizes)
        codecs = tuple(compression if compression is not None else choose(n) for n in sizes)
        return cls(sizes, codecs)

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @property
    def digest(self) -> bytes:
        text = ",".join(f"{n}:{c.name}" for n, c in zip(self.sizes, self.codecs, strict=True))
        return hashlib.sha256(b"swarmtrain/layout/1\x00" + text.encode()).digest()[:16]

    @property
    def gathers(self) -> bool:
        """Reduced parts travel as their contributors' slices (the module docstring)."""
        return any(isinstance(c, SparseCodec) for c in self.codecs)

    def segments(self, start: int, stop: int) -> list[tuple[int, int, Codec]]:
        """The pieces of ``[start, stop)`` that lie in one tensor each, with that tensor's codec;
        neighbouring tensors sharing a pooled sparse codec are one piece (the module docstring)."""
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"range [{start}, {stop}) outside 0..{self.numel}")
        pieces = []
        index = max(0, bisect_right(self.offsets, start) - 1)
        position = start
        while position < stop:
            end = min(stop, self.offsets[index + 1])
            codec = self.codecs[index]
            if end > position:
                if pieces and codec == pieces[-1][2] and _pooled(codec):
                    pieces[-1] = (pieces[-1][0], end, codec)
                else:
                    pieces.append((position, end, codec))
            position = end
            index += 1
        return pieces

    def wire_bytes(self, start: int, stop: int) -> int:
        return sum(_wire_bytes(b - a, c) for a, b, c in self.segments(start, stop))

    def reduced_bytes(self, start: int, stop: int, contributors: int) -> int:
        """Bytes of a reduced part of ``[start, stop)`` over ``contributors`` peers."""
        one = self.wire_bytes(start, stop)
        return contributors * one if self.gathers else one

    def encode(self, values: np.ndarray, start: int) -> bytes | memoryview:
        """Encode ``values``, the vector's elements ``[start, start + len(values))``.

        Uncompressed float32 in one segment comes back as a view of ``values`` (no copy): the
        caller must not change ``values`` while it sends the view.
        """
        stop = start + len(values)
        pieces = self.segments(start, stop)
        if len(pieces) == 1 and pieces[0][2] is Compression.NONE and _little_endian(values):
            return memoryview(np.ascontiguousarray(values)).cast("B")
        return b"".join(_encode(values[a - start : b - start], c) for a, b, c in pieces)

    def decode(self, data: bytes | bytearray | memoryview, start: int, stop: int) -> np.ndarray:
        """Decode a peer's payload for ``[start, stop)``; ``RemoteProtocolError`` if malformed."""
        view = memoryview(data).cast("B")
        pieces = self.segments(start, stop)
        if len(pieces) == 1:
            return _decode(view, pieces[0][2], stop - start)
        out = np.empty(stop - start, dtype=np.float32)
        offset = 0
        for a, b, c in pieces:
            size = _wire_bytes(b - a, c)
            out[a - start : b - start] = _decode(view[offset : offset + size], c, b - a)
            offset += size
        if offset != view.nbytes:
            # decode already checked each segment's length; this catches trailing bytes.
            raise RemoteProtocolError(f"payload has {view.nbytes - offset} trailing bytes")
        return out

    def decode_reduced(
        self,
        data: bytes | bytearray | memoryview,
        start: int,
        stop: int,
        contributors: Sequence[tuple[bytes, float]],
    ) -> np.ndarray:
        """A reduced part of ``[start, stop)`` as a peer sent it over ``contributors`` ((peer,
        weight), sorted): the part itself, or for a gathering layout the weighted mean of the
        contributors' slices it carries, computed as the reducer computed it. Raises
        ``RemoteProtocolError`` for a malformed payload or a weight that is not positive and
        finite."""
        if not self.gathers:
            return self.decode(data, start, stop)
        view = memoryview(data).cast("B")
        one = self.wire_bytes(start, stop)
        if not contributors or view.nbytes != one * len(contributors):
            raise RemoteProtocolError(
                f"reduced payload of {view.nbytes} bytes for {len(contributors)} slices of {one}"
            )
        slices = {}
        for k, (peer, weight) in enumerate(contributors):
            if not isinstance(weight, float | int) or not 0 < weight < math.inf:
                raise RemoteProtocolError(f"contributor weight {weight!r} in a reduced part")
            slices[peer] = (self.decode(view[k * one : (k + 1) * one], start, stop), weight)
        if len(slices) != len(contributors):
            raise RemoteProtocolError("a contributor named twice in a reduced part")
        return reduce_part(slices)

    def lossless(self) -> bool:
        return all(c is Compression.NONE for c in self.codecs)

    def lossless_between(self, start: int, stop: int) -> bool:
        """``[start, stop)`` travels as raw little-endian float32 (its bytes are its values)."""
        return all(c is Compression.NONE for _, _, c in self.segments(start, stop))

    def round_trip(self, values: np.ndarray, start: int) -> np.ndarray:
        """What a peer decodes from ``encode(values, start)``: the values the wire can carry."""
        if self.lossless():
            return values
        return self.decode(self.encode(values, start), start, start + len(values))


def _pooled(codec: Codec) -> bool:
    return isinstance(codec, SparseCodec) and codec.pooled


def _wire_bytes(numel: int, codec: Codec) -> int:
    return codec.wire_bytes(numel) if isinstance(codec, SparseCodec) else wire_bytes(numel, codec)


def _encode(values: np.ndarray, codec: Codec) -> bytes:
    return codec.encode(values) if isinstance(codec, SparseCodec) else encode(values, codec)


def _decode(data: memoryview, codec: Codec, numel: int) -> np.ndarray:
    return (
        codec.decode(data, numel) if isinstance(codec, SparseCodec) else decode(data, codec, numel)
    )


def _little_endian(values: np.ndarray) -> bool:
    return values.dtype == np.dtype("<f4")
