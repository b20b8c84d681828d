"""The sparse codec (issue 20): per chunk, the top-k entries by magnitude at a few bits each.

A float32 vector is cut into chunks of ``chunk`` elements (the last one may be shorter). Each
chunk keeps its ``keep`` entries of largest magnitude (a chunk of ``n < chunk`` elements keeps
``ceil(keep * n / chunk)``), ties broken by the lower index, and sends them as ``bits``-bit codes
on one scale per chunk. What it does not send is the caller's to keep (error feedback, DiLoCo's
residual): ``x - decode(encode(x))`` is computed exactly in float32, so the values sent plus that
residual are the input bit for bit (tested).

Rules, those of ``swarm.averaging.codec``:

- Pure numpy, no IO, no randomness; the driver calls it from worker threads.
- Deterministic: the selection is a pure function of the magnitudes (``np.partition`` gives the
  k-th largest value, which is unique whatever the algorithm; the entries above it are kept, and
  of those equal to it the lowest indices), and the quantization only divides and multiplies by
  powers of two and rounds half to even (``np.rint``): exact operations, so the same input gives
  the same bytes on any machine.
- Decoders trust nothing: the exact byte length is checked before anything is allocated, and an
  exponent, code or index no encoder writes (an index out of its chunk or not ascending) raises
  ``RemoteProtocolError``.

Quantization. A chunk's scale is a power of two ``h = 2**e``; entry ``x`` is sent as
``c * h`` with the integer ``c = clip(rint(x / h), -L, L)``, ``L = 2**(bits - 1) - 1`` (2 bits:
-1, 0, +1; 3 bits: -3..3; the last code, ``2**bits - 1``, is never written). ``h`` is the finer of
the largest power of two below twice the chunk's smallest kept magnitude (then every kept entry
has a nonzero code) and the smallest one with ``L * h`` at least its largest (then none is
clamped): 2 bits send sign times scale, 8 bits the largest within 1/254. Then ``h`` is raised to
at least ``largest * 2**-22`` and kept in ``[2**-126, 2**(128 - bits)]`` (normal; ``L * h``
finite). Why powers of two and a zero code: ``x - c * h`` is then exact in float32 for every
kept entry (a nonzero code means ``|x| > h/2``, so ``x`` and ``c * h`` are multiples of
``2**(e - 24)`` at most ``h/2`` apart; a clamped ``c * h`` has ``x``'s sign, is smaller and lies
on ``x``'s grid, ``|x| < 2**23 * h``), which is what makes the residual exact; and the scale costs
one byte.

Wire format (``numel`` is known to both sides from the round's plan), for ``m`` chunks keeping
``K`` entries in all:

- ``m`` int8 exponents ``e``, one per chunk;
- every chunk's index set, Elias-Fano coded, the chunks' sections one after another, bit-packed
  little-endian bit first, padded to a byte at the end. A chunk of ``n`` elements keeping ``k``
  ascending indices ``i_0 < ... < i_{k-1}`` with ``l = floor(log2(n / k))`` low bits sends ``k * l``
  bits: the low ``l`` bits of each index in turn (low bit first), then a bit vector of
  ``k + ((n - 1) >> l)`` bits with a one at ``(i_j >> l) + j`` for each ``j`` and zeros elsewhere
  (the high parts in unary). A chunk keeping all its entries (``k == n``) sends nothing: its set
  is known. So a section's size depends on ``(n, k)`` alone, every full chunk's is the same (619
  bits for 4096 and 82, against 575.3 for ``log2 C(4096, 82)`` and 984 for 12-bit indices), and
  both sides cut the stream without reading it;
- ``K`` codes ``c + L`` (0 .. 2L; ``2**bits - 1`` is never written), ``bits`` each, packed
  little-endian bit first, padded to a byte.

A decoder refuses a bit vector without exactly ``k`` ones, an index set that is not strictly
ascending or has an index outside its chunk (both possible in a bit vector of the right weight),
and padding bits that are not zero.

Pooled selection (``select="part"``, name ``SPARSE-EFP``). Per-chunk top-k gives every chunk the
same ``keep``, wherever the pseudo-gradient's energy is: DiLoCo's first round puts 36% of it in the
output layer (4% of the entries), of which per-chunk top-k sends 5% (docs/diloco_tuning.md). A
pooled codec keeps ``kept(n)`` entries of the whole segment of ``n`` (the same density; a
``Layout`` makes neighbouring tensors sharing the codec one segment, so a segment is a peer's part
of the vector), the largest magnitudes wherever they lie, ties to the lower index; a chunk keeps
a variable number of them, none or all. Wire format: the ``m`` int8 exponents as above, each from
the entries its chunk keeps by the same rule (a chunk keeping none writes -126, the smallest, so
one input has one encoding); one Elias-Fano set of ``kept(n)`` indices over the segment's ``n``
(the section above with the chunk's ``n`` and ``k`` replaced by the segment's: its size still
depends on ``(n, kept(n))`` alone, so ``wire_bytes`` is known before a byte is read and no
per-chunk count travels); the codes, one per kept entry in index order. Quantization, exactness
and the decoder's checks are the per-chunk format's, plus: a chunk keeping no entry with another
exponent is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from p2p import RemoteProtocolError

__all__ = ["SELECTIONS", "SparseCodec"]

# "chunk": the top keep of every chunk; "part": the top keep/chunk of the whole segment.
SELECTIONS = ("chunk", "part")

_F32 = np.dtype("<f4")
_MIN_EXPONENT = -126  # 2**-126: the smallest normal float32


@dataclass(frozen=True)
class SparseCodec:
    """Top-``keep`` of every ``chunk`` entries at ``bits`` bits (module docstring). Raises
    ``ValueError`` for a chunk outside 2..65536, ``keep`` outside 1..chunk or bits outside 2..8."""

    chunk: int = 4096
    keep: int = 82
    bits: int = 2
    select: str = "chunk"

    def __post_init__(self) -> None:
        for name, low, high in (("chunk", 2, 1 << 16), ("keep", 1, self.chunk), ("bits", 2, 8)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"sparse {name} must be an integer in [{low}, {high}]: {value!r}")
        if self.select not in SELECTIONS:
            choices = ", ".join(SELECTIONS)
            raise ValueError(f"sparse select must be one of {choices}: {self.select!r}")

    @classmethod
    def from_density(
        cls, density: float, bits: int = 2, chunk: int = 4096, select: str = "chunk"
    ) -> SparseCodec:
        """The codec keeping ``ceil(density * chunk)`` entries per chunk (0 < density <= 1);
        ``select="part"``: that many per chunk on average, wherever the largest are."""
        if not 0 < density <= 1:
            raise ValueError(f"sparse density must be in (0, 1]: {density!r}")
        return cls(chunk, max(1, math.ceil(density * chunk)), bits, select)

    @property
    def pooled(self) -> bool:
        """One selection over the whole segment (``select="part"``), not one per chunk."""
        return self.select == "part"

    @property
    def name(self) -> str:
        """What a layout's digest names it by: every parameter, so peers must agree on all."""
        # EF: the Elias-Fano index format, so a peer of the older 12-bit format is refused by
        # the layout digest instead of misreading the bytes; EFP the pooled selection's format.
        return f"SPARSE-EF{'P' if self.pooled else ''}:{self.chunk}:{self.keep}:{self.bits}"

    def index_bits(self, n: int) -> int:
        """Bits of the index section of a chunk of ``n`` elements (module docstring)."""
        return _section(n, self.kept(n))[2]

    @property
    def limit(self) -> int:
        """L: the largest code magnitude."""
        return (1 << (self.bits - 1)) - 1

    def kept(self, n: int) -> int:
        """Entries a chunk of ``n`` elements keeps (pooled: a segment of ``n``, in all)."""
        return min(n, -(-self.keep * n // self.chunk))

    def wire_bytes(self, numel: int) -> int:
        """Exactly ``len(encode(x))`` for any ``x`` of ``numel`` elements."""
        if isinstance(numel, bool) or not isinstance(numel, int | np.integer) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        chunks, total = self._shape(int(numel))
        return chunks + -(-self._index_bits_total(int(numel)) // 8) + _packed(total, self.bits)

    def encode(self, array: np.ndarray) -> bytes:
        """The float32 ``array`` (flattened) as sparse bytes, the same on every machine. Raises
        ``ValueError`` for another dtype or a NaN or inf."""
        if not isinstance(array, np.ndarray) or array.dtype != np.float32:
            got = getattr(array, "dtype", type(array))
            raise ValueError(f"expected a float32 ndarray, got {got}")
        flat = np.ascontiguousarray(array, dtype=_F32).reshape(-1)
        if not np.isfinite(flat).all():
            raise ValueError("cannot encode NaN or inf")
        if self.pooled:
            return self._encode_pooled(flat)
        full = flat.size // self.chunk * self.chunk
        pieces = [self._encode_rows(flat[:full].reshape(-1, self.chunk))]
        if full < flat.size:
            pieces.append(self._encode_rows(flat[full:].reshape(1, -1)))
        exponents = np.concatenate([p[0] for p in pieces]).astype(np.int8)
        index_bits = np.concatenate([p[1] for p in pieces])
        codes = np.concatenate([p[2] for p in pieces])
        return (
            exponents.tobytes()
            + np.packbits(index_bits, bitorder="little").tobytes()
            + _pack(codes + self.limit, self.bits)
        )

    def decode(self, data: bytes | bytearray | memoryview, numel: int) -> np.ndarray:
        """``numel`` float32 values from a peer's bytes: a new writable array, zero where nothing
        was sent. Raises ``RemoteProtocolError`` for a wrong length, an exponent outside the
        encoder's range, the unused code, padding bits that are not zero, a high-bit vector
        without exactly k ones, or an index outside its chunk or not ascending."""
        expected = self.wire_bytes(numel)
        raw = memoryview(data).cast("B")
        if raw.nbytes != expected:
            raise RemoteProtocolError(
                f"{self.name} payload for {numel} elements must be {expected} bytes, "
                f"got {raw.nbytes}"
            )
        chunks, total = self._shape(numel)
        exponents = np.frombuffer(raw, dtype=np.int8, count=chunks).astype(np.int32)
        if (exponents < _MIN_EXPONENT).any() or (exponents > 128 - self.bits).any():
            raise RemoteProtocolError(f"{self.name} payload has a scale out of range")
        index_bits = self._index_bits_total(numel)
        offset = chunks + -(-index_bits // 8)
        codes = _unpack(raw[offset:], total, self.bits).astype(np.int32) - self.limit
        if (codes > self.limit).any():
            raise RemoteProtocolError(f"{self.name} payload has a code no encoder writes")
        # Zero padding: one payload per set of values, so a slice's hash names its bytes.
        if _padding(raw[chunks:offset], index_bits) or _padding(raw[offset:], total * self.bits):
            raise RemoteProtocolError(f"{self.name} payload has padding bits set")
        stream = np.unpackbits(
            np.frombuffer(raw[chunks:offset], dtype=np.uint8), count=index_bits, bitorder="little"
        )
        if self.pooled:
            return self._decode_pooled(stream, exponents, codes, numel)
        full, rest = divmod(numel, self.chunk)
        section = _section(self.chunk, self.keep)[2]
        pieces = [self._decode_rows(stream[: full * section].reshape(full, section), self.chunk)]
        if rest:
            pieces.append(self._decode_rows(stream[full * section :].reshape(1, -1), rest))
        # Each entry's position in the whole vector: its chunk's start plus its index.
        positions = np.concatenate([p.reshape(-1) for p in pieces])
        per_chunk = np.full(chunks, self.keep, dtype=np.int64)
        if rest:
            per_chunk[-1] = self.kept(rest)
        chunk_of = np.repeat(np.arange(chunks, dtype=np.int64), per_chunk)
        out = np.zeros(numel, dtype=np.float32)
        values = np.ldexp(codes.astype(np.float32), exponents[chunk_of]).astype(np.float32)
        out[chunk_of * self.chunk + positions] = values
        return out

    def _decode_rows(self, rows: np.ndarray, n: int, k: int | None = None) -> np.ndarray:
        """The (count, k) indices of ``count`` chunks of ``n`` elements from their index sections
        (one row of bits each; ``k`` kept in each, by default ``kept(n)``);
        ``RemoteProtocolError`` for a set no encoder writes."""
        k = self.kept(n) if k is None else k
        low, _, size = _section(n, k)
        count = rows.shape[0]
        if size == 0:  # the chunk keeps everything
            return np.broadcast_to(np.arange(n, dtype=np.int64), (count, n))
        high = rows[:, k * low :]
        if (high.sum(axis=1, dtype=np.int64) != k).any():
            raise RemoteProtocolError(f"{self.name} payload has an index set of the wrong size")
        # The ones' positions, row by row (np.nonzero is row-major), less each one's rank.
        ones = np.nonzero(high)[1].reshape(count, k)
        indices = (ones - np.arange(k, dtype=np.int64)) << low
        if low:
            weights = np.left_shift(np.int64(1), np.arange(low, dtype=np.int64))
            indices |= rows[:, : k * low].reshape(count, k, low).astype(np.int64) @ weights
        if (indices[:, -1] >= n).any():
            raise RemoteProtocolError(f"{self.name} payload has an index outside its chunk")
        if k > 1 and (np.diff(indices, axis=1) <= 0).any():
            raise RemoteProtocolError(f"{self.name} payload has indices not ascending in a chunk")
        return indices

    # -- pooled selection (select="part") -------------------------------------------------------

    def _encode_pooled(self, flat: np.ndarray) -> bytes:
        """The segment's ``kept(n)`` entries of largest magnitude wherever they lie (ties: the
        lower index), one Elias-Fano set over the segment, each chunk's scale from the entries
        kept in it (a chunk keeping none writes the smallest exponent: one encoding per input)."""
        n = flat.size
        if n == 0:
            return b""
        k = self.kept(n)
        magnitude = np.abs(flat)
        threshold = np.partition(magnitude, n - k)[n - k]
        above = np.flatnonzero(magnitude > threshold)
        ties = np.flatnonzero(magnitude == threshold)[: k - above.size]
        index = np.union1d(above, ties)  # ascending, k of them
        chunk_of = index // self.chunk
        chunks = -(-n // self.chunk)
        kept = magnitude[index]
        # The smallest and largest kept magnitude of each chunk; index is ascending, so each
        # chunk's entries are one run: reduceat over the runs' starts.
        present, starts = np.unique(chunk_of, return_index=True)
        exponent = np.full(chunks, _MIN_EXPONENT, dtype=np.int32)
        exponent[present] = self._exponents(
            np.minimum.reduceat(kept, starts), np.maximum.reduceat(kept, starts)
        )
        scaled = np.ldexp(flat[index], -exponent[chunk_of])  # exact: power-of-two scaling
        codes = np.clip(np.rint(scaled), -self.limit, self.limit).astype(np.int64)
        index_bits = _elias_fano(index.astype(np.int64).reshape(1, k), n)
        return (
            exponent.astype(np.int8).tobytes()
            + np.packbits(index_bits, bitorder="little").tobytes()
            + _pack(codes + self.limit, self.bits)
        )

    def _decode_pooled(
        self, stream: np.ndarray, exponents: np.ndarray, codes: np.ndarray, numel: int
    ) -> np.ndarray:
        """The pooled format's values from its (length-checked) index bits, exponents and
        codes; a chunk keeping no entry must carry the smallest exponent."""
        out = np.zeros(numel, dtype=np.float32)
        if numel == 0:
            return out
        k = self.kept(numel)
        positions = self._decode_rows(stream.reshape(1, -1), numel, k).reshape(-1)
        chunk_of = positions // self.chunk
        used = np.zeros(exponents.size, dtype=bool)
        used[chunk_of] = True
        if (exponents[~used] != _MIN_EXPONENT).any():
            raise RemoteProtocolError(f"{self.name} payload has a scale for an empty chunk")
        values = np.ldexp(codes.astype(np.float32), exponents[chunk_of]).astype(np.float32)
        out[positions] = values
        return out

    # -- encoding --------------------------------------------------------------------------------

    def _shape(self, numel: int) -> tuple[int, int]:
        """(chunks, entries kept in all) for ``numel`` elements."""
        full, rest = divmod(numel, self.chunk)
        if self.pooled:
            return full + (rest > 0), self.kept(numel) if numel else 0
        return full + (rest > 0), full * self.keep + (self.kept(rest) if rest else 0)

    def _index_bits_total(self, numel: int) -> int:
        if self.pooled:
            return self.index_bits(numel) if numel else 0
        full, rest = divmod(numel, self.chunk)
        return full * self.index_bits(self.chunk) + (self.index_bits(rest) if rest else 0)

    def _encode_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exponents, index sections (bits, rows in order) and signed codes of each row (a
        chunk)."""
        count, n = rows.shape
        k = self.kept(n)
        if count == 0:
            return np.empty(0, np.int32), np.empty(0, np.uint8), np.empty(0, np.int64)
        magnitude = np.abs(rows)
        # The k-th largest magnitude of each row: a value, unique whatever np.partition's
        # algorithm; entries above it are kept, and of the ties the lowest indices.
        threshold = np.partition(magnitude, n - k, axis=1)[:, n - k]
        above = magnitude > threshold[:, None]
        ties = magnitude == threshold[:, None]
        keep = above | ties
        room = k - above.sum(axis=1)
        crowded = np.flatnonzero(ties.sum(axis=1) > room)  # more ties than room: rare
        if crowded.size:
            first_ties = np.cumsum(ties[crowded], axis=1) <= room[crowded, None]
            keep[crowded] = above[crowded] | (ties[crowded] & first_ties)
        row, index = np.nonzero(keep)  # row-major: each row's indices ascending
        exponent = self._exponents(threshold, magnitude.max(axis=1))
        values = rows[row, index]
        scaled = np.ldexp(values, -exponent[row])  # exact: a power-of-two scaling, no underflow
        codes = np.clip(np.rint(scaled), -self.limit, self.limit).astype(np.int64)
        return exponent, _elias_fano(index.reshape(count, k), n), codes

    def _exponents(self, threshold: np.ndarray, largest: np.ndarray) -> np.ndarray:
        """Each chunk's scale exponent e (h = 2**e) from its smallest and largest kept magnitude
        (the module docstring's rule)."""
        # frexp(v) = (m, a) with v = m * 2**a, 0.5 <= m < 1: 2**(a - 1) <= v < 2**a.
        mantissa, at_threshold = np.frexp(threshold.astype(np.float64))
        # Largest power of two below 2 * threshold: every kept entry's code is then nonzero (a
        # threshold that is itself a power of two t gets scale t, not 2t, where t / 2t = 0.5
        # would round to code 0).
        at_threshold = at_threshold - (mantissa == 0.5)
        nonzero_codes = np.where(threshold > 0, at_threshold, _MIN_EXPONENT)
        # A power of two >= largest / L (the division's rounding cannot go past a power of
        # two): no kept entry is clamped.
        _, no_clamping = np.frexp(largest.astype(np.float64) / self.limit)
        # Whichever is finer, but never below largest / 2**22, so a clamped entry is within
        # 2**23 steps of the scale: its residual stays exact.
        _, at_largest = np.frexp(largest.astype(np.float64))
        exponent = np.maximum(np.minimum(nonzero_codes, no_clamping), at_largest - 22)
        exponent = np.where(largest > 0, exponent, _MIN_EXPONENT)
        return np.clip(exponent, _MIN_EXPONENT, 128 - self.bits).astype(np.int32)


def _section(n: int, k: int) -> tuple[int, int, int]:
    """(low bits per index, high bit vector's length, section bits) of a chunk of ``n`` elements
    keeping ``k`` (1 <= k <= n): the module docstring's Elias-Fano section, empty for k == n."""
    if k >= n:
        return 0, 0, 0
    low = (n // k).bit_length() - 1  # floor(log2(n / k)): floor(log2(x)) = floor(log2(floor(x)))
    high = k + ((n - 1) >> low)
    return low, high, k * low + high


def _elias_fano(indices: np.ndarray, n: int) -> np.ndarray:
    """The index sections of ``count`` chunks of ``n`` elements, each row of ``indices`` the k
    ascending indices of one chunk, as one flat array of bits (uint8), chunk after chunk."""
    count, k = indices.shape
    low, _, size = _section(n, k)
    if size == 0 or count == 0:
        return np.empty(0, np.uint8)
    bits = np.zeros((count, size), dtype=np.uint8)
    if low:
        shifts = np.arange(low, dtype=np.int64)
        bits[:, : k * low] = ((indices[:, :, None] >> shifts) & 1).reshape(count, k * low)
    # Index j's high part in unary: a one at (i_j >> low) + j, distinct and ascending in j.
    ones = k * low + (indices >> low) + np.arange(k, dtype=np.int64)
    bits[np.arange(count)[:, None], ones] = 1
    return bits.reshape(-1)


def _padding(raw: memoryview, bits: int) -> int:
    """The bits of ``raw``'s last byte past the first ``bits`` (what packing pads with zeros)."""
    return raw[-1] >> (bits % 8) if bits % 8 else 0


def _packed(count: int, width: int) -> int:
    return -(-count * width // 8)


def _pack(values: np.ndarray, width: int) -> bytes:
    """``values`` (non-negative, below ``2**width``) as ``width``-bit fields, low bit first."""
    shifts = np.arange(width, dtype=np.int64)
    bits = ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack(raw: memoryview, count: int, width: int) -> np.ndarray:
    """``count`` ``width``-bit fields from ``raw`` (its length already checked)."""
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=count * width, bitorder="little")
    weights = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
    return (bits.reshape(count, width).astype(np.int64) * weights).sum(axis=1)
