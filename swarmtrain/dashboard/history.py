"""The dashboard's model: a bounded history of one run, and the JSON ``/api/run.json`` serves.

Pure: no trio, no sockets, no clock. The driver (``swarmtrain.dashboard.server``) reads the DHT on
a timer, as ``swarmtrain status`` does, and hands each read to ``RunHistory.observe`` as a
``Reading``; ``RunHistory.to_json(now)`` is what the page and scripts get.

Why a history at all: a peer's DHT record holds only its latest round, so the loss and throughput
curves exist only if someone remembers the earlier ones. Each read adds every peer's current round
to ``round -> peer -> PeerRound``; a round that started and ended between two reads is missing from
the curves (a gap, not a wrong point). ``max_rounds`` bounds the memory: past it the lowest rounds
are dropped; records of rounds past the run's schedule never enter it. Like ``swarmtrain
status``, every figure is only what the peer that signed the record claims, except the run's
round and agreed state: those are the state a joiner would adopt (``plan.candidates``, under
``[swarm] state_quorum``), so one forged record far ahead is listed under ``unagreed``, not
shown as the run's round.

A record's byte counts add up every round the peer contributed to since it started. A round's
bytes are the difference to the same peer's record of its previous contribution, so they are
known only where the history holds that record (or the round is the peer's first contribution):
peers whose step is unknown are left out of the round's sum, and a round with none is null.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2p import PeerID
from swarmtrain.membership.plan import Quorum, candidates, unagreed_claims
from swarmtrain.membership.progress import (
    MAJORITY,
    SHOWN_REACH,
    SILENT_AFTER_S,
    AgreedState,
    Progress,
)
from swarmtrain.pipeline.progress import TrainerProgress
from swarmtrain.verified.plan import Verdict, banned

# Bumped when a field of ``to_json`` changes meaning or goes away (new fields keep it).
JSON_VERSION = 1
MAX_ROUNDS = 1000


@dataclass(frozen=True)
class RunInfo:
    """What the coordinator knows of its run before any peer shows up."""

    run_id: str
    spec_hash: str  # sha256 of the signed run spec's bytes, hex
    coordinator: str  # base58 peer id
    rounds: int
    pipeline_stages: int = 0  # > 0: a SWARM pipeline run
    verify_rate: float = 0.0  # > 0: a verified run
    state_quorum: Quorum = MAJORITY  # [swarm] state_quorum: which state is the run's


@dataclass(frozen=True)
class Reading:
    """One read of the run's state: what the driver gathered at ``at`` (unix seconds).

    ``progress``: DiLoCo peers' latest records; ``trainers`` and ``stages``: a pipeline run's
    trainer records and ``pipeline_status`` rows; ``verdicts``: the coordinator's own;
    ``links``: peer id -> how the coordinator is connected to it now (``direct``, ``punched``,
    ``relayed``)."""

    at: float
    progress: tuple[Progress, ...] = ()
    trainers: Mapping[str, TrainerProgress] = field(default_factory=dict)
    stages: tuple[Mapping[str, Any], ...] = ()
    verdicts: tuple[Verdict, ...] = ()
    links: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerRound:
    """One peer's figures for one round. ``throughput``: tokens/s for a DiLoCo peer, samples/s
    for a pipeline trainer; ``state_hash`` is empty for a trainer (a pipeline has none). The
    byte counts are the peer's totals over its ``contributed`` rounds; None for a trainer."""

    loss: float | None
    throughput: float
    bytes_sent: int | None = None
    bytes_received: int | None = None
    contributed: int = 0
    state_hash: str = ""


class RunHistory:
    """Every round seen so far (at most ``max_rounds``), and the latest read."""

    def __init__(self, info: RunInfo, max_rounds: int = MAX_ROUNDS) -> None:
        if max_rounds <= 0:
            raise ValueError("max_rounds must be positive")
        self.info = info
        self.max_rounds = max_rounds
        self.rounds: dict[int, dict[str, PeerRound]] = {}
        self.last: Reading | None = None
        self.error: str | None = None  # why the latest read failed; None after a good one
        self.error_at: float | None = None

    def observe(self, reading: Reading) -> None:
        """Record a read: each peer's latest round joins the history (replacing what the same
        peer said earlier about the same round)."""
        for p in reading.progress:
            if p.round >= self.info.rounds:
                continue  # past the schedule: no curve point (a forged round would evict real ones)
            figures = PeerRound(
                p.loss,
                p.tokens_per_s,
                p.bytes_sent,
                p.bytes_received,
                p.rounds_contributed,
                p.state_hash.hex(),
            )
            self._add(p.round, p.peer_id, figures)
        for peer, t in reading.trainers.items():
            self._add(t.round, peer, PeerRound(t.loss, t.samples_per_s))
        self.last = reading
        self.error = self.error_at = None

    def failed(self, reason: str, at: float) -> None:
        """A read that failed: the page says so, and keeps showing the last good one."""
        self.error, self.error_at = reason, at

    def _add(self, round_number: int, peer: str, figures: PeerRound) -> None:
        self.rounds.setdefault(round_number, {})[peer] = figures
        while len(self.rounds) > self.max_rounds:
            del self.rounds[min(self.rounds)]

    def series(self) -> list[dict[str, Any]]:
        """Per round, oldest first: records seen, mean loss, summed throughput, the bytes sent
        and received in the round (the module docstring; None when unknown), and how many
        distinct state hashes its peers published (1: they agree)."""
        out = []
        # peer -> (rounds contributed, bytes sent, bytes received) of its latest record so far
        totals: dict[str, tuple[int, int, int]] = {}
        for r in sorted(self.rounds):
            peers = self.rounds[r]
            losses = [p.loss for p in peers.values() if p.loss is not None]
            steps = [_step(totals, peer, p) for peer, p in peers.items()]
            known = [step for step in steps if step is not None]
            out.append(
                {
                    "round": r,
                    "peers": len(peers),
                    "loss": round(sum(losses) / len(losses), 4) if losses else None,
                    "throughput": round(sum(p.throughput for p in peers.values()), 1),
                    "bytes_sent": sum(sent for sent, _ in known) if known else None,
                    "bytes_received": sum(got for _, got in known) if known else None,
                    "states": len({p.state_hash for p in peers.values() if p.state_hash}),
                }
            )
        return out

    def to_json(self, now: float) -> dict[str, Any]:
        """The document ``/api/run.json`` serves (README, "Dashboard", lists its fields)."""
        info = self.info
        reading = self.last or Reading(at=0.0)
        pipeline = info.pipeline_stages > 0
        cheaters = set(_banned_ids(reading.verdicts))
        # The run's state and round as a joiner adopts it (``plan.candidates``), never a
        # claim nobody adopts (a forged record far ahead): those are listed as unagreed.
        accepted = [] if pipeline else candidates(reading.progress, info.rounds, info.state_quorum)
        agreed = accepted[0] if accepted else None
        if pipeline:
            peers = [_trainer_json(peer, t, now) for peer, t in reading.trainers.items()]
            active = [p["round"] for p in peers if not p["silent"]]
            run_round = max(active, default=None)
        else:
            peers = _peers_json(reading, now, cheaters, accepted)
            run_round = agreed.round if agreed is not None else None
        unagreed = unagreed_claims(reading.progress, accepted)
        return {
            "version": JSON_VERSION,
            "run_id": info.run_id,
            "spec_hash": info.spec_hash,
            "coordinator": info.coordinator,
            "kind": "pipeline" if pipeline else "diloco",
            "rounds": info.rounds,
            "round": run_round,
            "verify_rate": info.verify_rate,
            "now": now,
            "updated_at": self.last.at if self.last is not None else None,
            "error": self.error,
            "agreed": _agreed_json(agreed),
            "unagreed": [{"round": c.round, "peers": c.peers} for c in unagreed],
            "throughput_unit": "samples/s" if pipeline else "tokens/s",
            "peers": peers,
            "series": self.series(),
            "stages": [_stage_json(row) for row in reading.stages],
            "verdicts": [v.to_json() for v in reading.verdicts],
            "banned": sorted(cheaters),
        }


def _step(
    totals: dict[str, tuple[int, int, int]], peer: str, p: PeerRound
) -> tuple[int, int] | None:
    """``(sent, received)`` in this round of ``peer``'s, from its totals and the ones of its
    record before (``totals``, updated); None when that record is not in the history."""
    if p.bytes_sent is None or p.bytes_received is None:
        return None
    before = totals.get(peer)
    totals[peer] = (p.contributed, p.bytes_sent, p.bytes_received)
    if before is None:
        # Only a first contribution has nothing before it (its totals are the round's).
        return (p.bytes_sent, p.bytes_received) if p.contributed <= 1 else None
    contributed, sent, received = before
    if p.contributed - contributed not in (0, 1) or p.bytes_sent < sent:
        return None  # rounds missed between the two reads, or a restarted peer
    return p.bytes_sent - sent, p.bytes_received - received


def _banned_ids(verdicts: Iterable[Verdict]) -> list[str]:
    return [str(PeerID(peer)) for peer in banned(verdicts)]


def _agreed_json(agreed: AgreedState | None) -> dict[str, Any] | None:
    if agreed is None:
        return None
    return {
        "round": agreed.round,
        "state_hash": agreed.state_hash.hex(),
        "holders": len(agreed.holders),
    }


def _peers_json(
    reading: Reading, now: float, cheaters: set[str], accepted: list[AgreedState]
) -> list[dict[str, Any]]:
    """A row per DiLoCo peer; ``agrees``: its state hash is the agreed one of its round, the
    best of ``accepted`` (``plan.candidates``, best first) there (None when its round has none:
    it failed, or nobody vouches for the round, as for a forged one)."""
    agreed_at: dict[int, AgreedState] = {}
    for state in accepted:
        agreed_at.setdefault(state.round, state)
    rows = []
    for p in reading.progress:
        agreed = agreed_at.get(p.round)
        last_seen_s = max(0.0, now - p.published_at)
        rows.append(
            {
                "peer_id": p.peer_id,
                "round": p.round,
                "ok": p.ok,
                "loss": round(p.loss, 4),
                "throughput": round(p.tokens_per_s, 1),
                "peers": p.peers,
                "bytes_sent": p.bytes_sent,
                "bytes_received": p.bytes_received,
                "reach": SHOWN_REACH[p.reach],
                "link": reading.links.get(p.peer_id),
                "last_seen_s": round(last_seen_s, 1),
                "silent": last_seen_s >= SILENT_AFTER_S,
                "state_hash": p.state_hash.hex(),
                "agrees": None if agreed is None else p.state_hash == agreed.state_hash,
                "banned": p.peer_id in cheaters,
            }
        )
    return rows


def _trainer_json(peer: str, t: TrainerProgress, now: float) -> dict[str, Any]:
    last_seen_s = max(0.0, now - t.published_at)
    return {
        "peer_id": peer,
        "round": t.round,
        "loss": None if t.loss is None else round(t.loss, 4),
        "throughput": round(t.samples_per_s, 2),
        "microbatches": t.microbatches,
        "failovers": t.failovers,
        "last_seen_s": round(last_seen_s, 1),
        "silent": last_seen_s >= SILENT_AFTER_S,
    }


def _stage_json(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, "capacity": round(float(row["capacity"]), 2)}
