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

This module is pure: encoding, decoding and the majority rule; drivers do the DHT calls.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

PROGRESS_VERSION = 1
MAX_PROGRESS_BYTES = 1024
PROGRESS_TTL_S = 600.0
# How the peer found itself (its dial-back verdict): reachable directly ("public"), only through
# its relays ("private"), or not known. Records written before the field existed read "unknown".
REACHABILITY = ("public", "private", "unknown")


@dataclass(frozen=True)
class Progress:
    """One peer's latest round, as it published it."""

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

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [
                PROGRESS_VERSION,
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
            ],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, peer_id: str, data: bytes) -> Progress | None:
        """The record, or None when it is malformed (a bad peer's record is ignored, not fatal)."""
        if len(data) > MAX_PROGRESS_BYTES:
            return None
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception:
            return None
        # 11 fields: a record from before ``reach``; the field is optional, not a new version.
        if not isinstance(obj, list) or len(obj) not in (11, 12) or obj[0] != PROGRESS_VERSION:
            return None
        reach = obj[11] if len(obj) == 12 else "unknown"
        if not isinstance(reach, str) or reach not in REACHABILITY:
            return None
        _, rnd, ok, digest, loss, tps, peers, sent, received, contributed, at = obj[:11]
        ints = (rnd, peers, sent, received, contributed)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            return None
        floats = (loss, tps, at)
        if not all(isinstance(v, float) and math.isfinite(v) for v in floats):
            return None
        if not isinstance(ok, bool) or not isinstance(digest, bytes) or len(digest) != 32:
            return None
        return cls(
            peer_id, rnd, ok, digest, loss, tps, peers, sent, received, contributed, at, reach
        )

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
