"""Matchmaking through the DHT: who averages with whom in round r, decided without a leader.

Theory of operation
-------------------
Every peer of a run that wants to average in round ``r`` publishes a ``Declaration`` as its own
signed subkey under the DHT key ``round_key(run_id, r)`` (``run/<id>/round/<r>``). The groups of a
round are a *pure function of the set of declarations* (``derive_groups``): no peer proposes,
votes or leads, so any two peers that read the same set compute the same groups, byte for byte.

``derive_groups`` rules:

* Only declarations for round ``r`` count; a peer that appears twice keeps its greatest
  declaration (by ``declared_at``, then the other fields), so the input order never matters.
* Up to ``max_group_size`` peers form one group. Above it the swarm splits into
  ``g = ceil(n / max_group_size)`` groups whose sizes differ by at most one, unless
  ``MatchmakingConfig.one_group`` (a hierarchical all-reduce, which lays the peers out in rows
  itself): then every member is in the round's one group, its id a hash of them all.
* Splits change every round so that information mixes (Moshpit SGD, a grid of groups). Peers are
  ordered by ``sha256(run_seed, peer_id)`` and laid out in rows of ``g``; in round ``r`` the peer
  at row ``k``, column ``c`` joins group ``(c + k * r) mod g``. Each full row puts one peer in
  every group, so groups stay balanced; two peers of rows ``k1 != k2`` that meet in round ``r``
  are apart in round ``r + 1`` unless ``g`` divides ``k2 - k1``. So the partition of round ``r + 1``
  always differs from that of round ``r`` when the swarm is split, and after a column round and a
  diagonal round every group holds every column's average once there are at least ``g`` rows.

``Matchmaker`` is the state machine of one peer for one round (role-free, h11 style: all
transition logic lives in this file and the machine never knows which peer "leads"):

    DECLARING --LocalRequest--> WAITING --(all expected declared)--> FORMED
                                   |                                   ^
                                   +--DeadlineReached--> CONFIRMING ---+--> FAILED

* ``LocalRequest(declaration)`` orders ``Publish(declaration)``.
* ``DeclarationsSeen(decls)`` adds what a DHT read returned to the view. Declarations for another
  round, or stamped after the deadline, are not for this round and are left out.
* There is no minimum wait: as soon as every *expected* peer (the driver passes the previous
  round's members still believed alive) has declared, the group forms.
* Otherwise, at the deadline, the machine orders one more ``ReadDeclarations`` and decides on the
  union of its view and that read, delivered as ``DeclarationsReread`` (CONFIRMING). The read
  also asks each expected peer still missing directly (a declarer always holds its own
  declaration, so this finds one the replicas missed). While an expected peer that answered is
  still missing, the machine reads again for one more declaration window (the time from our
  declaration to the deadline), at most ``config.confirm_timeout_s``: it may have started the round
  later than we did, another peer may have seen its declaration and finished early (rule 1), and
  deciding by rule 2 without it would split the round. Not longer: a live peer that is in another
  round would cost every round that much, and peers whose rounds start on a clock (stage servers)
  would drift out of phase. If no re-read comes back by ``deadline + config.confirm_timeout_s``
  the round fails for this peer.
* Events after FORMED are ignored (a late declaration is not included: that peer joins the next
  round, see ``target_round``). Any event after FAILED raises ``LocalProtocolError``.

Convergence rule for partial views (why two peers with different views agree):

1. If every expected peer has declared, the members are exactly the expected peers. Unexpected
   declarers (newcomers) are deferred to a later round, so two peers that both finish early agree
   whatever extra declarations each happened to see, and a peer that reached its deadline but whose
   re-reads show every expected peer applies the same rule and agrees with them too. An expected
   peer's declaration counts here even if stamped after our deadline: peers start a round at
   different times, and one that declared before *its* deadline may be in the others' groups.
2. Otherwise (an expected peer never declared or did not answer, so nobody could finish early)
   the members are all declarers for the round stamped no later than the deadline, read after it.
   Honest peers publish for round ``r`` only before its deadline (``target_round``), so after the
   deadline the set is closed and every re-read returns the same set: the groups are identical.

The assumption is that a DHT read made after the deadline returns every declaration stored before
it; a peer whose read misses one may compute other groups, and its all-reduce partners then
refuse it (the group id differs), which costs that peer one round, never a wrong result.

Newcomers enter through the expected set: a peer that is late for round ``r`` declares for
``r + 1`` (``target_round``), before ``r + 1`` opens; drivers build the expected set of a round as
the previous round's surviving members plus the declarations already stored when the round opens.

Scheduled rounds and sharded declarations (``MatchmakingConfig.schedule``, ``.shards``)
------------------------------------------------------------------------------------------
Rules 1-2 agree only among peers that saw the same set, and peers that finish round ``r`` tens of
seconds apart (a 1,000-peer all-reduce does) close their windows of ``r + 1`` on different sets.
A scheduled round has no expected set and no per-peer window: its declaration window closes at
an instant every peer derives from the declarations themselves (``scheduled_close``), and its
members are every declarer stamped no later than that close (``scheduled_members``).

* Declarations are spread over ``shards`` keys, ``round_key(run, r, shard)`` with
  ``shard_of(peer)`` a hash of the peer id (``shard_count``: about 128 records a key, far under
  the DHT's 1,024), so no key grows with the swarm. One shard, ``clock_shard(r)`` (it moves each
  round), times the round: a peer polls only that key, from one replica, until it sees the
  quorum; its decision re-reads every replica of every shard, once.
* The close: each peer declares a hint, how many of its last round's survivors (or of its last
  group's members, when that group's all-reduce failed) fall in this round's clock shard (a
  newcomer: 0). Taken in time order, the first hint sets the quorum
  (``quorum_share`` of it; ``RoundSchedule.expected`` until a hint comes), and once a hint came
  only hinted declarations count: the window waits for most of last round's survivors, then
  stays open ``spread_factor`` times their own spread (at least ``window_s``): the stragglers
  of a round finish about as far behind the quorum as the quorum's second half took. At the
  latest it closes ``long_window_s`` after half the quorum (the rest may have left).
* The close depends only on declarations stamped no later than itself, so every view holding
  those computes the same close and the same members. A peer decides ``grace_s`` after the close
  its view shows, on a re-read of every shard; if that read shows a later close (its polls
  missed an early declaration and saw a narrower spread), it waits for that one and reads again.
  A peer that declared after the close is not in the round: it fails it and declares for the
  next (nobody forms a group of their own). One that sees no close ``max_wait_s`` after its
  declaration gives the round up.

The assumption is rule 2's: a read made ``grace_s`` after the close returns every declaration
stamped before it (and clocks agree to well under the window).

This module is sans-IO: it imports no trio, libp2p, socket, time or random; ``now`` is an argument.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from p2p import LocalProtocolError, Message, RemoteProtocolError, message

MAX_PEER_ID_BYTES = 64
MAX_DECLARATION_BYTES = 512
# Records per sharded round key: well under p2p.dht's 1024-record and 512 KiB caps, and a
# poll of one key (all replicas) stays under ~80 kB.
RECORDS_PER_SHARD = 128
_SEED_DOMAIN = b"swarmtrain/matchmaking/order/1\x00"
_GROUP_DOMAIN = b"swarmtrain/matchmaking/group/1\x00"
_SHARD_DOMAIN = b"swarmtrain/matchmaking/shard/1\x00"


def round_key(run_id: str, round_number: int, shard: int | None = None) -> bytes:
    """The DHT key peers declare under for one round (``shard``: one of its sharded keys, see
    ``round_keys``); each declaration is its owner's subkey."""
    if not run_id or "/" in run_id:
        raise ValueError(f"run id must be non-empty and contain no '/': {run_id!r}")
    if round_number < 0:
        raise ValueError(f"round must be >= 0, got {round_number}")
    if shard is None:
        return f"run/{run_id}/round/{round_number}".encode()
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
        raise ValueError(f"shard must be an int >= 0, got {shard!r}")
    return f"run/{run_id}/round/{round_number}/{shard}".encode()


def shard_count(expected_peers: int, per_shard: int = RECORDS_PER_SHARD) -> int:
    """How many keys a round's declarations are spread over so that each holds about
    ``per_shard`` of ``expected_peers`` (1: today's single key)."""
    if expected_peers < 0 or per_shard < 1:
        raise ValueError(
            f"need expected_peers >= 0 and per_shard >= 1, got {expected_peers}, {per_shard}"
        )
    return max(1, math.ceil(expected_peers / per_shard))


def shard_of(peer_id: bytes, shards: int) -> int:
    """The shard a peer declares under: a hash of its id, so no peer chooses its key."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    digest = hashlib.sha256(_SHARD_DOMAIN + peer_id).digest()
    return int.from_bytes(digest[:8], "big") % shards


def round_keys(run_id: str, round_number: int, shards: int) -> tuple[bytes, ...]:
    """Every key of a round, by shard index: one shard is today's ``round_key(run, r)``."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards == 1:
        return (round_key(run_id, round_number),)
    return tuple(round_key(run_id, round_number, shard) for shard in range(shards))


def clock_shard(round_number: int, shards: int) -> int:
    """The shard whose declarations time a scheduled round (``RoundSchedule``); it moves each
    round so that no key carries every peer's polls all the time."""
    return round_number % shards


def state_key(run_id: str, round_number: int) -> str:
    """The DHT key members publish their state hash under after a round (``StateAgreement``)."""
    if not run_id or "/" in run_id:
        raise ValueError(f"run id must be non-empty and contain no '/': {run_id!r}")
    return f"run/{run_id}/state/{round_number}"


def _finite(value: float, name: str, *, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


@message(130, max_bytes=MAX_DECLARATION_BYTES)
class Declaration(Message):
    """One peer's wish to average in one round, stored as its signed subkey in the DHT.

    The value is this ``p2p`` wire message (``p2p.encode``); ``p2p.decode`` reports anything
    malformed as ``RemoteProtocolError``.

    ``weight`` scales its contribution, ``bandwidth_bps`` sizes its all-reduce part,
    ``declared_at`` is its clock when it published (unix seconds), ``expected_group_size`` is its
    hint of how many peers it expects in the round (0: no idea). Raises ``ValueError`` if invalid.
    """

    peer_id: bytes
    round: int
    weight: float
    bandwidth_bps: float
    declared_at: float
    expected_group_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, bytes) or not 0 < len(self.peer_id) <= MAX_PEER_ID_BYTES:
            raise ValueError(f"peer id must be 1..{MAX_PEER_ID_BYTES} bytes")
        for name in ("round", "expected_group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        _finite(self.weight, "weight", minimum=0.0)
        _finite(self.bandwidth_bps, "bandwidth_bps", minimum=0.0)
        _finite(self.declared_at, "declared_at")

    def _rank(self) -> tuple[float, float, float, int]:
        return (self.declared_at, self.weight, self.bandwidth_bps, self.expected_group_size)


@dataclass(frozen=True, slots=True)
class Group:
    """A group of a round: members sorted by peer id; ``group_id`` commits to round and members."""

    round: int
    index: int
    members: tuple[Declaration, ...]
    group_id: bytes = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(_GROUP_DOMAIN + self.round.to_bytes(8, "big"))
        for member in self.members:
            digest.update(len(member.peer_id).to_bytes(1, "big") + member.peer_id)
        object.__setattr__(self, "group_id", digest.digest())

    @property
    def peer_ids(self) -> tuple[bytes, ...]:
        return tuple(member.peer_id for member in self.members)


def _latest_per_peer(declarations: Iterable[Declaration], round_number: int) -> list[Declaration]:
    best: dict[bytes, Declaration] = {}
    for declaration in declarations:
        if declaration.round != round_number:
            continue
        known = best.get(declaration.peer_id)
        if known is None or declaration._rank() > known._rank():
            best[declaration.peer_id] = declaration
    return list(best.values())


def derive_groups(
    declarations: Iterable[Declaration], round_number: int, *, max_group_size: int, run_seed: bytes
) -> list[Group]:
    """Split the declarers of ``round_number`` into groups; a pure function of the *set*.

    Returns groups ordered by index (empty list if nobody declared), each with at most
    ``max_group_size`` members, sizes differing by at most one. Raises ``ValueError`` if
    ``max_group_size < 1``. Declarations for other rounds are ignored.
    """
    if max_group_size < 1:
        raise ValueError(f"max_group_size must be >= 1, got {max_group_size}")
    members = _latest_per_peer(declarations, round_number)
    if not members:
        return []
    members.sort(
        key=lambda d: (hashlib.sha256(_SEED_DOMAIN + run_seed + d.peer_id).digest(), d.peer_id)
    )
    group_count = math.ceil(len(members) / max_group_size)
    buckets: list[list[Declaration]] = [[] for _ in range(group_count)]
    for position, declaration in enumerate(members):
        row, column = divmod(position, group_count)
        buckets[(column + row * round_number) % group_count].append(declaration)
    return [
        Group(round_number, index, tuple(sorted(bucket, key=lambda d: d.peer_id)))
        for index, bucket in enumerate(buckets)
    ]


def target_round(current_round: int, *, now: float, round_deadline: float, expected: bool) -> int:
    """The round a peer should declare for: the current one only if it is expected and in time.

    A late or unexpected peer declares for the next round, so its declaration is stored before that
    round opens and every driver counts it as expected there.
    """
    return current_round if expected and now < round_deadline else current_round + 1


@dataclass(frozen=True, slots=True)
class RoundSchedule:
    """When a scheduled round's declaration window closes (``scheduled_close``).

    ``expected``: how many declarers a peer with no previous round expects in the round's clock
    shard (the hint it declares, and the rule's when the earliest declaration has none);
    ``quorum_share``: the share of the expected declarers whose declarations the window waits
    for; ``window_s`` and ``spread_factor``: the window then stays open for ``window_s``, or
    ``spread_factor`` times the quorum's own spread if longer; ``long_window_s``: the window
    closes at the latest this long after half the quorum declared (the rest may have left);
    ``max_wait_s``: a peer gives the round up this long after its own declaration if the window
    never closed; ``grace_s``: how long after the close a DHT read returns every declaration
    stamped before it (a store's propagation); ``poll_s``: how often a peer reads the clock
    shard while it waits.
    """

    expected: int
    quorum_share: float = 0.85
    window_s: float = 5.0
    spread_factor: float = 2.0
    long_window_s: float = 300.0
    max_wait_s: float = 900.0
    grace_s: float = 2.0
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.expected, bool) or not isinstance(self.expected, int):
            raise ValueError(f"schedule expected must be an int >= 1, got {self.expected!r}")
        if self.expected < 1:
            raise ValueError(f"schedule expected must be an int >= 1, got {self.expected!r}")
        if not 0.0 < self.quorum_share <= 1.0:
            raise ValueError(f"schedule quorum_share must be in (0, 1], got {self.quorum_share!r}")
        for name in ("window_s", "spread_factor", "long_window_s", "max_wait_s", "grace_s"):
            _finite(getattr(self, name), f"schedule {name}", minimum=0.0)
        _finite(self.poll_s, "schedule poll_s", minimum=0.01)
        if self.max_wait_s < self.long_window_s:
            raise ValueError("schedule max_wait_s must be >= long_window_s")

    @classmethod
    def for_swarm(cls, expected_peers: int, shards: int, **settings: float) -> RoundSchedule:
        """The schedule of a swarm of about ``expected_peers`` over ``shards`` keys."""
        if expected_peers < 1 or shards < 1:
            raise ValueError(f"need expected_peers and shards >= 1, got {expected_peers}, {shards}")
        return cls(max(1, round(expected_peers / shards)), **settings)  # type: ignore[arg-type]

    def quorum(self, hint: int) -> int:
        """Declarations the window waits for when ``hint`` declarers are expected (0: no idea)."""
        return max(1, math.ceil(self.quorum_share * (hint or self.expected)))


def _schedule_order(declaration: Declaration) -> tuple[float, bytes]:
    return declaration.declared_at, declaration.peer_id


def scheduled_close(clock_declarations: Iterable[Declaration], schedule: RoundSchedule) -> float:
    """The instant a scheduled round's declaration window closes; ``inf`` until it can.

    ``clock_declarations``: one per peer, of the round's clock shard, taken in time order. The
    quorum is ``k = schedule.quorum(hint)``: ``hint`` is the first nonzero one declared (how
    many of that peer's last round's survivors fall in this shard; newcomers declare 0, and
    until a hint comes the schedule's ``expected`` stands in). Once a hint came, only hinted
    declarations count (the round waits for last round's survivors, not for newcomers); before,
    all do. With ``t(i)`` the i-th earliest counted ``declared_at`` and ``j = ceil(k / 2)``, the
    window closes at
    ``min(t(k) + max(window_s, spread_factor * (t(k) - t(j))), t(j) + long_window_s)``, computed
    on the declarations taken so far, and never before the last one taken; the scan stops at
    the first declaration stamped after that close.

    So the close rests only on declarations stamped no later than itself: any view holding every
    one of those computes the same close, whatever later ones it also holds or lacks. A view
    that lacks earlier ones may compute another (later, or earlier when the spread it sees is
    narrower), which is why a decision re-reads after the close it expects.
    """
    return _close_and_quorum(clock_declarations, schedule)[0]


def _close_and_quorum(
    clock_declarations: Iterable[Declaration], schedule: RoundSchedule
) -> tuple[float, bool]:
    """``scheduled_close``, and whether the quorum is in."""
    ordered = sorted(clock_declarations, key=_schedule_order)
    hint = 0
    every: list[float] = []  # the declarations taken, in time order
    hinted: list[float] = []  # those of them with a hint: the last round's survivors
    close, quorum_in = math.inf, False
    for declaration in ordered:
        if every and declaration.declared_at > close:
            break
        every.append(declaration.declared_at)
        if declaration.expected_group_size:
            hint = hint or declaration.expected_group_size
            hinted.append(declaration.declared_at)
        # Once a survivor's hint came, the quorum counts survivors: newcomers join the round
        # when they declared in time, but the round does not wait for them.
        timers = hinted if hint else every
        k = schedule.quorum(hint)
        j = (k + 1) // 2
        close, quorum_in = math.inf, len(timers) >= k
        if len(timers) >= j:
            close = timers[j - 1] + schedule.long_window_s
            if quorum_in:
                spread = schedule.spread_factor * (timers[k - 1] - timers[j - 1])
                close = min(close, timers[k - 1] + max(schedule.window_s, spread))
            close = max(close, declaration.declared_at)
    return close, quorum_in


def scheduled_members(
    declarations: Iterable[Declaration], round_number: int, *, shards: int, schedule: RoundSchedule
) -> tuple[float, list[Declaration]]:
    """(the close, the round's members): every declarer of ``round_number`` in any shard whose
    earliest declaration is stamped no later than the close (none while it is ``inf``). A pure
    function of the *set*: each peer counts by its earliest declaration for the round, so a
    re-stamped copy changes nothing.
    """
    earliest: dict[bytes, Declaration] = {}
    for declaration in declarations:
        if declaration.round != round_number:
            continue
        known = earliest.get(declaration.peer_id)
        if known is None or declaration._rank() < known._rank():
            earliest[declaration.peer_id] = declaration
    close = _scheduled(earliest.values(), round_number, shards, schedule)[0]
    return close, [d for d in earliest.values() if d.declared_at <= close < math.inf]


def _scheduled(
    earliest: Iterable[Declaration], round_number: int, shards: int, schedule: RoundSchedule
) -> tuple[float, bool]:
    timer = clock_shard(round_number, shards)
    return _close_and_quorum(
        (d for d in earliest if shard_of(d.peer_id, shards) == timer), schedule
    )


# -- events and actions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LocalRequest:
    """Our peer asks to take part with this declaration."""

    declaration: Declaration


@dataclass(frozen=True, slots=True)
class DeclarationsSeen:
    """A DHT read of the round key returned these declarations (any order, maybe partial)."""

    declarations: tuple[Declaration, ...]


@dataclass(frozen=True, slots=True)
class DeadlineReached:
    """The driver's clock passed ``Matchmaker.deadline``."""


@dataclass(frozen=True, slots=True)
class DeclarationsReread:
    """The answer to ``ReadDeclarations``: a read of the round key made after the deadline, plus
    what the peers it named held; ``unreachable`` are those of them that did not answer.

    A separate event so that a read started before the deadline, arriving late, is never taken for
    the final read the decision rests on.
    """

    declarations: tuple[Declaration, ...]
    unreachable: frozenset[bytes] = frozenset()


Event = LocalRequest | DeclarationsSeen | DeclarationsReread | DeadlineReached


@dataclass(frozen=True, slots=True)
class Publish:
    declaration: Declaration


@dataclass(frozen=True, slots=True)
class ReadDeclarations:
    """Read the round key once more, and ask each peer of ``ask`` (expected, missing from our
    view) what it holds there itself; hand the result back as ``DeclarationsReread``."""

    round: int
    ask: frozenset[bytes] = frozenset()


@dataclass(frozen=True, slots=True)
class Finish:
    group: Group
    groups: tuple[Group, ...]


@dataclass(frozen=True, slots=True)
class Fail:
    reason: str


Action = Publish | ReadDeclarations | Finish | Fail


class MatchState(enum.Enum):
    DECLARING = "DECLARING"
    WAITING = "WAITING"
    CONFIRMING = "CONFIRMING"
    FORMED = "FORMED"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class MatchmakingConfig:
    max_group_size: int
    run_seed: bytes
    confirm_timeout_s: float = 5.0
    # One group of every member however many (a hierarchical all-reduce lays them out itself).
    one_group: bool = False
    # Keys a round's declarations are spread over (``shard_count``; 1: the single round key).
    shards: int = 1
    # Rounds decided at a close every peer derives from the declarations (module docstring,
    # "Scheduled rounds"); None: the expected-peers rules 1 and 2.
    schedule: RoundSchedule | None = None

    def __post_init__(self) -> None:
        if self.max_group_size < 1:
            raise ValueError("max_group_size must be >= 1")
        _finite(self.confirm_timeout_s, "confirm_timeout_s", minimum=0.0)
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"shards must be an int >= 1, got {self.shards!r}")
        if self.shards > 1 and self.schedule is None:
            raise ValueError("sharded declarations need a schedule (rule 1 polls every key)")


class Matchmaker:
    """One peer's matchmaking for one round. See the module docstring for the rules.

    ``handle(event, now)`` returns the actions to carry out in order. It raises
    ``LocalProtocolError`` when our side breaks the rules (a second ``LocalRequest``, a declaration
    for another peer or round, any event after FAILED) and ``RemoteProtocolError`` when the DHT
    shows a declaration under our own peer id that we did not publish. Either latches FAILED.
    Any other exception is a bug.
    """

    def __init__(
        self,
        peer_id: bytes,
        round_number: int,
        *,
        expected_peers: Iterable[bytes],
        deadline: float,
        config: MatchmakingConfig,
    ) -> None:
        self.peer_id = peer_id
        self.round = round_number
        self.expected_peers = frozenset(expected_peers)
        self.deadline = deadline
        self.cutoff = deadline  # declarations stamped later are for a later round (rule 2)
        self.config = config
        self.state = MatchState.DECLARING
        self.view: dict[bytes, Declaration] = {}
        self.unreachable: set[bytes] = set()
        self.reread = False
        self.wait_until = deadline  # until when a re-read waits for a live expected peer
        self.own: Declaration | None = None
        self.group: Group | None = None
        self.schedule = config.schedule
        self.close = math.inf  # a scheduled round's close as our view computes it
        # Whether our view holds the quorum: until it does a scheduled round's driver polls
        # the clock shard; after, the close can only move if a read missed a declaration, and
        # the re-read after the close finds that out.
        self.quorum_seen = False
        # Which shard we declare under, and which one times a scheduled round (the driver polls
        # that one; its re-read reads them all).
        self.own_shard = shard_of(peer_id, config.shards)
        self.clock_shard = clock_shard(round_number, config.shards)

    def handle(self, event: Event, now: float) -> list[Action]:
        if self.state is MatchState.FAILED:
            raise LocalProtocolError(f"matchmaker for round {self.round} already failed")
        try:
            return self._handle(event, now)
        except (LocalProtocolError, RemoteProtocolError):
            self.state = MatchState.FAILED
            raise

    def _handle(self, event: Event, now: float) -> list[Action]:
        state = self.state
        if state is MatchState.FORMED:
            return []  # late declarations and a racing deadline are not for this round any more
        if isinstance(event, LocalRequest):
            if state is not MatchState.DECLARING:
                raise LocalProtocolError(f"LocalRequest in state {state.name}")
            own = event.declaration
            if own.peer_id != self.peer_id or own.round != self.round:
                raise LocalProtocolError("declaration is for another peer or round")
            self.own = own
            if self.schedule is not None:
                self._learn((own,))
                self._reschedule()
                self.state = MatchState.WAITING
                return [Publish(own)]
            window = max(0.0, self.deadline - own.declared_at)
            self.wait_until = self.deadline + min(window, self.config.confirm_timeout_s)
            self._learn((own,))
            self.state = MatchState.WAITING
            return [Publish(own), *self._try_early_finish()]
        if isinstance(event, DeclarationsSeen):
            self._learn(event.declarations)
            if self.schedule is not None:
                if state is MatchState.WAITING:
                    self._reschedule()
                return []
            return self._try_early_finish() if state is MatchState.WAITING else []
        if isinstance(event, DeclarationsReread):
            if state is not MatchState.CONFIRMING:
                raise LocalProtocolError(
                    f"DeclarationsReread in state {state.name} (not asked for)"
                )
            self._learn(event.declarations)
            self.unreachable |= event.unreachable & self.expected_peers
            self.reread = True
            if self.schedule is not None:
                return self._decide_scheduled(now)
            return self._decide_after_reread(now)
        if isinstance(event, DeadlineReached):
            if now < self.deadline:
                raise LocalProtocolError(
                    f"DeadlineReached at {now} before deadline {self.deadline}"
                )
            if state is MatchState.DECLARING:
                return self._fail("deadline passed before we declared")
            if state is MatchState.WAITING:
                self.state = MatchState.CONFIRMING
                if self.schedule is not None:
                    # A scheduled round may come back here after a re-read: a fresh one.
                    self.deadline = now + self.config.confirm_timeout_s
                    self.reread = False
                    return [ReadDeclarations(self.round)]
                self.deadline += self.config.confirm_timeout_s
                return [ReadDeclarations(self.round, self._missing())]
            if self.reread and self.schedule is None:
                return self._form(self._closed_set())
            return self._fail("the re-read of the round key did not come back")
        raise LocalProtocolError(f"unknown event {event!r}")

    def _learn(self, declarations: Iterable[Declaration]) -> None:
        scheduled = self.schedule is not None
        for declaration in declarations:
            if declaration.round != self.round:
                continue  # an old or a future round
            if (
                not scheduled
                and declaration.declared_at > self.cutoff
                and declaration.peer_id not in self.expected_peers
            ):
                continue  # too late and not waited for: that peer joins a later round
            if (
                declaration.peer_id == self.peer_id
                and self.own is not None
                and declaration != self.own
            ):
                raise RemoteProtocolError(
                    "the DHT holds a declaration under our id we did not make"
                )
            known = self.view.get(declaration.peer_id)
            if known is None or (
                declaration._rank() < known._rank()
                if scheduled  # a scheduled round counts each peer's earliest declaration
                else declaration._rank() > known._rank()
            ):
                self.view[declaration.peer_id] = declaration  # order-independent either way

    # -- scheduled rounds --------------------------------------------------------------------

    def _reschedule(self) -> None:
        """The deadline from our view: its close plus the grace, or our give-up time."""
        assert self.schedule is not None and self.own is not None
        self.close, self.quorum_seen = _scheduled(
            self.view.values(), self.round, self.config.shards, self.schedule
        )
        give_up = self.own.declared_at + self.schedule.max_wait_s
        self.deadline = min(self.close + self.schedule.grace_s, give_up)

    def _decide_scheduled(self, now: float) -> list[Action]:
        """After a re-read: decide if the close it shows is a grace past, else wait for it."""
        assert self.schedule is not None and self.own is not None
        close, members = scheduled_members(
            self.view.values(), self.round, shards=self.config.shards, schedule=self.schedule
        )
        self.close = close
        if now < close + self.schedule.grace_s:
            if now >= self.own.declared_at + self.schedule.max_wait_s:
                return self._fail(
                    f"round {self.round}: its window had not closed {self.schedule.max_wait_s:g} s "
                    "after our declaration"
                )
            # The quorum is not in yet, or our polls saw a close earlier than the whole set
            # shows: wait for the close this read shows (a later one, or our give-up time).
            self._reschedule()
            self.state = MatchState.WAITING
            return []
        if self.own.declared_at > close:
            return self._fail(
                f"declared for round {self.round} after its window closed; join round "
                f"{self.round + 1}"
            )
        return self._form(members)

    def _missing(self) -> frozenset[bytes]:
        return frozenset(self.expected_peers - self.view.keys())

    def _closed_set(self) -> list[Declaration]:
        return [d for d in self.view.values() if d.declared_at <= self.cutoff]

    def _try_early_finish(self) -> list[Action]:
        if self.expected_peers and self.expected_peers <= self.view.keys():
            return self._form([self.view[p] for p in self.expected_peers])
        return []

    def _decide_after_reread(self, now: float) -> list[Action]:
        finished = self._try_early_finish()
        if finished:
            return finished
        waiting_for = self._missing() - self.unreachable
        if self.expected_peers and waiting_for and now < self.wait_until:
            return [ReadDeclarations(self.round, waiting_for)]
        return self._form(self._closed_set())

    def _form(self, members: list[Declaration]) -> list[Action]:
        groups = derive_groups(
            members,
            self.round,
            max_group_size=max(1, len(members))
            if self.config.one_group
            else (self.config.max_group_size),
            run_seed=self.config.run_seed,
        )
        mine = [group for group in groups if self.peer_id in group.peer_ids]
        if not mine:
            return self._fail(f"not admitted to round {self.round}; declare for {self.round + 1}")
        self.state = MatchState.FORMED
        self.group = mine[0]
        return [Finish(mine[0], tuple(groups))]

    def _fail(self, reason: str) -> list[Action]:
        self.state = MatchState.FAILED
        return [Fail(reason)]
