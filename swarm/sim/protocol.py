"""What the simulator drives each round: a ``RoundProtocol``, and the ``World`` it runs in.

The simulator (``simulation.Simulation``) owns time, peers, churn and records; a protocol owns
what one peer does in one round. ``start(peer, r)`` begins it; the protocol fills the round's
``PeerRound`` (``world.record``) and calls ``world.end_round(peer, r)`` once when the peer's part
is over (it may keep serving others after that, as a real session does). ``left(peer, froze)``
tells it a peer just left. ``groups(r)`` reports the groups it ran, for the figures. Today's
protocol is ``butterfly.ButterflyRounds``; ``hierarchical.HierarchicalRounds`` plugs in the same
way.
"""

from __future__ import annotations

import abc
from typing import Protocol

import numpy as np

from swarm.sim.clock import Clock
from swarm.sim.dht import SimDht
from swarm.sim.matchmaking import Directory
from swarm.sim.network import Network
from swarm.sim.report import GroupFigures, PeerRound


class World(Protocol):
    """The simulator as a protocol sees it."""

    clock: Clock
    network: Network
    dht: SimDht
    directory: Directory
    run_id: str

    def record(self, peer: bytes, round_number: int) -> PeerRound: ...

    def contribution(self, peer: bytes, round_number: int) -> tuple[np.ndarray, float]: ...

    def present(self, peer: bytes) -> bool: ...

    def end_round(self, peer: bytes, round_number: int) -> None: ...


class RoundProtocol(abc.ABC):
    """One way of averaging a round (module docstring)."""

    world: World

    def bind(self, world: World) -> None:
        self.world = world

    @abc.abstractmethod
    def start(self, peer: bytes, round_number: int) -> None:
        """Begin ``peer``'s part in round ``round_number``."""

    @abc.abstractmethod
    def left(self, peer: bytes, froze: bool) -> None:
        """``peer`` just left (froze: stopped answering; else crashed: its sockets reset)."""

    @abc.abstractmethod
    def groups(self, round_number: int) -> list[GroupFigures]:
        """The groups that averaged in round ``round_number`` (some member joined)."""
