"""What a hierarchical round (``hierarchical``) puts on the wire: one message kind, ``GridItem``,
that carries any of the machine's items, and the two pure functions between them.

The stream per ordered pair of members is the flat round's (``session_wire``): ``Hello`` on
``PROTOCOL``, then items, then ``Done``; only the item differs, so the Averager's handler serves
both kinds of round. A grid item's payload (a column or sub-part of the vector) rides inline up
to ``INLINE_MAX_BYTES``, else on the pair's bulk channel, as a flat item's does. Its size is a
function of the plan and the item's kind and indices alone, checked before a byte of it is
read: raw slices, reduced sub-parts and gathered columns are little-endian float32, the chain's
partial sums float64 (``Accumulated``: never rounded on the way, so the division at the chain's
end is the flat all-reduce's). Exclusions and relay targets are peer ids of the round; whether
they are members is the machine's check (``GridAllReduce``), as is every value's finiteness.
"""

from __future__ import annotations

import enum

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
from swarm.averaging.session_wire import INLINE_MAX_BYTES

__all__ = ["GridItem", "GridKind", "from_wire", "payload_bytes", "to_wire"]

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
    """The message for ``item`` and its payload (its values' little-endian bytes, empty for a
    control item); the payload is inlined when small."""
    kind = _CLASS_OF[type(item)]
    data = getattr(item, "data", None)
    payload = memoryview(b"")
    if data is not None:
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


def payload_bytes(msg: GridItem, plan: GridPlan) -> int:
    """The size ``msg``'s payload must have in ``plan``; raises ``RemoteProtocolError`` for
    indices outside the grid, a size that differs, or an inline payload of the wrong size."""
    kind = msg.kind
    if kind in (GridKind.RAW, GridKind.GATHERED):
        if not 0 <= msg.column < plan.columns:
            raise RemoteProtocolError(f"column {msg.column} outside the grid")
        start, stop = plan.part(msg.column)
        expected = 4 * (stop - start)
    elif kind in (GridKind.ACCUMULATED, GridKind.REDUCED):
        if not (0 <= msg.column < plan.columns and 0 <= msg.sub < plan.rows):
            raise RemoteProtocolError(f"sub-part ({msg.column}, {msg.sub}) outside the grid")
        start, stop = plan.sub(msg.column, msg.sub)
        expected = (8 if kind is GridKind.ACCUMULATED else 4) * (stop - start)
    else:
        expected = 0
    if msg.nbytes != expected:
        raise RemoteProtocolError(f"{kind.name} payload of {msg.nbytes} bytes, expected {expected}")
    if (msg.inline or expected <= INLINE_MAX_BYTES) and len(msg.inline) != expected:
        raise RemoteProtocolError(f"inline payload of {len(msg.inline)} bytes")
    return expected


def from_wire(msg: GridItem, payload: bytes | bytearray) -> Item:
    """The machine's item for ``msg`` with its ``payload`` (``payload_bytes`` checked its
    size). The values are a view of ``payload`` where the byte order is native."""
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
