"""What nodes publish about their rounds, and what joiners and ``swarmtrain status`` read from it.

Every node stores, after each round, one ``Progress`` record as its own signed subkey under the
DHT key ``run/<id>/progress`` (the freshest record per peer wins, so the key holds each live
peer's latest round). It says which round, whether the round's averaging succeeded, the state
hash after it, and the figures ``swarmtrain status`` shows (loss, tokens/s, peers, bytes).

The *agreed state* of a run is read from those records: among the records of successful rounds
at the latest such round, the state hash most peers hold (ties break on the hash itself, as
``swarm.StateAgreement`` does, so every reader names the same one). Its holders are the sources a
joiner downloads from, and the peers every member expects in the next round's matchmaking when a
joiner is announced. A joiner announces itself under ``run/<id>/join/<r>`` (``join_key``) once
it holds the agreed state, naming the first round it will contribute to.

A node that starts stores a ``StartAnnouncement`` under ``run/<id>/starts`` (``starts_key``):
the round it trains first and when it started. Until its first progress record it is otherwise
invisible, and a peer whose first round failed alone could not tell "nobody else is here" from
"the others are still warming up" (issue 16: a busy box's quick starter ran ahead for good).

The values are ``p2p`` wire messages, ``ProgressRecord`` (code 500), ``JoinAnnouncement``
(507) and ``StartAnnouncement`` (508): typed, versioned and size-limited, so a malformed value
is one ``RemoteProtocolError`` with its reason, and the record is ignored.

This module is pure: encoding, decoding and the majority rule; drivers do the DHT calls.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from p2p import Message, RemoteProtocolError, decode, encode, message

log = logging.getLogger(__name__)

MAX_PROGRESS_BYTES = 1024
PROGRESS_TTL_S = 600.0
# How the peer found itself (its dial-back verdict): reachable directly ("public"), only through
# its relays ("private"), or not known. Records written before the field existed read "unknown".
REACHABILITY = ("public", "private", "unknown")


@message(500, max_bytes=MAX_PROGRESS_BYTES)
class ProgressRecord(Message):
    """The DHT value of one peer's latest round (``run/<id>/progress``, the peer's own subkey).

    The peer id is not in the value: it is the record's owner, which the DHT layer has already
    bound to the signature. ``reach`` is the peer's dial-back verdict, one of ``REACHABILITY``.
    Raises ``ValueError`` when a field is out of range (``p2p.decode`` reports it as
    ``RemoteProtocolError``, like every other malformed value).
    """

    round: int
    ok: bool
    state_hash: bytes
    loss: float
    tokens_per_s: float
    peers: int
    bytes_sent: int
    bytes_received: int
    rounds_contributed: int
    published_at: float
    reach: str

    def __post_init__(self) -> None:
        counts = (self.round, self.peers, self.bytes_sent, self.bytes_received)
        if min(*counts, self.rounds_contributed) < 0:
            raise ValueError("round, peers, byte counts and rounds contributed must be >= 0")
        if not all(math.isfinite(v) for v in (self.loss, self.tokens_per_s, self.published_at)):
            raise ValueError("loss, tokens/s and publication time must be finite")
        if len(self.state_hash) != 32:
            raise ValueError(f"state hash must be 32 bytes, got {len(self.state_hash)}")
        if self.reach not in REACHABILITY:
            raise ValueError(f"reach {self.reach!r} is not one of {REACHABILITY}")


@message(507, max_bytes=64)
class JoinAnnouncement(Message):
    """The value under ``join_key(run, r)``: its owner joins, contributing from round ``r``."""

    first_round: int

    def __post_init__(self) -> None:
        if self.first_round < 0:
            raise ValueError("a joiner's first round must be >= 0")


@message(508, max_bytes=64)
class StartAnnouncement(Message):
    """The value under ``starts_key(run)``: its owner started at ``started_at`` (unix seconds)
    and trains round ``first_round`` first."""

    first_round: int
    started_at: float

    def __post_init__(self) -> None:
        if self.first_round < 0:
            raise ValueError("a start's first round must be >= 0")
        if not math.isfinite(self.started_at):
            raise ValueError("a start's time must be finite")


@dataclass(frozen=True)
class Start:
    """A peer's last start, as it announced it."""

    peer_id: str
    first_round: int
    started_at: float

    def to_bytes(self) -> bytes:
        return encode(StartAnnouncement(self.first_round, float(self.started_at)))


def decode_starts(values: dict[str, bytes]) -> list[Start]:
    """``{peer id: value}`` (a read of ``starts_key``) to starts, malformed ones skipped."""
    found = []
    for peer, value in values.items():
        try:
            start = decode(value, StartAnnouncement)
        except RemoteProtocolError as exc:
            log.debug("start announcement of %s ignored: %s", peer[-8:], exc)
            continue
        found.append(Start(peer, start.first_round, start.started_at))
    return sorted(found, key=lambda s: s.peer_id)


def announcement(round_number: int) -> bytes:
    """The value a joiner stores under ``join_key(run, round_number)``."""
    return encode(JoinAnnouncement(round_number))


def announced_joiners(values: dict[str, bytes], round_number: int) -> set[str]:
    """The peers of a read of ``join_key(run, round_number)`` whose value announces that round;
    a malformed value (or one naming another round) is ignored."""
    found = set()
    for peer, value in values.items():
        try:
            if decode(value, JoinAnnouncement).first_round == round_number:
                found.add(peer)
        except RemoteProtocolError as exc:
            log.debug("join announcement of %s ignored: %s", peer[-8:], exc)
    return found


@dataclass(frozen=True)
class Progress:
    """One peer's latest round, as it published it (its ``ProgressRecord`` and who owns it)."""

    peer_id: str
    round: int
    ok: bool
    state_hash: bytes
    loss: float
    tokens_per_s: float
    peers: int
    bytes_sent: int
    bytes_received: int
    rounds_contributed: int
    published_at: float
    reach: str = "unknown"  # one of REACHABILITY

    def __post_init__(self) -> None:
        if self.reach not in REACHABILITY:
            raise ValueError(f"reach {self.reach!r} is not one of {REACHABILITY}")

    def record(self) -> ProgressRecord:
        return ProgressRecord(
            self.round,
            self.ok,
            self.state_hash,
            float(self.loss),
            float(self.tokens_per_s),
            self.peers,
            self.bytes_sent,
            self.bytes_received,
            self.rounds_contributed,
            float(self.published_at),
            self.reach,
        )

    def to_bytes(self) -> bytes:
        """The DHT value. Raises ValueError when a field breaks ``ProgressRecord``'s rules (a
        NaN loss): such a record is not published, since no reader would accept it."""
        return encode(self.record())

    @classmethod
    def parse(cls, peer_id: str, data: bytes) -> Progress:
        """The record ``peer_id`` published. Raises ``RemoteProtocolError`` (the one reason a
        value is malformed) for anything that is not a valid ``ProgressRecord`` (one over its
        size limit before any byte is parsed: ``decode`` checks that)."""
        record = decode(data, ProgressRecord)
        return cls(peer_id, *record.to_wire())

    @classmethod
    def from_bytes(cls, peer_id: str, data: bytes) -> Progress | None:
        """The record, or None when it is malformed (a bad peer's record is ignored, not fatal)."""
        try:
            return cls.parse(peer_id, data)
        except RemoteProtocolError as exc:
            log.debug("progress record of %s ignored: %s", peer_id[-8:], exc)
            return None

    def to_json(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id,
            "round": self.round,
            "ok": self.ok,
            "state_hash": self.state_hash.hex(),
            "loss": round(self.loss, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "peers": self.peers,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rounds_contributed": self.rounds_contributed,
            "published_at": self.published_at,
            "reach": self.reach,
        }


def decode_all(values: dict[str, bytes]) -> list[Progress]:
    """``{peer id: value}`` (a read of ``progress_key``) to records, malformed ones skipped."""
    found = (Progress.from_bytes(peer, value) for peer, value in values.items())
    return sorted((p for p in found if p is not None), key=lambda p: p.peer_id)


@dataclass(frozen=True)
class AgreedState:
    """The state the majority of a round's successful peers hold, and who holds it."""

    round: int  # the round after which the state was published (its GlobalState.round is +1)
    state_hash: bytes
    holders: tuple[str, ...]  # peer ids, sorted
    published: int  # successful records at that round, holders or not


def agreed_state(
    records: Iterable[Progress], round_number: int | None = None
) -> AgreedState | None:
    """The majority state at ``round_number`` (default: the latest round any peer succeeded),
    or None when no successful record exists there."""
    ok = [p for p in records if p.ok]
    if round_number is None:
        if not ok:
            return None
        round_number = max(p.round for p in ok)
    at = [p for p in ok if p.round == round_number]
    if not at:
        return None
    counts = Counter(p.state_hash for p in at)
    majority = max(counts, key=lambda h: (counts[h], h))
    holders = tuple(sorted(p.peer_id for p in at if p.state_hash == majority))
    return AgreedState(round_number, majority, holders, len(at))
