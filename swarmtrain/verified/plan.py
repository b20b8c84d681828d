"""Which inner phases of a verified DiLoCo run are re-executed, by whom, and what peers publish.

A *task* is one peer's inner phase of one round: H RepOps AdamW steps from the round's global
parameters with a fresh optimizer state, on that peer's data shard of that round. It is fixed by
(start-state hash, owner, round, H, the spec's hyperparameters), so any peer can run it again.

* ``selected``: a task is re-executed with probability ``verify.rate``, drawn from
  SHA-256(run, round, owner): every peer computes the same draw, and the owner cannot choose it.
* ``verifier_of``: the re-executing peer, the member with the smallest SHA-256(run, round, owner,
  member) among the round's *members* other than the owner. Members are the contributors of the
  previous round, a set every survivor of that round holds bit for bit (the all-reduce reports
  it), so all of them name the same verifier. The first round, and a peer's first round after
  joining, have no such set and are not verified.
* ``RoundClaims``: what a peer publishes under ``run/<id>/verify/<r>`` (its own signed subkey):
  the hash of the RepOps start state it computed from, and a ``verify.commit.Commitment``
  (steps, task root, final state hash) for every task it executed (its own, when selected, and
  those it verifies), each with the root of the contribution the task owes the round
  (``swarm.averaging.commitment``: digests of global minus final parameters per fixed leaf),
  which binds the slices its owner sends to the task (issue 19).
* ``Verdict``: what the coordinator publishes under ``run/<id>/verdicts`` after refereeing a
  difference; ``banned`` reads the cheaters off them.
* ``decide``: a peer's decision about one assignment before the round's averaging: accept the
  owner's contribution, leave it out, or wait.

What peers and the coordinator publish are ``p2p`` wire messages (codes 501-505): typed,
versioned and size-limited, every field checked when it is built (so nobody publishes what
readers refuse), and a malformed value is one ``RemoteProtocolError``.

Pure: encodings, draws and decisions; ``swarmtrain.verified.volunteer`` and
``swarmtrain.verified.referee`` do the IO.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from p2p import LocalProtocolError, Message, PeerID, RemoteProtocolError, decode, encode, message
from verify import Commitment

log = logging.getLogger(__name__)

HASH_BYTES = 32
MAX_CLAIMS = 16  # tasks one peer may claim in a round: its own and those it verifies
MAX_CLAIMS_BYTES = 8192
MAX_VERDICTS = 64  # the verdict list keeps the newest; older cheaters stay banned by id
MAX_VERDICTS_BYTES = 14 * 1024  # under p2p's 16 KiB record value limit
MAX_REASON_CHARS = 200
PEER_ID_MAX_BYTES = 64
CLAIMS_TTL_S = 600.0
AGGREGATION = "aggregation"  # a Verdict's op_name when it names a reducer (op: the part)
# A Verdict's op_name on a slice dispute (``swarmtrain.verified.binding``; op: the part): the
# owner signed a slice that is not its task's pseudo-gradient, or its verifier said so falsely.
SLICE = "slice"
AGREE = "commitments agree"  # decide's reason when the owner's and verifier's claims are equal
# decide's reason when the commitments agree and the contribution roots do not
CONTRIBUTION_DIFFERS = "commitments agree, the contributions they owe differ"
VERDICTS_TTL_S = 7 * 24 * 3600.0


def _digest(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(4, "little") + part)
    return h.digest()


def _round_bytes(run_id: str, round_number: int) -> tuple[bytes, bytes]:
    return run_id.encode(), round_number.to_bytes(8, "little")


def task_seed(run_id: str, round_number: int, owner: bytes) -> int:
    """The task's ``verify.commit.TaskSpec.data_seed``: distinct per run, round and owner."""
    digest = _digest(b"swarmtrain/verify/task", *_round_bytes(run_id, round_number), owner)
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64


def selected(run_id: str, round_number: int, owner: bytes, rate: float) -> bool:
    """Whether ``owner``'s task of ``round_number`` is re-executed (probability ``rate``)."""
    if rate <= 0:
        return False
    digest = _digest(b"swarmtrain/verify/select", *_round_bytes(run_id, round_number), owner)
    return int.from_bytes(digest[:8], "little") < rate * 2**64


def verifier_of(
    run_id: str, round_number: int, owner: bytes, members: Iterable[bytes]
) -> bytes | None:
    """The member that re-executes ``owner``'s task; None when no other member exists."""
    base = _round_bytes(run_id, round_number)
    others = [m for m in members if m != owner]
    if not others:
        return None
    return min(others, key=lambda m: _digest(b"swarmtrain/verify/verifier", *base, owner, m))


@dataclass(frozen=True, order=True)
class Assignment:
    owner: bytes
    verifier: bytes


def assignments(
    run_id: str, round_number: int, members: Iterable[bytes], rate: float
) -> list[Assignment]:
    """Every selected task of the round among ``members``, with its verifier, sorted."""
    group = sorted(set(members))
    out = []
    for owner in group:
        verifier = verifier_of(run_id, round_number, owner, group)
        if verifier is not None and selected(run_id, round_number, owner, rate):
            out.append(Assignment(owner, verifier))
    return out


MAX_NEWCOMERS = 8  # newcomers whose first task a round verifies (each costs a verifier a task)


def newcomers(
    run_id: str,
    round_number: int,
    members: frozenset[bytes],
    records: Mapping[bytes, RoundClaims],
) -> list[bytes]:
    """Peers that are not among the round's members and claim their own task, sorted: at most
    ``MAX_NEWCOMERS``, the first by a per-round hash (no peer picks its place; the others are
    left out this round and verified in a later one)."""
    base = _round_bytes(run_id, round_number)
    found = [p for p, rec in records.items() if p not in members and p in rec.claims]
    found.sort(key=lambda p: _digest(b"swarmtrain/verify/newcomer", *base, p))
    return sorted(found[:MAX_NEWCOMERS])


# -- what peers publish ---------------------------------------------------------------------------


# A task's claim on the wire: (owner, steps, task root, final state hash).
TaskClaim = tuple[bytes, int, bytes, bytes]


@message(501, max_bytes=MAX_CLAIMS_BYTES)
class ClaimsRecord(Message):
    """The DHT value of a ``RoundClaims`` (``run/<id>/verify/<r>``, the peer's own subkey):
    its claims sorted by owner. Raises ``ValueError`` when a field is out of range."""

    start_state_hash: bytes
    claims: tuple[TaskClaim, ...]
    # (owner, contribution root) for the claims whose task's contribution we computed
    contributions: tuple[tuple[bytes, bytes], ...] = ()

    def __post_init__(self) -> None:
        if len(self.claims) > MAX_CLAIMS:
            raise ValueError(f"{len(self.claims)} claims are over the limit of {MAX_CLAIMS}")
        if len(self.contributions) > MAX_CLAIMS:
            raise ValueError(f"{len(self.contributions)} contribution roots are over the limit")
        for owner, root in self.contributions:
            if not (0 < len(owner) <= PEER_ID_MAX_BYTES and _is_hash(root)):
                raise ValueError("a contribution root needs an owner of 1..64 bytes and a hash")
        if not _is_hash(self.start_state_hash):
            raise ValueError(f"the start state hash must be {HASH_BYTES} bytes")
        for owner, steps, root, final in self.claims:
            if not 0 < len(owner) <= PEER_ID_MAX_BYTES or steps <= 0:
                raise ValueError("a claim needs an owner of 1..64 bytes and steps > 0")
            if not (_is_hash(root) and _is_hash(final)):
                raise ValueError(f"a claim's hashes must be {HASH_BYTES} bytes")


@dataclass(frozen=True)
class RoundClaims:
    """One peer's record for a round: the start state hash its tasks began from (every task of
    a round starts from the global state) and its commitment per task (by owner). Two
    commitments to a task that started elsewhere differ in their roots already.
    ``contributions``: per task (by owner), the root of what its owner owes the round
    (``swarm.averaging.commitment.contribution_root`` of global minus final parameters)."""

    start_state_hash: bytes
    claims: Mapping[bytes, Commitment]
    contributions: Mapping[bytes, bytes] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The DHT value. Raises ValueError for what no reader would accept (too many claims)."""
        body = tuple(
            (owner, c.steps, c.task_root, c.final_state_hash)
            for owner, c in sorted(self.claims.items())
        )
        roots = tuple(sorted(self.contributions.items()))
        return encode(ClaimsRecord(self.start_state_hash, body, roots))

    @classmethod
    def from_bytes(cls, data: bytes) -> RoundClaims | None:
        """None for anything malformed (a peer's record is its claim; garbage claims nothing)."""
        try:
            record = decode(data, ClaimsRecord)
        except RemoteProtocolError as exc:
            log.debug("verification claims ignored: %s", exc)
            return None
        claims = {
            owner: Commitment(steps, root, final) for owner, steps, root, final in record.claims
        }
        return cls(record.start_state_hash, claims, dict(record.contributions))


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == HASH_BYTES


def majority_start(records: Iterable[RoundClaims]) -> bytes | None:
    """The start state hash most peers of a round computed from (ties on the hash itself)."""
    counts = Counter(r.start_state_hash for r in records)
    if not counts:
        return None
    return max(counts, key=lambda h: (counts[h], h))


@message(502, max_bytes=MAX_VERDICTS_BYTES)
class Verdict(Message):
    """The coordinator's ruling on one disputed task. ``cheater`` None: nobody could be named.
    Published in a ``VerdictList``, its reason cut to ``MAX_REASON_CHARS``."""

    round: int
    owner: bytes
    verifier: bytes
    cheater: bytes | None
    step: int | None
    op: int | None
    op_name: str
    reason: str

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError("a verdict's round must be >= 0")

    def describe(self) -> str:
        """Where the cheating was: ``round r, step s, operator o (name)``, or an all-reduce part
        (its reducer, ``owner``, got it wrong, or a contributor served other bytes than it
        signed)."""
        if self.op_name == AGGREGATION:
            how = "reduced wrong" if self.cheater == self.owner else "its slice misstated"
            return f"round {self.round}, part {self.op} of the all-reduce ({how})"
        if self.op_name == SLICE:
            how = (
                "a slice other than its task's pseudo-gradient"
                if self.cheater == self.owner
                else "a false accusation of its owner's slice"
            )
            return f"round {self.round}, part {self.op} of the all-reduce ({how})"
        return f"round {self.round}, step {self.step}, operator {self.op} ({self.op_name})"

    def to_json(self) -> dict[str, object]:
        """The verdict for ``swarmtrain status --json`` and the dashboard: peer ids in base58."""

        def name(peer: bytes | None) -> str | None:
            return None if peer is None else str(PeerID(peer))

        return {
            "round": self.round,
            "owner": name(self.owner),
            "verifier": name(self.verifier),
            "cheater": name(self.cheater),
            "step": self.step,
            "op": self.op,
            "op_name": self.op_name,
            "reason": self.reason,
        }


@message(503, max_bytes=MAX_VERDICTS_BYTES)
class VerdictList(Message):
    """The DHT value under ``run/<id>/verdicts``: the coordinator's newest verdicts, oldest
    first."""

    verdicts: tuple[Verdict, ...]

    def __post_init__(self) -> None:
        if len(self.verdicts) > MAX_VERDICTS:
            raise ValueError(f"a verdict list holds at most {MAX_VERDICTS}")


def _newest_that_fit(
    items: Sequence[Verdict | AuditResult], most: int, wrap: Callable[[tuple[Any, ...]], Message]
) -> bytes:
    """``wrap(newest items)`` encoded: the newest ``most``, older ones dropped while over the
    list's size limit; each reason cut to ``MAX_REASON_CHARS``."""
    kept = [replace(item, reason=item.reason[:MAX_REASON_CHARS]) for item in items[-most:]]
    while True:
        try:
            return encode(wrap(tuple(kept)))
        except LocalProtocolError:
            if not kept:
                raise
            kept = kept[1:]


def encode_verdicts(verdicts: Iterable[Verdict]) -> bytes:
    """The newest verdicts that fit (the cheaters they name stay banned by the peers that read
    them; a peer reading later sees only these)."""
    return _newest_that_fit(list(verdicts), MAX_VERDICTS, VerdictList)


def decode_verdicts(data: bytes) -> list[Verdict]:
    """Raises ``RemoteProtocolError`` for a malformed list (the coordinator's own: a bug or an
    attack worth a loud error, not a value to skip)."""
    return list(decode(data, VerdictList).verdicts)


def banned(verdicts: Iterable[Verdict]) -> dict[bytes, Verdict]:
    """Every peer a verdict named as the cheater, with the first verdict that named it."""
    out: dict[bytes, Verdict] = {}
    for v in verdicts:
        if v.cheater is not None:
            out.setdefault(v.cheater, v)
    return out


# -- a peer's decision about one assignment -------------------------------------------------------


class Decision(enum.Enum):
    ACCEPT = "accept"  # commitments agree, the verifier cheated, or the verifier is absent
    EXCLUDE = "exclude"  # the owner's contribution stays out of this round
    WAIT = "wait"


def decide(
    assignment: Assignment,
    records: Mapping[bytes, RoundClaims],
    verdicts: Iterable[Verdict],
    round_number: int,
    *,
    timed_out: bool,
    newcomer: bool = False,
) -> tuple[Decision, str]:
    """What to do with the owner's contribution in this round, and why.

    ``records`` maps a peer to its published ``RoundClaims`` for the round. A verdict on this
    task settles it (the owner's contribution counts only if the verifier was the cheater).
    Otherwise the owner's and the verifier's claims must both be visible and equal; a difference
    waits for the verdict. Equal claims with contribution roots that differ (or an owner's
    missing one) leave the owner out at once: no dispute game rules on them, and a root its
    verifier did not compute would let it send other values than its task's (issue 19). At
    ``timed_out``: a missing or disputed owner is left out (its contribution is unverified), a
    missing verifier lets the owner in (the owner cannot be blamed for it) unless the owner is
    a ``newcomer``: its first contribution counts only verified.
    """
    owner, verifier = assignment.owner, assignment.verifier
    for v in verdicts:
        if v.round == round_number and v.owner == owner and v.op_name not in (AGGREGATION, SLICE):
            if v.cheater is not None and v.cheater == verifier:
                return Decision.ACCEPT, "the verifier was found cheating"
            return Decision.EXCLUDE, f"referee: {v.reason}"
    own = records.get(owner)
    mine = own.claims.get(owner) if own is not None else None
    check = records.get(verifier)
    theirs = check.claims.get(owner) if check is not None else None
    if mine is not None and theirs is not None:
        if mine == theirs:
            # The same task, so the same contribution: a root the owner committed that its
            # verifier did not compute (or none) would bind its slices to other values.
            root = None if own is None else own.contributions.get(owner)
            if root is None or check is None or root != check.contributions.get(owner):
                return Decision.EXCLUDE, CONTRIBUTION_DIFFERS
            return Decision.ACCEPT, AGREE
        if timed_out:
            return Decision.EXCLUDE, "commitments differ and no verdict came in time"
        return Decision.WAIT, "commitments differ; waiting for the coordinator's verdict"
    if not timed_out:
        return Decision.WAIT, "waiting for both commitments"
    if mine is None:
        return Decision.EXCLUDE, "the owner published no commitment in time"
    if newcomer:
        return Decision.EXCLUDE, "a newcomer's first task, and its verifier published nothing"
    return Decision.ACCEPT, "the verifier published no commitment in time (unverified)"


def disputes(records: Mapping[bytes, RoundClaims]) -> list[tuple[bytes, bytes]]:
    """Tasks whose owner's claim and another peer's claim differ, as (owner, other), sorted:
    what the coordinator referees."""
    out = []
    for owner, record in sorted(records.items()):
        mine = record.claims.get(owner)
        if mine is None:
            continue
        for other, theirs in sorted(records.items()):
            claim = theirs.claims.get(owner)
            if other != owner and claim is not None and claim != mine:
                out.append((owner, other))
    return out


# -- aggregation audits (issue 5, point 9) --------------------------------------------------------


MAX_AUDIT_RESULTS = 64


@message(504, max_bytes=MAX_VERDICTS_BYTES)
class AuditResult(Message):
    """The referee's ruling on one part of one group's round: ``ok`` True (recomputed, equal),
    False (``cheater`` named: the reducer, whose sum is wrong or claims an input nobody signed,
    or a contributor serving other bytes than it signed) or None (could not tell: a contributor
    did not serve its slice). Published in an ``AuditResultList``, its reason cut to
    ``MAX_REASON_CHARS``."""

    round: int
    group_id: bytes
    part: int
    reducer: bytes
    ok: bool | None
    reason: str
    cheater: bytes | None = None

    @property
    def sum_wrong(self) -> bool:
        """The part everyone received is not what its inputs sum to: the round must not apply."""
        return self.ok is False and self.cheater == self.reducer


@message(505, max_bytes=MAX_VERDICTS_BYTES)
class AuditResultList(Message):
    """The DHT value under ``run/<id>/audits``: the referee's newest results, oldest first."""

    results: tuple[AuditResult, ...]

    def __post_init__(self) -> None:
        if len(self.results) > MAX_AUDIT_RESULTS:
            raise ValueError(f"an audit result list holds at most {MAX_AUDIT_RESULTS}")


def encode_audit_results(results: Iterable[AuditResult]) -> bytes:
    """The newest results that fit: members wait only for their current round's."""
    return _newest_that_fit(list(results), MAX_AUDIT_RESULTS, AuditResultList)


def decode_audit_results(data: bytes) -> list[AuditResult]:
    """Raises ``RemoteProtocolError`` for a malformed list."""
    return list(decode(data, AuditResultList).results)


def decide_all(
    plan: Iterable[Assignment],
    records: Mapping[bytes, RoundClaims],
    verdicts: Collection[Verdict],
    round_number: int,
    members: Collection[bytes],
    *,
    timed_out: bool,
) -> list[tuple[Assignment, Decision, str]]:
    """``decide`` for each assignment of the round, ``members`` telling newcomers apart. A
    banned owner is out at once and a banned verifier counts as timed out: neither is waited
    for (a CI run's honest peer waited its 30 s verify timeout for the claims of a peer banned
    meanwhile, and missed the next round's matchmaking)."""
    ban = banned(verdicts)
    return [
        (a, Decision.EXCLUDE, f"banned: {ban[a.owner].describe()}")
        if a.owner in ban
        else (a, *decide(a, records, verdicts, round_number,
                         timed_out=timed_out or a.verifier in ban,
                         newcomer=a.owner not in members))
        for a in plan
    ]  # fmt: skip
