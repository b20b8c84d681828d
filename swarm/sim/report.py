"""What the simulator records of each peer's round, and the per-round figures drawn from it.

``PeerRound`` is filled in by the round protocol as the round runs; ``round_figures`` is a pure
function of one round's records and groups. Definitions (the bench prints these):

* ``peers``: peers that started the round; ``left``: of them, those that left during it.
* ``groups``: groups of two or more whose all-reduce some member joined.
* ``states``: distinct result vectors (by their bytes) among the peers that finished. More than
  one means the round split the swarm's state: DiLoCo keeps one global state, so every peer not
  holding the *kept* state (the one most peers hold) re-syncs and loses the round's work.
* ``contributed_fraction``: contributors of the kept state over ``peers``.
* ``round_s``: first start to last end; ``match_s``: the longest matchmaking.
* ``over_limit``: the slowest group's all-reduce time (last join to last finish) over its
  ``limit_s`` (``SimGroup.limit_s``: a perfect ring over its slowest member's link).
* ``max_connections``: the most distinct peers one peer exchanged round traffic with (all-reduce
  messages and direct matchmaking asks; DHT lookups not counted).
* ``dht_read_bytes_per_peer``: bytes read from the round's key (polls, re-reads, asks) per peer.
* ``mismatched_groups``: groups whose finished members hold different bytes (must be 0: the
  all-reduce promises every survivor the same bytes). A member that left the swarm before the
  group's last finish is no survivor: it finished, then could not forward what it held, so the
  others may rightly finish over fewer contributors (butterfly rule 4) and it is not counted.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PeerRound:
    peer: bytes
    round: int
    started: float
    matched_at: float | None = None
    group_id: bytes | None = None
    ended_at: float | None = None
    result: np.ndarray | None = None
    contributors: tuple[tuple[bytes, float], ...] = ()
    failure: str | None = None
    left: bool = False
    departed_at: float | None = None  # when the peer left the swarm, in this round or later
    partners: set[bytes] = field(default_factory=set)
    dht_read_bytes: int = 0


@dataclass(frozen=True)
class GroupFigures:
    group_id: bytes
    size: int
    allreduce_s: float
    limit_s: float


@dataclass(frozen=True)
class RoundFigures:
    round: int
    peers: int
    left: int
    groups: int
    finished: int
    states: int
    contributed_fraction: float
    round_s: float
    match_s: float
    allreduce_s: float
    limit_s: float
    over_limit: float
    max_connections: int
    dht_read_bytes_per_peer: float
    mismatched_groups: int

    @property
    def ok(self) -> bool:
        """The round left the swarm one state that some peers finished with."""
        return self.finished > 0 and self.states == 1


def _nan_max(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return max(values) if values else math.nan


def round_figures(
    round_number: int, records: list[PeerRound], groups: list[GroupFigures]
) -> RoundFigures:
    """The figures of one round (module docstring) from its peers' records and its groups."""
    finished = [r for r in records if r.result is not None]
    digests = {id(r): hashlib.sha256(r.result.tobytes()).digest() for r in finished}  # type: ignore[union-attr]
    counts = Counter(digests.values())
    kept_contributors: set[bytes] = set()
    if counts:
        kept = max(sorted(counts), key=lambda d: counts[d])
        holder = next(r for r in finished if digests[id(r)] == kept)
        kept_contributors = {peer for peer, _ in holder.contributors}
    last_finish: dict[bytes | None, float] = {}
    for r in finished:
        ended = r.ended_at if r.ended_at is not None else math.inf
        last_finish[r.group_id] = max(last_finish.get(r.group_id, -math.inf), ended)
    by_group: dict[bytes | None, set[bytes]] = {}
    for r in finished:
        if r.departed_at is not None and r.departed_at < last_finish[r.group_id]:
            continue  # left before the others finished (module docstring)
        by_group.setdefault(r.group_id, set()).add(digests[id(r)])
    ends = [r.ended_at for r in records if r.ended_at is not None]
    matches = [r.matched_at - r.started for r in records if r.matched_at is not None]
    ratios = [g.allreduce_s / g.limit_s for g in groups if not math.isnan(g.allreduce_s)]
    slowest = max(
        (g for g in groups if not math.isnan(g.allreduce_s)),
        key=lambda g: g.allreduce_s / g.limit_s,
        default=None,
    )
    peers = len(records)
    return RoundFigures(
        round=round_number,
        peers=peers,
        left=sum(r.left for r in records),
        groups=len(groups),
        finished=len(finished),
        states=len(counts),
        contributed_fraction=len(kept_contributors) / peers if peers else 0.0,
        round_s=(max(ends) - min(r.started for r in records)) if ends else math.nan,
        match_s=max(matches, default=math.nan),
        allreduce_s=slowest.allreduce_s if slowest else math.nan,
        limit_s=slowest.limit_s if slowest else math.nan,
        over_limit=_nan_max(ratios),
        max_connections=max((len(r.partners) for r in records), default=0),
        dht_read_bytes_per_peer=(
            statistics.fmean(r.dht_read_bytes for r in records) if records else 0.0
        ),
        mismatched_groups=sum(len(d) > 1 for d in by_group.values()),
    )


def summary(figures: list[RoundFigures]) -> dict[str, float | int]:
    """The run in one JSON-able dict: medians and worsts over rounds (nan rounds skipped)."""

    def finite(values: list[float]) -> list[float]:
        return [v for v in values if not math.isnan(v)]

    ratios = finite([f.over_limit for f in figures])
    return {
        "peers": figures[0].peers if figures else 0,
        "rounds": len(figures),
        "rounds_ok": sum(f.ok for f in figures),
        "allreduce_over_limit": round(statistics.median(ratios), 3) if ratios else math.nan,
        "contributed_fraction": round(statistics.fmean(f.contributed_fraction for f in figures), 4)
        if figures
        else 0.0,
        "max_connections_per_peer": max((f.max_connections for f in figures), default=0),
        "dht_read_bytes_per_peer_round": round(
            statistics.fmean(f.dht_read_bytes_per_peer for f in figures)
        )
        if figures
        else 0,
        "groups_per_round": round(statistics.fmean(f.groups for f in figures), 2)
        if figures
        else 0.0,
        "states_per_round_max": max((f.states for f in figures), default=0),
        "mismatched_groups": sum(f.mismatched_groups for f in figures),
    }
