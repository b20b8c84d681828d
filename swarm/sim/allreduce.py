"""One group's all-reduce in virtual time: every member's real ``AllReduce`` machine, and the
messages between them on the simulated network.

The payloads are real but small (``SimConfig.numel`` float32 values per peer, so a thousand
peers fit in memory and reduce in microseconds); the *time* of each message is that of its part
of a vector of ``VectorModel.params`` values at ``bytes_per_param`` each. The two partitions are
the same ``partition`` of the same members, bandwidth weights and chunk count (``chunks_for``
of the simulated size and the slowest declared bandwidth, as ``Session`` computes it), so part p
here stands for part p there.

What the driver does, as ``swarm.averaging.session`` does it:

* A member joins when its matchmaking formed this group (the group id names the members):
  its machine starts with the round's deadline ``allreduce_timeout_s`` away. Messages that reach
  a member before it joined wait, in order, until it joins (the real handler waits for the
  session with that group id).
* A member that has not joined ``min(matchmaking_timeout_s + 5, 2 peer_timeout_s + 1)`` seconds
  after we did is lost to us: its handler refused our hello (it formed another group), or it
  opened no stream to us in time (``liveness`` rule 2).
* A member that leaves is lost to each other member after whatever it sent them got through: one
  pair latency later if it crashed (its sockets reset), ``peer_timeout_s`` later if it froze (an
  unanswered ping).
* ``DeadlineReached`` is fed at each machine's deadline. A finished member keeps serving (its
  machine answers losses and forwards) until its session ends, as ``session.Session._drive``
  ends it: at the deadline, or once every member it may still have to serve is settled
  (finished, failed, left, or never joined within the join wait: the real session's ``Done``
  from every live peer). A butterfly member serves the whole group; ``SimGrid`` narrows it to
  the rows a grid member talks to. After that its machine gets no event: a member that leaves
  in a later round makes no finished round's machines take over and send again (they did, and
  at 1,000 peers rounds 5-9 failed at the deadline: every departure made the departed peer's
  row mates in each of the earlier rounds' grids gather its columns again, on the uplinks the
  current round needed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarm.averaging.allreduce import (
    AllReduce,
    AllReduceState,
    DeadlineReached,
    DropPeer,
    Fail,
    Finish,
    PartReceived,
    PeerLost,
    ReducedPartReceived,
    SendPart,
    SendReduced,
    partition,
)
from swarm.averaging.bandwidth import share_weights
from swarm.averaging.matchmaking import Group
from swarm.averaging.session_wire import chunks_for
from swarm.sim.clock import Clock
from swarm.sim.network import Network

# An item's header on the wire (``session_wire.Item`` without its payload), and what each
# contributor adds to a reduced part's.
ITEM_HEADER_BYTES = 64
CONTRIBUTOR_BYTES = 48


@dataclass(frozen=True)
class VectorModel:
    """The vector a round averages, for time: ``params`` values of ``bytes_per_param`` bytes on
    the wire (the machines' own vectors are the simulation's small ``numel``). ``chunks``: parts
    per member, or None for ``chunks_for`` (the session's rule)."""

    params: int = 100_000_000
    bytes_per_param: float = 4.0
    chunks: int | None = None

    def __post_init__(self) -> None:
        if self.params < 1:
            raise ValueError("vector.params must be >= 1")
        if not self.bytes_per_param > 0:
            raise ValueError("vector.bytes_per_param must be > 0")
        if self.chunks is not None and self.chunks < 1:
            raise ValueError("vector.chunks must be >= 1 (or None)")

    @property
    def nbytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class GroupTimeouts:
    allreduce_s: float
    matchmaking_s: float
    peer_s: float

    @property
    def join_wait_s(self) -> float:
        """How long after joining we wait for a member to join before it is lost to us."""
        return min(self.matchmaking_s + 5.0, 2 * self.peer_s + 1.0)


Outcome = Callable[[bytes, Finish | Fail], None]


def limit_s(network: Network, members: Sequence[bytes], vector: VectorModel) -> float:
    """What a perfect ring or butterfly needs for this vector among ``members``: ``2 (n - 1) / n``
    of it over the slowest member's slower direction, plus the two phases' latency (the worst
    pair)."""
    n = len(members)
    links = [network.links[m] for m in members]
    slowest = min(link.rate_bps for link in links)
    legs = sorted(link.leg_s for link in links)
    worst_latency = legs[-1] + (legs[-2] if n > 1 else 0.0)
    return 2 * (n - 1) / n * 8 * vector.nbytes / slowest + 2 * worst_latency


class SessionDriver:
    """What every simulated round protocol's driver does the same way: telling each joined
    machine, when it notices, that a member left (``leave``), and feeding a machine its events
    (held until it joins; none once it failed or its peer is gone). A driver sets ``clock``,
    ``network``, ``timeouts``, ``machines``, ``joined_at``, ``waiting`` and ``left``, and says
    how its machines act (``_apply``), when one has failed (``_failed``) and whom an observer
    watches (``_watches``)."""

    clock: Clock
    network: Network
    timeouts: GroupTimeouts
    machines: dict[bytes, Any]
    joined_at: dict[bytes, float]
    waiting: dict[bytes, list[object]]  # events for members not joined yet
    left: dict[bytes, bool]  # member -> froze (else crashed)

    finished_at: dict[bytes, float]
    # Members whose session ended (``_settle``): their machines get no more events.
    closed: set[bytes]
    _settled: set[bytes]
    _cohort: dict[bytes, int]  # member -> its cohort (``_start_sessions``)
    _cohorts: list[list[bytes]]
    _unsettled: list[int]  # cohort -> members not yet settled
    _missing_checked: bool

    def _start_sessions(self, cohorts: Sequence[Sequence[bytes]]) -> None:
        """Partition the members into cohorts (a grid's rows; one for a butterfly): a member
        may have to serve every member of its cohort and of the cohorts ``_near`` it."""
        self.closed, self._settled = set(), set()
        self._missing_checked = False
        self._cohorts = [list(c) for c in cohorts]
        self._cohort = {m: i for i, c in enumerate(self._cohorts) for m in c}
        self._unsettled = [len(c) for c in self._cohorts]

    def _near(self, cohort: int) -> range:
        """The cohorts a member of ``cohort`` may serve (itself included)."""
        return range(len(self._cohorts))

    def _settle(self, peer: bytes) -> None:
        """``peer`` needs nothing more from the group (it finished, failed, left, or never
        joined in time); close the sessions of finished members who now serve no one."""
        if peer in self._settled:
            return
        self._settled.add(peer)
        k = self._cohort[peer]
        self._unsettled[k] -= 1
        if self._unsettled[k]:
            return
        for near in self._near(k):
            if all(self._unsettled[j] == 0 for j in self._near(near)):
                for member in self._cohorts[near]:
                    if member in self.finished_at:
                        self.closed.add(member)

    def _missing_settled(self) -> None:
        """The join wait passed: a member that has not joined is lost to those that did (they
        serve it nothing), so it no longer keeps their sessions open."""
        if self._missing_checked:
            return  # the first joiner's wait ended first: those joining later were counted
        self._missing_checked = True
        for member in list(self._cohort):
            if member not in self.joined_at:
                self._settle(member)

    def leave(self, peer: bytes, froze: bool) -> None:
        """``peer`` (a member) just left; tell each member watching it when it notices."""
        self.left[peer] = froze
        self._settle(peer)
        for observer in self.machines:
            if observer != peer and self._watches(observer, peer):
                at = max(
                    self.clock.now + self._detect(peer, observer, froze),
                    self.network.last_arrival(peer, observer),
                )
                self.clock.at(at, self._feed, observer, PeerLost(peer))

    def _watches(self, observer: bytes, peer: bytes) -> bool:
        return True

    def _detect(self, lost: bytes, observer: bytes, froze: bool) -> float:
        return self.timeouts.peer_s if froze else self.network.latency(lost, observer)

    def _feed(self, peer: bytes, event: object) -> None:
        machine = self.machines.get(peer)
        if machine is None:
            self.waiting.setdefault(peer, []).append(event)
            return
        if peer in self.closed or self._failed(machine) or not self.network.present(peer):
            return
        self._apply(peer, machine.handle(event, self.clock.now))
        if isinstance(event, DeadlineReached):  # the session ends with its deadline
            self.closed.add(peer)
            self._settle(peer)

    def _failed(self, machine: Any) -> bool:
        raise NotImplementedError

    def _apply(self, peer: bytes, actions: list[object]) -> None:
        raise NotImplementedError


class SimGroup(SessionDriver):
    """The all-reduce of one ``Group``; ``outcome(peer, Finish | Fail)`` once per member that
    joined (unless it left first). ``contacts[peer]``: the members it exchanged messages with."""

    def __init__(
        self,
        clock: Clock,
        network: Network,
        group: Group,
        vector: VectorModel,
        timeouts: GroupTimeouts,
        *,
        outcome: Outcome,
    ) -> None:
        self.clock, self.network, self.group = clock, network, group
        self.timeouts = timeouts
        self.members = group.peer_ids
        self.bandwidths = share_weights([m.bandwidth_bps for m in group.members])
        slowest = min(m.bandwidth_bps for m in group.members)
        self.chunks = vector.chunks or chunks_for(vector.params, len(self.members), slowest)
        self.part_bytes = [
            (stop - start) * vector.bytes_per_param
            for _, start, stop in partition(
                vector.params, self.members, self.bandwidths, self.chunks
            )
        ]
        self.machines: dict[bytes, AllReduce] = {}
        self.joined_at: dict[bytes, float] = {}
        self.finished_at: dict[bytes, float] = {}
        self.waiting: dict[bytes, list[object]] = {}  # events for members not joined yet
        self.left: dict[bytes, bool] = {}  # member -> froze (else crashed)
        self.dropped: dict[bytes, dict[bytes, str]] = {}
        self.contacts: dict[bytes, set[bytes]] = {m: set() for m in self.members}
        self.sent_bytes: dict[bytes, float] = dict.fromkeys(self.members, 0.0)
        self._outcome = outcome
        self._start_sessions([self.members])

    def join(self, peer: bytes, local: np.ndarray, weight: float) -> None:
        now = self.clock.now
        machine = AllReduce(
            peer,
            self.members,
            self.bandwidths,
            local,
            weight,
            deadline=now + self.timeouts.allreduce_s,
            chunks=self.chunks,
        )
        self.machines[peer] = machine
        self.joined_at[peer] = now
        self.dropped[peer] = {}
        self._apply(peer, machine.start(now))
        for event in self.waiting.pop(peer, []):
            self._feed(peer, event)
        for member, froze in self.left.items():
            if member != peer:
                detect = self._detect(member, peer, froze)
                self.clock.after(detect, self._feed, peer, PeerLost(member))
        self.clock.at(machine.deadline, self._feed, peer, DeadlineReached())
        self.clock.after(self.timeouts.join_wait_s, self._missing_members, peer)

    # -- the machines ------------------------------------------------------------------------

    def _missing_members(self, peer: bytes) -> None:
        self._missing_settled()
        for member in self.members:
            if member not in self.joined_at:
                self._feed(peer, PeerLost(member))

    def _failed(self, machine: AllReduce) -> bool:
        return machine.state is AllReduceState.FAILED

    def _apply(self, peer: bytes, actions: list[object]) -> None:
        network = self.network
        for action in actions:
            if isinstance(action, SendPart):
                machine = self.machines[peer]
                size = self.part_bytes[action.part_index] + ITEM_HEADER_BYTES
                data = machine.local[action.start : action.stop]
                event = PartReceived(peer, action.part_index, data, machine.weight)
                self.contacts[peer].add(action.peer)
                self.contacts[action.peer].add(peer)
                self.sent_bytes[peer] += size
                network.send(peer, action.peer, size, self._feed, action.peer, event)
            elif isinstance(action, SendReduced):
                size = (
                    self.part_bytes[action.part_index]
                    + ITEM_HEADER_BYTES
                    + CONTRIBUTOR_BYTES * len(action.contributors)
                )
                reduced = ReducedPartReceived(
                    peer, action.part_index, action.data, action.contributors
                )
                self.contacts[peer].add(action.peer)
                self.contacts[action.peer].add(peer)
                self.sent_bytes[peer] += size
                network.send(peer, action.peer, size, self._feed, action.peer, reduced)
            elif isinstance(action, DropPeer):
                self.dropped[peer][action.peer] = action.reason
            elif isinstance(action, Finish | Fail):
                if isinstance(action, Finish):
                    self.finished_at[peer] = self.clock.now
                self._settle(peer)
                self._outcome(peer, action)

    # -- figures -----------------------------------------------------------------------------

    def limit_s(self, vector: VectorModel) -> float:
        return limit_s(self.network, self.members, vector)

    def allreduce_s(self) -> float:
        """From the moment the last member joined to the last finish (nan: nobody finished)."""
        if not self.finished_at:
            return math.nan
        return max(self.finished_at.values()) - max(self.joined_at.values())
