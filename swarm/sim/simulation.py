"""The simulator: peers, their rounds and churn on one virtual clock, reproducible from a seed.

``Simulation(config, protocol)`` creates ``config.peers`` peers (links drawn from
``config.network``); ``run()`` starts each one's round 0 within ``start_skew_s``, and after each
peer's round (``protocol`` calls ``end_round``) starts its next one ``compute_s`` later (times a
factor in [0.9, 1.1] drawn per peer: peers train at slightly different speeds), until
``rounds``. It returns one ``RoundFigures`` per round.

Churn (``churn`` > 0): when the first peer starts round r >= 1, the number of departures is drawn
from Poisson(churn x present peers), each departing peer picked uniformly and leaving at a time
uniform over the next ``opened[r] - opened[r-1]`` seconds (the last round's span): a Poisson
process over that span. A departure freezes the peer with probability ``freeze_share`` (it stops
answering; others notice after their peer timeout), else crashes it (its sockets reset; others
notice after one latency). As many joins are drawn the same way from Poisson(churn x ``peers``);
a joiner starts at the next round's opening, with no history (it waits for its matchmaking
deadline, like any peer after a failed round).

``SimConfig.links`` fixes the first ``peers`` peers' links (one each) instead of drawing them
(``bench.sim_vs_real`` puts them on a lab's shaped links); joiners still draw theirs. Without it
the draws are the same as ever.

Randomness: one ``numpy.random.Generator`` per concern (links, churn, timing, loss), each seeded
from ``seed``; a peer's vector and weight for a round come from a generator seeded with
(seed, its index, the round), so they do not depend on the order events ran in. Nothing iterates
a set where order could matter (bytes hash differently in every process).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from swarm.averaging.matchmaking import round_key
from swarm.sim.clock import Clock
from swarm.sim.dht import DhtModel, SimDht
from swarm.sim.matchmaking import Directory
from swarm.sim.network import Network, NetworkConfig, PeerLink, draw_link
from swarm.sim.protocol import RoundProtocol
from swarm.sim.report import PeerRound, RoundFigures, round_figures

_PEER_ID_PREFIX = bytes.fromhex("002408011220")  # an Ed25519 libp2p peer id's 6 header bytes


def sim_peer_id(seed: int, index: int) -> bytes:
    """A peer id shaped like a real one (38 bytes), from the seed and the peer's index."""
    return _PEER_ID_PREFIX + hashlib.sha256(f"swarmtrain/sim/{seed}/{index}".encode()).digest()


@dataclass(frozen=True)
class SimConfig:
    peers: int
    rounds: int
    seed: int = 0
    churn: float = 0.0
    freeze_share: float = 0.5
    compute_s: float = 0.0
    start_skew_s: float = 1.0
    numel: int = 2048
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht: DhtModel = field(default_factory=DhtModel)
    run_id: str = "sim"
    # Fixed links (``bench.sim_vs_real``: the lab's shaped links): the i-th of the first
    # ``peers`` peers gets ``links[i]`` instead of a draw from ``network``; joiners still draw.
    links: tuple[PeerLink, ...] | None = None

    def __post_init__(self) -> None:
        if self.peers < 1 or self.rounds < 1:
            raise ValueError(f"peers and rounds must be >= 1, got {self.peers}, {self.rounds}")
        if not 0.0 <= self.churn <= 1.0:
            raise ValueError(f"churn must be in [0, 1], got {self.churn!r}")
        if not 0.0 <= self.freeze_share <= 1.0:
            raise ValueError(f"freeze_share must be in [0, 1], got {self.freeze_share!r}")
        if not (self.compute_s >= 0 and self.start_skew_s >= 0):
            raise ValueError("compute_s and start_skew_s must be >= 0")
        if self.links is not None:
            if len(self.links) != self.peers:
                raise ValueError(f"links: one per peer ({self.peers}), got {len(self.links)}")
            for link in self.links:
                rates = (link.up_bps, link.down_bps)
                if not all(math.isfinite(r) and r > 0 for r in rates) or not link.leg_s >= 0:
                    raise ValueError(f"links: rates must be > 0 and leg_s >= 0, got {link!r}")


class Simulation:
    """One run (module docstring). ``records[(peer, r)]`` keeps every peer's rounds."""

    def __init__(self, config: SimConfig, protocol: RoundProtocol) -> None:
        self.config = config
        self.run_id = config.run_id
        seed = config.seed
        self.clock = Clock()
        self._link_rng = np.random.default_rng([seed, 0])
        self._churn_rng = np.random.default_rng([seed, 1])
        self._timing_rng = np.random.default_rng([seed, 2])
        self.network = Network(self.clock, config.network, np.random.default_rng([seed, 3]))
        self.dht = SimDht(self.clock, self.network, config.dht)
        self.protocol = protocol
        self.directory = Directory(answers=self.present, declaration=self._declaration)
        self.records: dict[tuple[bytes, int], PeerRound] = {}
        self._newest_round = -1  # the highest round any peer recorded (run's on_round)
        self.index: dict[bytes, int] = {}
        self.speed: dict[bytes, float] = {}
        self.present_peers: dict[bytes, None] = {}  # ordered: sets of bytes iterate randomly
        self.current: dict[bytes, int] = {}
        self.opened: dict[int, float] = {}
        self.waiting: list[bytes] = []
        self.joins = 0
        self.departures = 0
        protocol.bind(self)
        self.peers = [self._add_peer() for _ in range(config.peers)]

    def _declaration(self, peer: bytes, round_number: int) -> object:
        find = getattr(self.protocol, "declaration", None)
        return find(peer, round_number) if find is not None else None

    # -- the World a protocol sees -----------------------------------------------------------

    def record(self, peer: bytes, round_number: int) -> PeerRound:
        key = (peer, round_number)
        record = self.records.get(key)
        if record is None:
            record = self.records[key] = PeerRound(peer, round_number, self.clock.now)
        return record

    def contribution(self, peer: bytes, round_number: int) -> tuple[np.ndarray, float]:
        rng = np.random.default_rng([self.config.seed, 4, self.index[peer], round_number])
        vector = rng.standard_normal(self.config.numel).astype(np.float32)
        return vector, float(rng.integers(1, 5))

    def present(self, peer: bytes) -> bool:
        return peer in self.present_peers

    def end_round(self, peer: bytes, round_number: int) -> None:
        if round_number + 1 < self.config.rounds and self.present(peer):
            delay = self.config.compute_s * self.speed[peer]
            self.clock.after(delay, self._start_round, peer, round_number + 1)

    # -- running -----------------------------------------------------------------------------

    def run(self, on_round: Callable[[int], None] | None = None) -> list[RoundFigures]:
        """Run every round to its end; the figures of each. ``on_round(r)`` is told each time
        a peer first records round ``r`` (a long simulation's progress; it changes nothing)."""
        for peer in self.peers:
            skew = self._timing_rng.uniform(0.0, self.config.start_skew_s)
            self.clock.at(skew, self._start_round, peer, 0)
        if on_round is None:
            self.clock.run()
            return self.figures()
        seen = [-1]

        def tell() -> bool:
            # Records only grow, and a peer records round r + 1 after r: the newest is enough.
            if self._newest_round > seen[0]:
                seen[0] = self._newest_round
                on_round(seen[0])
            return False

        self.clock.run(stop=tell)
        return self.figures()

    def leave_at(self, peer: bytes, t: float, *, froze: bool = False) -> None:
        """Make ``peer`` leave at virtual time ``t`` (a scripted departure, beside churn's)."""
        self.clock.at(t, self._leave, peer, froze)

    def figures(self) -> list[RoundFigures]:
        rounds: dict[int, list[PeerRound]] = {}
        # Bytes a peer read of a round's keys, every shard (``run/<id>/round/<r>[/<shard>]``).
        prefix = round_key(self.run_id, 0)[: -len(b"0")]
        read: dict[tuple[bytes, int], int] = {}
        for (peer, key), size in self.dht.bytes_read.items():
            if key.startswith(prefix):
                r = int(key[len(prefix) :].split(b"/")[0])
                read[(peer, r)] = read.get((peer, r), 0) + size
        for (peer, r), record in self.records.items():
            record.dht_read_bytes = read.get((peer, r), 0)
            rounds.setdefault(r, []).append(record)
        return [
            round_figures(r, rounds.get(r, []), self.protocol.groups(r))
            for r in range(self.config.rounds)
        ]

    def _add_peer(self) -> bytes:
        index = len(self.index)
        peer = sim_peer_id(self.config.seed, index)
        self.index[peer] = index
        self.speed[peer] = self._timing_rng.uniform(0.9, 1.1)
        fixed = self.config.links
        if fixed is not None and index < len(fixed):
            link = fixed[index]
        else:
            link = draw_link(self.config.network, self._link_rng)
        self.network.add(peer, link)
        self.present_peers[peer] = None
        return peer

    def _start_round(self, peer: bytes, round_number: int) -> None:
        if not self.present(peer):
            return
        if round_number not in self.opened:
            self._open(round_number)
        self.current[peer] = round_number
        self.records[(peer, round_number)] = PeerRound(peer, round_number, self.clock.now)
        self._newest_round = max(self._newest_round, round_number)
        self.protocol.start(peer, round_number)

    def _open(self, round_number: int) -> None:
        now = self.clock.now
        self.opened[round_number] = now
        for joiner in self.waiting:
            self.clock.at(now, self._start_round, joiner, round_number)
        self.waiting = []
        previous = self.opened.get(round_number - 1)
        if not self.config.churn or previous is None:
            return
        rng, span = self._churn_rng, now - previous
        present = list(self.present_peers)
        leaving = min(len(present), int(rng.poisson(self.config.churn * len(present))))
        for victim in rng.choice(len(present), size=leaving, replace=False):
            froze = bool(rng.random() < self.config.freeze_share)
            self.clock.at(now + rng.uniform(0.0, span), self._leave, present[victim], froze)
        for _ in range(int(rng.poisson(self.config.churn * self.config.peers))):
            self.clock.at(now + rng.uniform(0.0, span), self._join)

    def _leave(self, peer: bytes, froze: bool) -> None:
        if not self.present(peer):
            return
        del self.present_peers[peer]
        self.departures += 1
        self.network.leave(peer)
        round_number = self.current.get(peer)
        if round_number is not None:
            self.record(peer, round_number).left = True
            for r in range(round_number + 1):  # earlier rounds' groups may still be finishing
                if (peer, r) in self.records:
                    self.records[(peer, r)].departed_at = self.clock.now
        self.protocol.left(peer, froze)

    def _join(self) -> None:
        self.joins += 1
        self.waiting.append(self._add_peer())
