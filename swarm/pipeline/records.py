"""What a pipeline stage server announces in the DHT, and how much its throughput counts.

Every stage server of a run stores one ``ServerAnnouncement`` as its own signed subkey under
``servers_key(run_id)`` (``pipeline/<run>/servers``), re-stored every second or so with a short
expiry, so a server that dies drops out of every reader's view within that expiry. Trainers route
by these records (``swarm.pipeline.routing``) and servers rebalance by them
(``swarm.pipeline.rebalance``).

The value is a ``p2p`` wire message, ``ServerRecord`` (code 133: stage, throughput, queue,
relayed, param_round, param_hash). The peer id is not in the value: it is the record's owner,
which the DHT layer has already bound to the signature, so nobody can announce for someone else.
``decode_announcement`` turns every malformed value into ``RemoteProtocolError``;
``decode_announcements`` skips such records, since one bad entry must not hide the good ones.

Relayed servers count for less (Petals #428: a relayed server's measured compute rate overstates
what a trainer gets through the relay): their throughput is multiplied by ``relay_factor``.

This module is sans-IO: no trio, libp2p, sockets, clocks or randomness.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2p import Message, RemoteProtocolError, decode, encode, message

MAX_ANNOUNCEMENT_BYTES = 256
MAX_STAGES = 256
MAX_THROUGHPUT = 1e9  # samples/s: far above any real stage; a bigger claim is a lie
MAX_QUEUE = 1 << 20
MAX_PEER_ID_BYTES = 64
PARAM_HASH_BYTES = 32
DEFAULT_RELAY_FACTOR = 0.5


def servers_key(run_id: str) -> str:
    """The DHT key every stage server of ``run_id`` announces under (its own subkey)."""
    if not run_id or "/" in run_id:
        raise ValueError(f"run id must be non-empty and contain no '/': {run_id!r}")
    return f"pipeline/{run_id}/servers"


def _number(value: Any, name: str, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")


@message(133, max_bytes=MAX_ANNOUNCEMENT_BYTES)
class ServerRecord(Message):
    """The DHT value of a ``ServerAnnouncement`` (its fields but the owner's peer id). Raises
    ``ValueError`` when a field is out of range."""

    stage: int
    throughput: float
    queue: int
    relayed: bool
    param_round: int
    param_hash: bytes

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("stage", 0, MAX_STAGES - 1),
            ("queue", 0, MAX_QUEUE),
            ("param_round", -1, 2**53),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
        _number(self.throughput, "throughput", 0.0, MAX_THROUGHPUT)
        if not isinstance(self.relayed, bool):
            raise ValueError("relayed must be a bool")
        if not isinstance(self.param_hash, bytes) or len(self.param_hash) != PARAM_HASH_BYTES:
            raise ValueError(f"param_hash must be {PARAM_HASH_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class ServerAnnouncement:
    """One stage server's state as it announced it.

    ``throughput``: measured samples/s through forward + backward of its stage.
    ``queue``: requests waiting or running on it. ``relayed``: reachable only through a relay.
    ``param_round``/``param_hash``: the averaging round of the parameters it serves for download
    and their SHA-256 (``param_digest``); round -1 means the initial parameters.
    Raises ``ValueError`` when a field is out of range (``ServerRecord``'s rules).
    """

    peer_id: bytes
    stage: int
    throughput: float
    queue: int
    relayed: bool
    param_round: int
    param_hash: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, bytes) or not 0 < len(self.peer_id) <= MAX_PEER_ID_BYTES:
            raise ValueError("peer id must be 1..64 bytes")
        self.record()  # the value's rules

    def record(self) -> ServerRecord:
        """The DHT value (``encode_announcement`` encodes it)."""
        return ServerRecord(
            self.stage, self.throughput, self.queue, self.relayed, self.param_round, self.param_hash
        )

    def effective_throughput(self, relay_factor: float = DEFAULT_RELAY_FACTOR) -> float:
        """Throughput as a trainer gets it: relayed servers count ``relay_factor`` as much."""
        return self.throughput * (relay_factor if self.relayed else 1.0)


def encode_announcement(announcement: ServerAnnouncement) -> bytes:
    return encode(announcement.record())


def decode_announcement(peer_id: bytes, data: bytes) -> ServerAnnouncement:
    """Parse the value of ``peer_id``'s record. Raises ``RemoteProtocolError`` for any bad input
    (and nothing else)."""
    if not isinstance(data, bytes | bytearray):
        raise RemoteProtocolError("announcement missing")
    record = decode(bytes(data), ServerRecord)
    try:
        return ServerAnnouncement(peer_id, *record.to_wire())
    except ValueError as exc:  # the owner's peer id
        raise RemoteProtocolError(f"bad announcement: {exc}") from exc


def decode_announcements(
    entries: Iterable[tuple[bytes, bytes]], *, num_stages: int
) -> list[ServerAnnouncement]:
    """Announcements from ``(owner peer id, value)`` pairs of a DHT read, sorted by peer id.

    Malformed values and stages outside ``[0, num_stages)`` are skipped; a peer appears once.
    """
    found: dict[bytes, ServerAnnouncement] = {}
    for owner, value in entries:
        try:
            announcement = decode_announcement(owner, value)
        except RemoteProtocolError:
            continue
        if announcement.stage < num_stages:
            found[owner] = announcement
    return [found[peer] for peer in sorted(found)]


def param_digest(arrays: Sequence[Any]) -> bytes:
    """SHA-256 over the parameters, in order: each one's dtype name, shape and raw bytes.

    ``arrays`` are numpy arrays (contiguous ones are hashed without a copy). Equal digests
    mean bit-identical parameters of identical shapes.
    """
    hasher = hashlib.sha256(b"swarmtrain/pipeline/params/1\x00")
    for array in arrays:
        hasher.update(f"{array.dtype.name}{tuple(array.shape)}".encode())
        if array.size:
            hasher.update(memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B"))
    return hasher.digest()
