"""What a hierarchical round (``hierarchical``) puts on the wire: one message kind, ``GridItem``,
that carries any of the machine's items, and the pure functions between them.

The stream per ordered pair of members is the flat round's (``session_wire``): ``Hello`` on
``PROTOCOL``, then items, then ``Done``; only the item differs, so the Averager's handler serves
both kinds of round. A grid item's payload (a column or sub-part of the vector) rides inline up
to ``INLINE_MAX_BYTES``, else on the pair's bulk channel, as a flat item's does. Its size is a
function of the plan, the round's ``Layout`` (its codecs) and the item's kind and indices alone,
checked before a byte of it is read. The chain's partial sums are float64 whatever the codec
(``Accumulated``: never rounded on the way, so the division at the chain's end is the flat
all-reduce's). Raw slices, reduced sub-parts and gathered columns are little-endian float32 in
a lossless round; in a lossy one (int8, fp16) they are the layout's encoding: a raw slice of
its column (``encode_slices``), a reduced sub-part as the last row's head encoded it
(``finalizer``), a gathered column as its sub-parts' bytes one after the other, decoded here
and kept to be passed on as they came. Exclusions and relay targets are peer ids of the round;
whether they are members is the machine's check (``GridAllReduce``), as is every value's
finiteness (a decoder refuses NaN and inf itself).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np

from p2p import Message, RemoteProtocolError, message
from swarm.averaging.grid import GridPlan
from swarm.averaging.hierarchical import (
    Accumulated,
    Excluded,
    Gathered,
    Handover,
    Item,
    RawPart,
    Ready,
    Reduced,
    Takeover,
)
from swarm.averaging.payload import Layout
from swarm.averaging.session_wire import INLINE_MAX_BYTES

__all__ = [
    "GridItem",
    "GridKind",
    "encode_slices",
    "finalizer",
    "from_wire",
    "payload_bytes",
    "to_wire",
]

# A round of a few thousand peers may name most of them as exclusions or relay targets.
_NAMES_MAX_BYTES = 256 * 1024


class GridKind(enum.IntEnum):
    RAW = 0
    ACCUMULATED = 1
    REDUCED = 2
    GATHERED = 3
    TAKEOVER = 4
    HANDOVER = 5
    READY = 6
    EXCLUDED = 7


@message(104, max_bytes=INLINE_MAX_BYTES + _NAMES_MAX_BYTES)
class GridItem(Message):
    """One item of a hierarchical round; fields a kind does not use are 0 or empty."""

    kind: GridKind
    column: int
    sub: int
    row: int
    weight: float
    excluded: tuple[bytes, ...]
    forward: tuple[bytes, ...]
    nbytes: int
    inline: bytes


_CLASS_OF = {
    RawPart: GridKind.RAW,
    Accumulated: GridKind.ACCUMULATED,
    Reduced: GridKind.REDUCED,
    Gathered: GridKind.GATHERED,
    Takeover: GridKind.TAKEOVER,
    Handover: GridKind.HANDOVER,
    Ready: GridKind.READY,
    Excluded: GridKind.EXCLUDED,
}


def to_wire(item: Item) -> tuple[GridItem, memoryview]:
    """The message for ``item`` and its payload (its wire bytes in a lossy round, else its
    values' little-endian bytes; empty for a control item); the payload is inlined when
    small."""
    kind = _CLASS_OF[type(item)]
    coded = getattr(item, "payload", None)
    if isinstance(item, Gathered) and item.payloads is not None:
        coded = b"".join(item.payloads)
    data = getattr(item, "data", None)
    payload = memoryview(b"")
    if coded is not None:
        payload = memoryview(coded).cast("B")
    elif data is not None:
        dtype = "<f8" if kind is GridKind.ACCUMULATED else "<f4"
        payload = memoryview(np.ascontiguousarray(data, dtype=dtype)).cast("B")
    excluded = tuple(sorted(getattr(item, "excluded", ())))
    msg = GridItem(
        kind,
        getattr(item, "column", 0),
        getattr(item, "sub", 0),
        getattr(item, "row", 0),
        getattr(item, "weight", 0.0),
        excluded,
        tuple(getattr(item, "forward", ())),
        len(payload),
        bytes(payload) if len(payload) <= INLINE_MAX_BYTES else b"",
    )
    return msg, payload


def payload_bytes(msg: GridItem, plan: GridPlan, layout: Layout) -> int:
    """The size ``msg``'s payload must have in ``plan`` under ``layout``'s codecs; raises
    ``RemoteProtocolError`` for indices outside the grid, a size that differs, or an inline
    payload of the wrong size."""
    kind = msg.kind
    if kind in (GridKind.RAW, GridKind.GATHERED):
        if not 0 <= msg.column < plan.columns:
            raise RemoteProtocolError(f"column {msg.column} outside the grid")
        if kind is GridKind.RAW:
            expected = layout.wire_bytes(*plan.part(msg.column))
        else:  # its sub-parts as the last row's head encoded them, one after the other
            expected = sum(_sub_sizes(plan, layout, msg.column))
    elif kind in (GridKind.ACCUMULATED, GridKind.REDUCED):
        if not (0 <= msg.column < plan.columns and 0 <= msg.sub < plan.rows):
            raise RemoteProtocolError(f"sub-part ({msg.column}, {msg.sub}) outside the grid")
        start, stop = plan.sub(msg.column, msg.sub)
        if kind is GridKind.ACCUMULATED:
            expected = 8 * (stop - start)  # float64, whatever the codec
        else:
            expected = layout.wire_bytes(start, stop)
    else:
        expected = 0
    if msg.nbytes != expected:
        raise RemoteProtocolError(f"{kind.name} payload of {msg.nbytes} bytes, expected {expected}")
    if (msg.inline or expected <= INLINE_MAX_BYTES) and len(msg.inline) != expected:
        raise RemoteProtocolError(f"inline payload of {len(msg.inline)} bytes")
    return expected


def from_wire(msg: GridItem, payload: bytes | bytearray, plan: GridPlan, layout: Layout) -> Item:
    """The machine's item for ``msg`` with its ``payload`` (``payload_bytes`` checked its
    size). Lossless: the values are a view of ``payload`` where the byte order is native. Lossy:
    decoded by ``layout`` (``RemoteProtocolError`` if they do not decode), a reduced item
    keeping its bytes to pass on unchanged."""
    kind = msg.kind
    excluded = frozenset(msg.excluded)
    if kind is GridKind.TAKEOVER:
        return Takeover(msg.column, msg.row)
    if kind is GridKind.HANDOVER:
        return Handover(msg.column, msg.row)
    if kind is GridKind.READY:
        return Ready(msg.column, excluded)
    if kind is GridKind.EXCLUDED:
        return Excluded(excluded)
    if kind is GridKind.ACCUMULATED or layout.lossless():
        dtype = np.dtype("<f8" if kind is GridKind.ACCUMULATED else "<f4")
        native = np.float64 if kind is GridKind.ACCUMULATED else np.float32
        values = np.frombuffer(payload, dtype=dtype)
        if values.dtype != native:  # a big-endian host
            values = values.astype(native)
        if kind is GridKind.RAW:
            return RawPart(msg.column, values, msg.weight)
        if kind is GridKind.ACCUMULATED:
            return Accumulated(msg.column, msg.sub, msg.row, excluded, values)
        if kind is GridKind.REDUCED:
            return Reduced(msg.column, msg.sub, excluded, values)
        return Gathered(msg.column, excluded, values, msg.forward)
    if kind is GridKind.RAW:  # decoded as the flat reducer decodes a slice; never passed on
        return RawPart(msg.column, layout.decode(payload, *plan.part(msg.column)), msg.weight)
    if kind is GridKind.REDUCED:
        start, stop = plan.sub(msg.column, msg.sub)
        data = bytes(payload)
        return Reduced(msg.column, msg.sub, excluded, layout.decode(data, start, stop), data)
    column_start, column_stop = plan.part(msg.column)
    values = np.empty(column_stop - column_start, np.float32)
    pieces = []
    offset = 0
    for j, size in enumerate(_sub_sizes(plan, layout, msg.column)):
        start, stop = plan.sub(msg.column, j)
        piece = bytes(payload[offset : offset + size])
        values[start - column_start : stop - column_start] = layout.decode(piece, start, stop)
        pieces.append(piece)
        offset += size
    return Gathered(msg.column, excluded, values, msg.forward, tuple(pieces))


def encode_slices(
    local: np.ndarray, plan: GridPlan, layout: Layout, out: np.ndarray
) -> tuple[bytes, ...]:
    """A lossy round's start: our slice of each column encoded as ``layout`` says (the bytes
    the machine sends, ``RawPart.payload``), their decoding written to ``out`` (the machine's
    ``local``: what our row's heads add up). ``out`` may be ``local`` itself (the round may
    overwrite it: column by column, each is read before it is written)."""
    payloads = []
    for c in range(plan.columns):
        start, stop = plan.part(c)
        data = bytes(layout.encode(local[start:stop], start))
        out[start:stop] = layout.decode(data, start, stop)
        payloads.append(data)
    return tuple(payloads)


def finalizer(layout: Layout) -> Callable[[np.ndarray, int], tuple[np.ndarray, bytes]] | None:
    """The machine's ``finalize`` for ``layout``: a reduced sub-part's bytes and their decoding
    (None: lossless, the values are their own bytes)."""
    if layout.lossless():
        return None

    def finalize(values: np.ndarray, start: int) -> tuple[np.ndarray, bytes]:
        data = bytes(layout.encode(values, start))
        return layout.decode(data, start, start + len(values)), data

    return finalize


def _sub_sizes(plan: GridPlan, layout: Layout, column: int) -> list[int]:
    return [layout.wire_bytes(*plan.sub(column, j)) for j in range(plan.rows)]
