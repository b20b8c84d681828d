"""What nodes publish about their rounds, and what joiners and ``swarmtrain status`` read from it.

Every node stores, after each round, one ``Progress`` record as its own signed subkey under the
DHT key ``run/<id>/progress`` (the freshest record per peer wins, so the key holds each live
peer's latest round). It says which round, whether the round's averaging succeeded, the state
hash after it, and the figures ``swarmtrain status`` shows (loss, tokens/s, peers, bytes).

The *agreed state* of a run is read from those records (``agreed_states``). A successful
record names its round's members: the averaged result's contributor set, which every survivor
of the round holds, as 8-byte tags (``member_list``; up to ``MAX_LISTED_MEMBERS``). The records
are grouped by round, state hash and member list; a record counts as a holder only if its owner
is on its own list. A group's *support* is the number of peers on its list that vouch for being
members: their own record (of any state) is a member's record of a round within one of the
group's. Groups are ranked by support, then holders, then the newer round, then the larger hash
(so every reader names the same one, as ``swarm.StateAgreement`` does); a group that fewer peers
hold than another of its round (a minority that drifted) is never a candidate.

Why not simply the newest round, as before (issue 19): one signed record claiming a later round
with a made-up hash made every joiner adopt the liar's state. ``agreed_states`` still counts
support without checking it (``[swarm] state_quorum = 0``: a liar naming honest peers on its
list for a round next to theirs gets their support, and a failed peer's state is a last
resort). The default, ``"majority"``, is ``majority_states``: a member vouches for a state only
with a record consistent with it (``_vouchers``), and the state needs more than half of its
round's membership (``_round_size``), which the claim's own list does not set (so a record
listing made-up members inflates it: every state unadoptable, a stall, not a poisoning). A
failed round's record carries the list of the round whose state its peer still holds
(``b""`` when it holds none it was a member of): a member that failed every round since
vouches with it, and a lone survivor's state is adoptable through it (``vouched_survivors``).
Its holders are the sources a joiner downloads from, and the peers every member expects in the
next round's matchmaking when a joiner is announced. Which of these rules applies is
``[swarm] state_quorum``, and ``swarmtrain.membership.plan.candidates`` is the one place that
applies it: joiners, re-syncing nodes, the expected set, ``swarmtrain status``, the dashboard and
the coordinator's log all name the run's state (and round) through it.

A joiner announces itself under ``run/<id>/join/<r>`` (``join_key``) once it holds the agreed
state, naming the first round it will contribute to.

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

import functools
import hashlib
import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from p2p import Message, RemoteProtocolError, decode, encode, message

log = logging.getLogger(__name__)

MAX_PROGRESS_BYTES = 2048
PROGRESS_TTL_S = 600.0
MEMBER_TAG_BYTES = 8
# ``[swarm] state_quorum``'s default: a state needs more than half its round's members' support.
MAJORITY = "majority"
# Members listed in a record; a larger round's records list none (then holders count unchecked).
MAX_LISTED_MEMBERS = 128
MAX_MEMBER_LIST_BYTES = MAX_LISTED_MEMBERS * MEMBER_TAG_BYTES
# How the peer found itself (its dial-back verdict): reachable directly ("public"), only through
# its relays ("private"), or not known. Records written before the field existed read "unknown".
REACHABILITY = ("public", "private", "unknown")
# What a peer's published verdict means to someone who wants to reach it (status, dashboard).
SHOWN_REACH = {"public": "direct", "private": "relayed", "unknown": "?"}
# A peer whose latest record is older than this is shown as silent (it may have left).
SILENT_AFTER_S = 120.0


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
    members: bytes  # member_list of the round's contributors; a failed round: of the held state's

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
        if len(self.members) % MEMBER_TAG_BYTES or len(self.members) > MAX_MEMBER_LIST_BYTES:
            raise ValueError(
                f"members must be at most {MAX_LISTED_MEMBERS} tags of {MEMBER_TAG_BYTES} bytes"
            )


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
    members: bytes = b""  # member_list of the round's contributors (``peers`` of them)

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
            self.members,
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


@functools.lru_cache(maxsize=4096)
def member_tag(peer_id: str) -> bytes:
    """How a progress record lists one member."""
    return hashlib.sha256(b"swarmtrain/member/1\x00" + peer_id.encode()).digest()[:MEMBER_TAG_BYTES]


def member_list(contributors: Iterable[str]) -> bytes:
    """A record's list of its round's contributors (peer ids, any order): their sorted tags,
    or nothing for a round of more than ``MAX_LISTED_MEMBERS``."""
    tags = sorted({member_tag(p) for p in contributors})
    return b"".join(tags) if len(tags) <= MAX_LISTED_MEMBERS else b""


@functools.lru_cache(maxsize=4096)
def _tags(members: bytes) -> frozenset[bytes]:
    """A member list's tags as a set; each distinct list is split once (every record of a
    round carries the same one)."""
    return frozenset(
        members[i : i + MEMBER_TAG_BYTES] for i in range(0, len(members), MEMBER_TAG_BYTES)
    )


def _lists(members: bytes, peer_id: str) -> bool:
    """``peer_id`` is on the list (an empty list: a round too large to list, unchecked)."""
    return not members or member_tag(peer_id) in _tags(members)


def on_list(members: bytes, peer_id: str) -> bool:
    """``peer_id`` is on the (non-empty) member list."""
    return bool(members) and member_tag(peer_id) in _tags(members)


@dataclass(frozen=True)
class AgreedState:
    """A state the successful records of a round claim, and who holds it."""

    round: int  # the round after which the state was published (its GlobalState.round is +1)
    state_hash: bytes
    holders: tuple[str, ...]  # peer ids, sorted
    published: int  # successful records at that round, holders or not
    members: int = 0  # the round's contributors, as its holders' records say
    member_list: bytes = b""  # as those records list them
    support: int = 0  # listed members that vouch for it (the module docstring)


def agreed_states(
    records: Iterable[Progress], round_number: int | None = None
) -> list[AgreedState]:
    """Every state the successful records (at ``round_number``, or any round) claim that no
    other state of its round has more holders than, best first (the module docstring)."""
    records = list(records)
    # A member's record: successful, and its owner on its own list.
    members = [p for p in records if p.ok and _lists(p.members, p.peer_id)]
    groups: dict[tuple[int, bytes, bytes, int], set[str]] = defaultdict(set)
    published: dict[int, int] = defaultdict(int)
    for p in records:
        if p.ok and (round_number is None or p.round == round_number):
            published[p.round] += 1
    for p in members:
        if round_number is None or p.round == round_number:
            groups[(p.round, p.state_hash, p.members, p.peers)].add(p.peer_id)
    most: dict[int, int] = defaultdict(int)
    for (rnd, *_), holders in groups.items():
        most[rnd] = max(most[rnd], len(holders))
    states = []
    for (rnd, state_hash, listed, count), holders in groups.items():
        if len(holders) < most[rnd]:
            continue  # a minority of its round
        support = len(
            {q.peer_id for q in members if abs(q.round - rnd) <= 1 and _lists(listed, q.peer_id)}
        )
        states.append(
            AgreedState(
                rnd, state_hash, tuple(sorted(holders)), published[rnd], count, listed, support
            )
        )
    states.sort(key=lambda s: (s.support, len(s.holders), s.round, s.state_hash), reverse=True)
    # Claims of one (round, hash) under other lists: the best one stands for them.
    seen: set[tuple[int, bytes]] = set()
    unique = []
    for state in states:
        if (state.round, state.state_hash) not in seen:
            seen.add((state.round, state.state_hash))
            unique.append(state)
    return unique


def _round_size(records: list[Progress], rnd: int, holders: frozenset[bytes]) -> int:
    """The membership a state of round ``rnd`` must win a majority of: the largest list (or
    count, for a round too large to list) any record of rounds ``rnd - 1 .. rnd + 1`` gives
    (a failed record's carried list too), not the state's own, which its holders chose. When
    no record of ``rnd - 1`` exists (a claim rounds ahead of the swarm), the newest earlier
    round's lists count as well, unless they list a holder (``holders``: their tags): the
    state's holders were members there, and those others left, not outvoted them."""

    def size(p: Progress) -> int:
        return len(_tags(p.members)) if p.members else (p.peers if p.ok else 0)

    listed = [p for p in records if _lists(p.members, p.peer_id) and (p.ok or p.members)]
    found = max((size(p) for p in listed if abs(p.round - rnd) <= 1), default=0)
    if not any(p.round == rnd - 1 for p in listed):
        earlier = [p for p in listed if p.round < rnd - 1]
        if earlier:
            newest = max(p.round for p in earlier)
            for p in earlier:
                if p.round == newest and not (p.members and holders & _tags(p.members)):
                    found = max(found, size(p))
    return found


def _vouchers(
    records: list[Progress], rnd: int, state_hash: bytes, listed: bytes, holders: frozenset[bytes]
) -> set[str]:
    """The peers on ``listed`` (round ``rnd``'s members, as the state's holders list them)
    whose own record vouches for the state: the same state of that round; a successful
    record of the round before or after whose list names one of its holders (they were
    members together); or a failed later round that carries this very list (a member that
    failed every round since holds this round's state). An unlisted round: its holders."""
    if not listed:
        return {
            p.peer_id for p in records if p.ok and p.round == rnd and p.state_hash == state_hash
        }
    tags = _tags(listed)

    def vouches(q: Progress) -> bool:
        if member_tag(q.peer_id) not in tags or not _lists(q.members, q.peer_id):
            return False
        if not q.ok:
            return q.round > rnd and q.members == listed
        if q.round == rnd:
            return q.state_hash == state_hash
        return abs(q.round - rnd) == 1 and bool(q.members) and bool(holders & _tags(q.members))

    return {q.peer_id for q in records if vouches(q)}


def majority_states(
    records: Iterable[Progress], round_number: int | None = None
) -> list[AgreedState]:
    """The states (at ``round_number``, or any round) that more than half of their round's
    membership vouches for (``[swarm] state_quorum = "majority"``), best first: by support,
    then holders, then the newer round, then the larger hash. ``support`` is the number of
    vouchers (``_vouchers``), more than half of the membership ``_round_size`` gives.

    Holders of one (round, hash) count together whatever list each gives; the list that earns
    the most support stands for them. A state fewer peers hold than another of its round is
    never one (a minority that drifted), and neither is one its round's members do not vouch
    for: a liar's own record, however far ahead, or naming whichever peers."""
    records = list(records)
    holding: dict[tuple[int, bytes], list[Progress]] = defaultdict(list)
    published: dict[int, int] = defaultdict(int)
    for p in records:
        if p.ok:
            published[p.round] += 1
            if _lists(p.members, p.peer_id):
                holding[(p.round, p.state_hash)].append(p)
    most: dict[int, int] = defaultdict(int)
    for (rnd, _), held in holding.items():
        most[rnd] = max(most[rnd], len({p.peer_id for p in held}))
    states = []
    for (rnd, state_hash), held in holding.items():
        holders = frozenset(p.peer_id for p in held)
        if (round_number is not None and rnd != round_number) or len(holders) < most[rnd]:
            continue
        tags = frozenset(member_tag(h) for h in holders)
        size = _round_size(records, rnd, tags)
        best: tuple[int, bytes, int] | None = None
        for listed, count in sorted({(p.members, p.peers) for p in held}):
            support = len(_vouchers(records, rnd, state_hash, listed, tags))
            if best is None or support > best[0]:
                best = (support, listed, count)
        assert best is not None
        support, listed, count = best
        if 2 * support > max(size, 1):
            states.append(
                AgreedState(
                    rnd, state_hash, tuple(sorted(holders)), published[rnd], count, listed,
                    support,
                )
            )  # fmt: skip
    states.sort(key=lambda s: (s.support, len(s.holders), s.round, s.state_hash), reverse=True)
    return states


def vouched_survivors(records: Iterable[Progress], states: Iterable[AgreedState]) -> list[Progress]:
    """The failed records whose owners vouch for one of ``states`` (``majority_states``) by
    carrying its list: members of an agreed round that failed every round since, so they hold
    its state (each node serves its state after a failed round too). Newest first."""
    states = list(states)
    found = [
        p for p in records
        if not p.ok and p.members and _lists(p.members, p.peer_id)
        and any(p.members == s.member_list and p.round > s.round for s in states)
    ]  # fmt: skip
    return sorted(found, key=lambda p: (-p.round, p.state_hash, p.peer_id))
