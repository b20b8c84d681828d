"""Adaptive rebalancing of pipeline stages: which server moves where, decided without a leader.

Theory of operation
-------------------
A pipeline trains as fast as its slowest stage. Each stage's capacity is the sum of the effective
throughputs its servers announce (``ServerAnnouncement.effective_throughput``: relayed servers
count ``relay_factor`` as much, Petals #428). Every ``rebalance`` epoch each server reads the same
announcements and evaluates ``plan_move``, a pure function of (announcements, epoch, config):

1. The *bottleneck* is the stage of lowest capacity (ties: lowest index). A stage with no server
   has capacity 0 and is always the bottleneck.
2. The *donor* is the stage of highest capacity among the others that keep at least
   ``min_servers_per_stage`` servers after giving one away (the most over-provisioned).
3. The *mover* is the donor's server that ranks first by ``sha256(epoch, peer id)``: the choice
   depends on who is in the donor stage, not on the exact throughput figures, so two servers
   whose reads differ only in a fresher measurement still name the same mover. The hash changes
   every epoch, so the same server is not always the one that moves.
4. Moving it changes two capacities: the donor loses its effective throughput, the bottleneck
   gains its *estimated* throughput there. Stages differ in cost, so the estimate scales its
   throughput by the ratio of the stages' median throughputs (a server twice as fast as its peers
   at the donor is taken to be twice as fast as the bottleneck's servers; ``stage_ratio``); with
   nobody at the bottleneck to compare, by 1. That estimate, counted at ``relay_factor`` for a
   relayed mover, is the mover's *contribution* at the bottleneck.
5. The move is made only if it raises the minimum stage capacity by more than ``min_gain`` times
   the mover's contribution; otherwise nobody moves this epoch (the next epoch's hash may name a
   mover whose move pays).

Why the threshold is a share of the mover's contribution, not of the stage's capacity: the raise
of the minimum never exceeds the contribution (the bottleneck gains exactly that; the donor, if
it becomes the new minimum, ends lower), so ``min_gain`` in [0, 1) says how much of what the mover
brings must reach the pipeline rather than be lost to the donor. A move that passes is worth a
real share of one server, which a small error in the throughputs or in the ``stage_ratio``
estimate does not wipe out, and whose cost (one download of a stage, while the mover keeps
serving) is one server's too. A threshold relative to the stage's capacity grew with the swarm:
at ~60 servers a stage one server adds 2-4% of it, under a 10% ``min_gain``, so a stage of 40
servers beside three of 70 was never restaffed (``swarm.sim.pipeline``). With servers of equal
throughput the rule moves while the donor exceeds the bottleneck by more than ``1 + min_gain``
servers, so it stops within about one server of balance at any size. The contribution is never
negative, so a move that passes still strictly raises the minimum as read. Near balance, noisy
measurements can trigger a move that a steady reading would not (the stage totals' noise grows
with the square root of their size): such a move lowers the minimum by less than the mover's
throughput, a later reading may move a server back, and the drivers' quiet epochs after every
planned move bound how often that happens.

At most one server moves per epoch, and every server computes the same one from the same records:
servers never stampede into the bottleneck together. Views can differ (a DHT read misses a fresh
record, a stage count differs); then two servers may each believe they are the mover. Drivers make
that rare: they use the records as stored for everyone (themselves included), sit out a few epochs
after any planned move so the mover's new record spreads, and re-read before leaving. Every
executed move strictly raises the minimum capacity as seen at that epoch, so with steady
measurements moves cannot cycle.

This module is sans-IO: no trio, libp2p, sockets, clocks or randomness.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.pipeline.records import DEFAULT_RELAY_FACTOR, ServerAnnouncement

MAX_STAGE_RATIO = 64.0


@dataclass(frozen=True)
class RebalanceConfig:
    num_stages: int
    relay_factor: float = DEFAULT_RELAY_FACTOR
    min_gain: float = 0.1
    min_servers_per_stage: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if not 0 < self.relay_factor <= 1:
            raise ValueError("relay_factor must be in (0, 1]")
        if not 0 <= self.min_gain < 1:
            # a move never raises the minimum by more than the mover's contribution
            raise ValueError("min_gain must be in [0, 1) (a share of the mover's contribution)")
        if self.min_servers_per_stage < 1:
            raise ValueError("min_servers_per_stage must be >= 1")


@dataclass(frozen=True)
class Move:
    """``peer_id`` should leave ``from_stage`` and serve ``to_stage``; the minimum stage capacity
    goes from ``min_before`` to ``min_after`` (estimated)."""

    peer_id: bytes
    from_stage: int
    to_stage: int
    min_before: float
    min_after: float


def stage_capacities(servers: Sequence[ServerAnnouncement], config: RebalanceConfig) -> list[float]:
    """Sum of effective throughput per stage (0 for a stage with no server)."""
    totals = [0.0] * config.num_stages
    for a in _unique(servers, config):
        totals[a.stage] += a.effective_throughput(config.relay_factor)
    return totals


def stage_status(
    servers: Sequence[ServerAnnouncement], config: RebalanceConfig
) -> list[dict[str, float | int]]:
    """Per stage: servers, relayed servers, capacity (effective samples/s) and queued requests;
    what ``swarmtrain status`` shows for a pipeline run."""
    rows: list[dict[str, float | int]] = [
        {"stage": s, "servers": 0, "relayed": 0, "capacity": 0.0, "queue": 0}
        for s in range(config.num_stages)
    ]
    for a in _unique(servers, config):
        row = rows[a.stage]
        row["servers"] += 1
        row["relayed"] += int(a.relayed)
        row["capacity"] += a.effective_throughput(config.relay_factor)
        row["queue"] += a.queue
    return rows


def rank(epoch: int, peer_id: bytes) -> bytes:
    """The order in which servers are considered to move in ``epoch``."""
    return hashlib.sha256(b"swarmtrain/rebalance/1\x00%d\x00" % epoch + peer_id).digest()


def plan_move(
    servers: Sequence[ServerAnnouncement], epoch: int, config: RebalanceConfig
) -> Move | None:
    """The one move of ``epoch``, or None when its move would not raise the minimum capacity by
    more than ``min_gain`` of the mover's contribution at the bottleneck."""
    unique = _unique(servers, config)
    by_stage: list[list[ServerAnnouncement]] = [[] for _ in range(config.num_stages)]
    for a in unique:
        by_stage[a.stage].append(a)
    totals = stage_capacities(unique, config)
    bottleneck = min(range(config.num_stages), key=lambda s: (totals[s], s))
    min_before = totals[bottleneck]
    donors = [
        s
        for s, members in enumerate(by_stage)
        if s != bottleneck and len(members) - 1 >= config.min_servers_per_stage
    ]
    if not donors:
        return None
    donor = max(donors, key=lambda s: (totals[s], -s))
    members = by_stage[donor]
    mover = min(members, key=lambda a: rank(epoch, a.peer_id))
    after = list(totals)
    after[donor] -= mover.effective_throughput(config.relay_factor)
    estimate = mover.throughput * stage_ratio(by_stage[bottleneck], members)
    contribution = estimate * (config.relay_factor if mover.relayed else 1.0)
    after[bottleneck] += contribution
    min_after = min(after)
    # Scale-free (module docstring): a share of one server, not of a stage of any size.
    if min_after - min_before <= config.min_gain * contribution or min_after <= 0:
        return None
    return Move(mover.peer_id, donor, bottleneck, min_before, min_after)


def stage_ratio(
    target: Sequence[ServerAnnouncement], source: Sequence[ServerAnnouncement]
) -> float:
    """How much faster a server of ``source`` is estimated to run at ``target``: the ratio of the
    stages' median throughputs, 1 when either is unknown, clamped to ``MAX_STAGE_RATIO`` either
    way (a median near zero, a stalled stage, would otherwise promise a huge gain)."""
    if not target or not source:
        return 1.0
    source_median = statistics.median(a.throughput for a in source)
    target_median = statistics.median(a.throughput for a in target)
    if source_median <= 0:
        return 1.0
    return min(MAX_STAGE_RATIO, max(1 / MAX_STAGE_RATIO, target_median / source_median))


def _unique(
    servers: Sequence[ServerAnnouncement], config: RebalanceConfig
) -> list[ServerAnnouncement]:
    """One announcement per peer (the first by peer id order wins), stages in range."""
    seen: dict[bytes, ServerAnnouncement] = {}
    for a in sorted(servers, key=lambda a: (a.peer_id, a.stage)):
        if a.stage < config.num_stages:
            seen.setdefault(a.peer_id, a)
    return list(seen.values())
