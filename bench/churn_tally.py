"""The churn soak's bookkeeping, sans IO: a node's printed lines parsed into events, and the
swarm's figures computed from a list of them (``bench.churn`` feeds it lines as they arrive).

A node prints one line per round (``swarmtrain.training.loop``): ``round r loss ... peers N ...
state <hash12> agree ...`` when it averaged round r, ``round r loss ... FAILED (why); state
<hash12> ...`` when its round failed, and ``synced to round R ... state <hash12> ...`` when it
adopted the swarm's state (joining, or re-syncing after a failed or disagreeing round). From
those, with the wall-clock time each line arrived:

* a **swarm round** is averaged when any peer printed it averaged; its time is the first such
  line's (the others print within the round's agreement check);
* the **longest stall** is the longest gap between two successive averaged swarm rounds (by
  round number), the gap from the last one to the end of the soak included: a swarm that stops
  averaging shows as one long stall, not as a short list of rounds;
* a **hash disagreement** is a round r whose averaging peers printed more than one state hash
  and whose next round r + 1 (averaged too) still did: a peer whose state drifted re-syncs after
  its round, so one differing round is repaired churn, two in a row a split that persists;
* a **lost round** is a round some peer printed FAILED for and none averaged (the swarm's
  numbering went past it).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise

_HASH = r"([0-9a-f]{12})"
AVERAGED = re.compile(rf"^round (\d+) loss \S+ \S+ tok/s peers (\d+) .* state {_HASH} agree ")
FAILED = re.compile(rf"^round (\d+) loss \S+ \S+ tok/s FAILED \((.*)\); state {_HASH} ")
SYNCED = re.compile(rf"^synced to round (\d+) from (\d+) peers .* state {_HASH} ")


class Kind(Enum):
    AVERAGED = "averaged"
    FAILED = "failed"
    SYNCED = "synced"  # ``round`` is the state's round: the next one the node trains


@dataclass(frozen=True)
class Event:
    t: float  # seconds since the soak started, when the line arrived
    node: int
    kind: Kind
    round: int
    state: str  # the state hash's first 12 hex digits after the event
    peers: int = 0  # averaged: the round's group size; synced: how many peers sent the state
    why: str = ""  # failed: the node's reason


def parse_line(line: str, t: float, node: int) -> Event | None:
    """The event a node's stdout line reports, or None for any other line."""
    if m := AVERAGED.match(line):
        return Event(t, node, Kind.AVERAGED, int(m[1]), m[3], peers=int(m[2]))
    if m := FAILED.match(line):
        return Event(t, node, Kind.FAILED, int(m[1]), m[3], why=m[2])
    if m := SYNCED.match(line):
        return Event(t, node, Kind.SYNCED, int(m[1]), m[3], peers=int(m[2]))
    return None


@dataclass(frozen=True)
class RoundRow:
    """One swarm round as the soak's table shows it."""

    round: int
    t: float | None  # when the first peer printed it averaged; None when none did
    averaged: int  # peers that averaged it
    failed: int  # peers whose round failed
    hashes: dict[str, int]  # state hash -> averaging peers that printed it
    gap_s: float | None  # since the previous averaged swarm round (None for the first)


@dataclass
class Figures:
    rounds: int = 0  # swarm rounds averaged by at least one peer
    first_round: int | None = None
    last_round: int | None = None
    max_stall_s: float = 0.0
    stall_after_round: int | None = None  # the round the longest stall followed (None: start)
    hash_disagreements: int = 0
    disagreeing_rounds: list[int] = field(default_factory=list)  # differed, then again at r + 1
    split_rounds: int = 0  # rounds whose averaging peers printed more than one hash at all
    failed_rounds: int = 0  # FAILED lines, one per peer and round
    lost_rounds: int = 0
    syncs: int = 0
    # Syncs to a state that no averaging peer of its round printed: a live member's state after
    # a failed round (the fallback when no agreed state's holder answers), or a wrong one. A
    # sync to a round nobody printed averaged is not counted.
    foreign_syncs: int = 0


def round_rows(events: Iterable[Event]) -> list[RoundRow]:
    """One row per round any peer printed (averaged or failed), in round order."""
    first_t: dict[int, float] = {}
    averaged: dict[int, int] = defaultdict(int)
    failed: dict[int, int] = defaultdict(int)
    hashes: dict[int, dict[str, int]] = defaultdict(dict)
    for e in events:
        if e.kind is Kind.AVERAGED:
            first_t[e.round] = min(first_t.get(e.round, e.t), e.t)
            averaged[e.round] += 1
            hashes[e.round][e.state] = hashes[e.round].get(e.state, 0) + 1
        elif e.kind is Kind.FAILED:
            failed[e.round] += 1
    rows: list[RoundRow] = []
    previous: float | None = None
    for r in sorted(set(averaged) | set(failed)):
        t = first_t.get(r)
        gap = None if t is None or previous is None else max(0.0, t - previous)
        rows.append(RoundRow(r, t, averaged[r], failed[r], dict(hashes[r]), gap))
        previous = t if t is not None else previous
    return rows


def figures(events: Iterable[Event], end_t: float) -> Figures:
    """The swarm's figures from every event of a soak that ended at ``end_t``."""
    events = list(events)
    rows = round_rows(events)
    out = Figures()
    done = [row for row in rows if row.averaged]
    out.rounds = len(done)
    out.failed_rounds = sum(row.failed for row in rows)
    out.lost_rounds = sum(1 for row in rows if not row.averaged)
    if done:
        out.first_round, out.last_round = done[0].round, done[-1].round
        for before, row in pairwise(done):
            assert row.gap_s is not None
            if row.gap_s > out.max_stall_s:
                out.max_stall_s, out.stall_after_round = row.gap_s, before.round
        assert done[-1].t is not None
        tail = max(0.0, end_t - done[-1].t)
        if tail > out.max_stall_s:
            out.max_stall_s, out.stall_after_round = tail, done[-1].round
    else:
        out.max_stall_s = end_t  # nothing was averaged: the whole soak was a stall
    by_round = {row.round: row for row in done}
    for row in done:
        if len(row.hashes) > 1:
            out.split_rounds += 1
            later = by_round.get(row.round + 1)
            if later is not None and len(later.hashes) > 1:
                out.hash_disagreements += 1
                out.disagreeing_rounds.append(row.round)
    for e in events:
        if e.kind is Kind.SYNCED:
            out.syncs += 1
            held = by_round.get(e.round - 1)  # a state of round R is round R - 1's average
            if held is not None and e.state not in held.hashes:
                out.foreign_syncs += 1
    return out
