"""Today's round protocol in the simulator: matchmaking by declarations in the DHT (the real
``Matchmaker``), then one butterfly all-reduce per group (the real ``AllReduce``), as
``swarm.averaging.averager.Averager`` runs them.

Per peer, as the Averager does: the expected peers of round r are round r-1's survivors (its
contributors that were not lost or dropped, and itself) plus the declarations already stored when
r opens (one read of the key); none after a failed round or before the first. It declares its
weight and the bandwidth its ``BandwidthEstimate`` gives (the default 1 Gbit/s until it has
measured a round, then its uplink, moved only when off by 2x). A group of fewer than two fails
the round; otherwise the peer joins its group's all-reduce (``allreduce.SimGroup``, one per
group id: peers that computed different groups meet no one from the other view).

With ``ButterflyConfig.schedule`` (``bench.sim --matchmaking scheduled``, the default for the
hierarchical protocol) a round has no expected set: each peer declares at once, with the hint of
how many of its last round's survivors fall in the round's clock shard, over
``ButterflyConfig.shards`` keys, and the real ``Matchmaker`` decides at the schedule's close.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.averaging.allreduce import Fail as AllReduceFail
from swarm.averaging.allreduce import Finish as AllReduceFinish
from swarm.averaging.bandwidth import BandwidthEstimate
from swarm.averaging.matchmaking import (
    Declaration,
    Fail,
    Finish,
    Group,
    MatchmakingConfig,
    RoundSchedule,
    clock_shard,
    round_key,
    shard_of,
)
from swarm.sim.allreduce import GroupTimeouts, Outcome, SimGroup, VectorModel
from swarm.sim.matchmaking import SimMatchmaking
from swarm.sim.protocol import RoundProtocol
from swarm.sim.report import GroupFigures


@dataclass(frozen=True)
class ButterflyConfig:
    """The Averager's settings the simulation uses (run.toml's defaults where it has one)."""

    max_group_size: int = 64
    matchmaking_timeout_s: float = 4.0
    allreduce_timeout_s: float = 30.0
    peer_timeout_s: float = 10.0
    confirm_timeout_s: float = MatchmakingConfig(1, b"x").confirm_timeout_s
    vector: VectorModel = field(default_factory=VectorModel)
    # Sharded declarations and scheduled rounds (``MatchmakingConfig.shards`` and ``.schedule``).
    shards: int = 1
    schedule: RoundSchedule | None = None

    def __post_init__(self) -> None:
        if self.max_group_size < 1:
            raise ValueError(f"max_group_size must be >= 1, got {self.max_group_size}")
        for name in ("matchmaking_timeout_s", "allreduce_timeout_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class ButterflyRounds(RoundProtocol):
    """Matchmaking + a butterfly all-reduce per group (module docstring)."""

    def __init__(self, config: ButterflyConfig, run_seed: bytes = b"sim") -> None:
        self.config = config
        self.matchmaking = MatchmakingConfig(
            config.max_group_size,
            run_seed,
            config.confirm_timeout_s,
            shards=config.shards,
            schedule=config.schedule,
        )
        self.timeouts = GroupTimeouts(
            config.allreduce_timeout_s, config.matchmaking_timeout_s, config.peer_timeout_s
        )
        self.survivors: dict[bytes, frozenset[bytes] | None] = {}
        self.estimates: dict[bytes, BandwidthEstimate] = {}
        self.declarations: dict[tuple[bytes, int], Declaration] = {}
        self.sessions: dict[bytes, SimGroup] = {}
        self.by_round: dict[int, list[SimGroup]] = {}
        self.current: dict[bytes, list[SimGroup]] = {}  # peer -> sessions it joined
        # A scheduled round's hint source, as the Averager keeps it: the last survivors, or the
        # last group's members when its all-reduce failed.
        self.last_members: dict[bytes, frozenset[bytes]] = {}

    def declaration(self, peer: bytes, round_number: int) -> Declaration | None:
        return self.declarations.get((peer, round_number))

    def start(self, peer: bytes, round_number: int) -> None:
        world = self.world
        survivors = self.survivors.get(peer)
        if self.config.schedule is not None:
            # A scheduled round expects no one: its members are whoever declared before the
            # close, so there is no expected set to read when the round opens. Its hint: how
            # many of our last round's survivors declare in this round's clock shard.
            shards = self.config.shards
            timer = clock_shard(round_number, shards)
            hint = sum(shard_of(p, shards) == timer for p in self.last_members.get(peer, ()))
            self._declare(peer, round_number, frozenset(), hint=hint)
            return
        if survivors is None:
            self._declare(peer, round_number, frozenset())
            return
        key = round_key(world.run_id, round_number)

        def opened(found: tuple[Declaration, ...]) -> None:
            if world.present(peer):
                expected = survivors | {d.peer_id for d in found} | {peer}
                self._declare(peer, round_number, expected)

        world.dht.read(peer, key, opened)

    def _declare(
        self, peer: bytes, round_number: int, expected: frozenset[bytes], *, hint: int = -1
    ) -> None:
        world = self.world
        estimate = self.estimates.setdefault(peer, BandwidthEstimate())
        weight = world.contribution(peer, round_number)[1]
        declaration = Declaration(
            peer,
            round_number,
            weight,
            estimate.declared,
            world.clock.now,
            len(expected) if hint < 0 else hint,
        )
        self.declarations[(peer, round_number)] = declaration
        record = world.record(peer, round_number)
        SimMatchmaking(
            world.clock,
            world.network,
            world.dht,
            world.directory,
            world.run_id,
            declaration,
            expected=expected,
            timeout_s=self.config.matchmaking_timeout_s,
            config=self.matchmaking,
            alive=lambda: world.present(peer),
            done=lambda action: self._matched(peer, round_number, action),
            asked=record.partners.add,
        ).start()

    def _matched(self, peer: bytes, round_number: int, action: Finish | Fail) -> None:
        world = self.world
        record = world.record(peer, round_number)
        record.matched_at = world.clock.now
        if isinstance(action, Fail):
            self._failed(peer, round_number, f"matchmaking: {action.reason}")
            return
        group = action.group
        record.group_id = group.group_id
        self.last_members[peer] = frozenset(group.peer_ids)
        if len(group.members) < 2:
            self._failed(peer, round_number, "no other peer declared in time")
            return
        session = self.sessions.get(group.group_id)
        if session is None:
            r = group.round
            session = self._session(group, lambda member, result: self._averaged(r, member, result))
            self.sessions[group.group_id] = session
            self.by_round.setdefault(r, []).append(session)
        self.current.setdefault(peer, []).append(session)
        session.join(peer, *world.contribution(peer, round_number))

    def _session(self, group: Group, outcome: Outcome) -> SimGroup:
        """The all-reduce of one group (a subclass runs another kind)."""
        world = self.world
        return SimGroup(
            world.clock, world.network, group, self.config.vector, self.timeouts, outcome=outcome
        )

    def _averaged(
        self, round_number: int, peer: bytes, result: AllReduceFinish | AllReduceFail
    ) -> None:
        world = self.world
        record = world.record(peer, round_number)
        if isinstance(result, AllReduceFail):
            self._failed(peer, round_number, f"all-reduce: {result.reason}")
            return
        session = self.sessions[record.group_id]  # type: ignore[index]
        record.result = result.result
        record.contributors = result.contributors
        alive = session.machines[peer].alive
        self.survivors[peer] = frozenset(p for p, _ in result.contributors if p in alive) | {peer}
        self.last_members[peer] = self.survivors[peer]
        self.estimates[peer].observe(world.network.links[peer].up_bps)
        record.ended_at = world.clock.now
        world.end_round(peer, round_number)

    def _failed(self, peer: bytes, round_number: int, reason: str) -> None:
        record = self.world.record(peer, round_number)
        record.failure = reason
        record.ended_at = self.world.clock.now
        self.survivors[peer] = None
        self.world.end_round(peer, round_number)

    def left(self, peer: bytes, froze: bool) -> None:
        for session in self.current.get(peer, []):
            session.leave(peer, froze)
        # Sessions it never joined learn of it through their join wait; ones it joins later
        # never see it (it is gone).

    def groups(self, round_number: int) -> list[GroupFigures]:
        vector = self.config.vector
        for session in self.by_round.get(round_number, []):
            for peer, partners in session.contacts.items():
                if partners:
                    self.world.record(peer, round_number).partners |= partners
        return [
            GroupFigures(s.group.group_id, len(s.members), s.allreduce_s(), s.limit_s(vector))
            for s in self.by_round.get(round_number, [])
        ]
