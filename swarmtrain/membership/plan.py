"""Which peers a volunteer meets again after failing alone, and which state it adopts: pure rules.

Theory of operation
-------------------
A round fails alone ("no other peer declared in time", a group of 1) when our inner phase ends
far from the others': a fast peer on a busy box runs ahead, a late one trails. Without a rule the
split is for good: the one ahead keeps declaring rounds nobody else is in yet, and each of its
rounds fails alone again (issue 16). The rules here bring live members back onto one round and
one state; ``swarmtrain.membership.elastic`` is the thin driver that reads the DHT records, waits
and downloads.

* **Bounded by the schedule.** A record claiming a round at or past the run's ``rounds`` is
  ignored: nobody can pull the swarm forward (or make it wait) by claiming a huge round.
* **Before our round r averages** (``swarm_ahead``): if other peers already published round r
  or later as averaged, we are behind (a late start, a slow inner phase): skip the doomed
  matchmaking and adopt their state now, while its holders are alive and before the run ends.
  Peers whose records show them past round r are left out of its matchmaking
  (``past_round``): their declarations for it are stale.
* **After our round r failed** (``after_failed_round``):

  - ``ADOPT`` the newest agreed state at round >= r (the others averaged where we could not;
    their state is ahead of ours, we join at their next boundary like any joiner);
  - else ``WAIT`` while a live member is behind us (its newest record is older than r): it will
    publish round r in at most a round's time, and then we either adopt its agreed state or, if
    its round failed as well, both of us open round r + 1 within a poll of each other and meet
    in its matchmaking. Their states may differ then; the round's hash check (its contributors'
    digests only) makes the one off the majority (a tie breaks on the hash, the same on every
    contributor) adopt the other's, so two
    live peers converge within two rounds of meeting. Only the peer ahead waits, never the one
    behind, so two peers never wait for each other.
  A peer that has started but not finished a round yet has no record; its start announcement
    (``Start``) stands in for one, as a record of the round before its first
    (``positions``). Without it a peer that got the CPU first on a busy box failed its round
    0 alone before the others declared, found nobody behind, and ran every later round ahead
    of them, alone, to the end (CI, issue 16).
  - else ``ALONE``: no live member to meet; train on.
* **Live holders** (``states_best_first``): the states a joiner may adopt, newest first, each
  with only the holders not known dead. A download that fails at every holder marks them dead and
  the next newest state held by live peers is tried, so a dead holder never sends a joiner back
  to a fresh round 0 while another member of the run lives: when no agreed state has a live
  holder, the state a live member holds after a failed round is taken (every node serves its
  state after each round, failed or not), under the default quorum only a member's that
  vouches for an agreed state (``states_best_first``).
* **Quorum** (``[swarm] state_quorum``, ``candidates``): which states count as agreed at all.
  ``"majority"`` (default): those more than half of their round's members vouch for
  (``progress.majority_states``); N: those N distinct peers hold; 0: every state, ranked.
  ``swarmtrain status``, the dashboard and the coordinator's log name the run's round by the
  same function, and list the newer rounds only records claim (``unagreed_claims``).

This module imports no trio, libp2p, clock or randomness: ``now`` is passed in.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from swarmtrain.membership.progress import (
    MAJORITY,
    AgreedState,
    Progress,
    Start,
    agreed_states,
    majority_states,
    vouched_survivors,
)

# ``[swarm] state_quorum``: MAJORITY (the default), 0 (the most-held state: unsafe with liars)
# or N (only a state N distinct peers hold).
Quorum = int | str


class Verdict(enum.Enum):
    ADOPT = "adopt"  # take ``Rejoin.target``
    WAIT = "wait"  # a live member is behind us: poll the records again
    ALONE = "alone"  # nobody to meet: train on our own state


@dataclass(frozen=True, slots=True)
class Rejoin:
    verdict: Verdict
    target: AgreedState | None = None  # for ADOPT
    reason: str = ""


def in_schedule(records: Iterable[Progress], rounds: int) -> list[Progress]:
    """The records whose round the run's schedule allows (``0 <= round < rounds``)."""
    return [p for p in records if p.round < rounds]


def candidates(
    records: Iterable[Progress],
    rounds: int,
    quorum: Quorum = MAJORITY,
    round_number: int | None = None,
) -> list[AgreedState]:
    """The states ``quorum`` accepts among the records the schedule allows (of ``round_number``
    only, or any round), best first: MAJORITY, those more than half their round's membership
    vouches for (``progress.majority_states``); 0, every state ``progress.agreed_states`` ranks;
    N, those of them N distinct peers hold.

    This is the one rule for "the run's state": joiners and re-syncing nodes adopt by it, the
    expected set of a joiner's first round is its holders, and ``swarmtrain status``, the
    dashboard and the coordinator's log show it, so a claim no joiner would adopt (a forged
    record far ahead) is never shown as the run's round either."""
    valid = in_schedule(records, rounds)
    if quorum == MAJORITY:
        return majority_states(valid, round_number)
    return [s for s in agreed_states(valid, round_number) if len(s.holders) >= int(quorum)]


def best_state(
    records: Iterable[Progress],
    rounds: int,
    quorum: Quorum = MAJORITY,
    round_number: int | None = None,
) -> AgreedState | None:
    """The run's agreed state (of ``round_number``, or any round): the first of
    ``candidates``, or None."""
    found = candidates(records, rounds, quorum, round_number)
    return found[0] if found else None


@dataclass(frozen=True, slots=True)
class Claim:
    """Successful records of a round that no state the quorum accepts is of."""

    round: int
    peers: int  # how many records claim it


def unagreed_claims(records: Iterable[Progress], accepted: Iterable[AgreedState]) -> list[Claim]:
    """The rounds newer than every state of ``accepted`` (``candidates``) that successful
    records claim, newest first, rounds past the schedule too: what an operator should know
    no joiner adopts (a forged record far ahead, or a round whose records are still arriving).
    """
    newest = max((s.round for s in accepted), default=-1)
    peers: dict[int, set[str]] = {}
    for p in records:
        if p.ok and p.round > newest:
            peers.setdefault(p.round, set()).add(p.peer_id)
    return [Claim(rnd, len(peers[rnd])) for rnd in sorted(peers, reverse=True)]


def swarm_ahead(
    records: Iterable[Progress],
    me: str,
    round_number: int,
    rounds: int,
    quorum: Quorum = MAJORITY,
) -> AgreedState | None:
    """The run's agreed state when it is at round ``round_number`` or later and we do not hold
    it: the others averaged that round already, so our matchmaking for it could only meet stale
    declarations (a late starter's first round formed a "group" with peers long gone and failed
    8 s later). None when nobody is ahead of us. Our own record counts: one peer's claim of a
    later round does not outweigh the state we and others hold (issue 19)."""
    best = best_state(records, rounds, quorum)
    if best is None or best.round < round_number or me in best.holders:
        return None
    return best


def past_round(records: Iterable[Progress], me: str, round_number: int, rounds: int) -> set[str]:
    """Peers whose newest record is of round ``round_number`` or later: they are done with it,
    so a matchmaking declaration of theirs for it is stale (a late starter formed a "group"
    with such declarations and lost 8-10 s per round waiting for peers long gone)."""
    return {
        p.peer_id
        for p in in_schedule(records, rounds)
        if p.peer_id != me and p.round >= round_number
    }


def positions(
    records: Iterable[Progress], starts: Iterable[Start], me: str, rounds: int
) -> dict[str, tuple[int, float]]:
    """Each other peer's newest known round and when it said so (wall-clock seconds): its
    record's, or, when it started (or restarted) after that record, the round before its first
    one (it is in that round and has finished none since it started)."""
    found = {p.peer_id: (p.round, p.published_at) for p in in_schedule(records, rounds)}
    for start in starts:
        known = found.get(start.peer_id)
        if start.first_round <= rounds and (known is None or start.started_at > known[1]):
            found[start.peer_id] = (start.first_round - 1, start.started_at)
    found.pop(me, None)
    return found


def after_failed_round(
    records: Iterable[Progress],
    me: str,
    round_number: int,
    rounds: int,
    now: float,
    live_s: float,
    starts: Iterable[Start] = (),
    quorum: Quorum = MAJORITY,
) -> Rejoin:
    """What to do after our round ``round_number`` failed (see the module docstring)."""
    records = list(records)
    target = best_state(records, rounds, quorum)
    if target is not None and target.round >= round_number:
        return Rejoin(Verdict.ADOPT, target, f"the swarm averaged round {target.round}")
    behind = sorted(
        peer
        for peer, (rnd, at) in positions(records, starts, me, rounds).items()
        if rnd < round_number and now - at <= live_s
    )
    if behind:
        return Rejoin(Verdict.WAIT, None, f"{len(behind)} live peer(s) behind us")
    return Rejoin(Verdict.ALONE, None, "no live peer to meet")


def wait_budget_s(
    records: Iterable[Progress],
    me: str,
    round_number: int,
    round_s: float,
    starts: Iterable[Start] = (),
) -> float:
    """How long at most to wait for the peers behind us: a round's time per round of gap, plus
    one (a member that died behind us costs that much once)."""
    known = positions(records, starts, me, 2**31).values()
    behind = [rnd for rnd, _ in known if rnd < round_number]
    gap = round_number - min(behind) if behind else 1
    return round_s * (min(gap, 8) + 1)


def states_best_first(
    records: Iterable[Progress],
    rounds: int,
    dead: Collection[str] = (),
    me: str = "",
    quorum: Quorum = MAJORITY,
) -> list[AgreedState]:
    """The states a joiner may adopt, best first, each with only the holders not in ``dead``.

    First the states ``quorum`` accepts (``candidates``), a state none of whose holders lives
    left out. Then, as a last resort, the states live members hold after a failed round, each
    peer's own, newest first: when the agreed state's holders are all gone (the survivor of a
    pair failed its next round alone, so its newest record is a failure), a joiner takes the
    survivor's state rather than a fresh round 0 of its own and a second, diverging run
    (issue 16). With MAJORITY only a survivor that vouches for an agreed state (its failed
    record carries that round's list) and only while no agreed state of that round or later
    has a live holder; with N > 0 none; with 0 any live peer's (a liar's too)."""
    valid = in_schedule(records, rounds)
    agreed = candidates(valid, rounds, quorum)
    found: list[AgreedState] = []
    for state in agreed:
        holders = tuple(h for h in state.holders if h not in dead)
        if holders:
            found.append(dataclasses.replace(state, holders=holders))
    if quorum == MAJORITY:
        live = list(found)
        for p in vouched_survivors(valid, agreed):
            if p.peer_id in dead or p.peer_id == me:
                continue
            vouched = [s for s in agreed if s.member_list == p.members and s.round < p.round]
            newest = max(s.round for s in vouched)
            if not any(s.round >= newest for s in live):
                found.append(AgreedState(p.round, p.state_hash, (p.peer_id,), 0))
        return found
    if int(quorum) > 0:
        return found
    alone = [p for p in valid if not p.ok and p.peer_id not in dead and p.peer_id != me]
    for p in sorted(alone, key=lambda p: (-p.round, p.state_hash, p.peer_id)):
        found.append(AgreedState(p.round, p.state_hash, (p.peer_id,), 0))
    return found
