"""The hierarchical all-reduce in the simulator: matchmaking forms one group of every declarer
(``MatchmakingConfig.one_group``), laid out by ``grid_plan`` in rows of at most
``max_group_size``, each member running the real ``GridAllReduce`` machine.

The driver does what ``allreduce.SimGroup`` does for a butterfly (joining, waiting for members
that have not joined, feeding ``DeadlineReached``), with what a grid changes:

* A peer watches only the peers it talks to: a member that leaves is lost to its row mates and to
  every peer that exchanged an item with it (``contacts``), after the same delays as there. Others
  learn of it by sending to it: an item to a member that left, or that has not joined
  ``join_wait_s`` after the sender did, makes it lost to the sender one detection delay later;
  past that wait, an item to a member that never joined is refused at the hello (one round trip,
  no payload, no connection counted).
* A member's session ends (``SessionDriver``) at its deadline, or once every member of its row
  and of the rows above and below it is settled (finished, failed, left, never joined): those
  are the only peers it may still serve. Later departures then reach no finished grid.
* Sizes are those of the simulated vector: a raw slice or reduced part at ``bytes_per_param``, a
  partial sum at 8 bytes a value (float64, never compressed), plus each item's header and 38
  bytes per exclusion or relay target it names.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from swarm.averaging.allreduce import DeadlineReached, DropPeer, Fail, Finish, PeerLost
from swarm.averaging.grid import GridPlan, grid_plan
from swarm.averaging.hierarchical import (
    Accumulated,
    Gathered,
    GridAllReduce,
    GridState,
    ItemReceived,
    RawPart,
    Reduced,
    SendItem,
)
from swarm.averaging.matchmaking import Group, MatchmakingConfig
from swarm.sim.allreduce import (
    ITEM_HEADER_BYTES,
    GroupTimeouts,
    Outcome,
    SessionDriver,
    VectorModel,
    limit_s,
)
from swarm.sim.butterfly import ButterflyConfig, ButterflyRounds
from swarm.sim.clock import Clock
from swarm.sim.network import Network

EXCLUSION_BYTES = 38


class SimGrid(SessionDriver):
    """The hierarchical all-reduce of one ``Group`` (module docstring); the same surface as
    ``SimGroup`` for ``ButterflyRounds``."""

    def __init__(
        self,
        clock: Clock,
        network: Network,
        group: Group,
        vector: VectorModel,
        timeouts: GroupTimeouts,
        row_size: int,
        *,
        outcome: Outcome,
    ) -> None:
        self.clock, self.network, self.group, self.timeouts = clock, network, group, timeouts
        self.members = group.peer_ids
        self.weights = [m.weight for m in group.members]
        self.row_size = row_size
        self.plan: GridPlan | None = None  # laid out over the machines' vectors at the first join
        # The same layout over the simulated vector: item sizes.
        self.sized = grid_plan(self.members, self.weights, vector.params, row_size)
        self.bytes_per_param = vector.bytes_per_param
        self.machines: dict[bytes, GridAllReduce] = {}
        self.joined_at: dict[bytes, float] = {}
        self.finished_at: dict[bytes, float] = {}
        self.waiting: dict[bytes, list[object]] = {}
        self.left: dict[bytes, bool] = {}
        self.contacts: dict[bytes, set[bytes]] = {m: set() for m in self.members}
        self.sent_bytes: dict[bytes, float] = dict.fromkeys(self.members, 0.0)
        self._suspected: set[tuple[bytes, bytes]] = set()
        self.dropped: dict[bytes, dict[bytes, str]] = {}
        self._paced: dict[bytes, deque[SendItem]] = {}
        self._outcome = outcome
        plan = self.sized
        self._start_sessions([[plan.peers[i] for i in plan.row(k)] for k in range(plan.rows)])

    def _near(self, cohort: int) -> range:
        """A grid member serves its row and the rows above and below it (its columns' chain
        neighbours): no one else ever sends it a ``Takeover`` or waits for its items."""
        return range(max(0, cohort - 1), min(len(self._cohorts), cohort + 2))

    def join(self, peer: bytes, local: np.ndarray, weight: float) -> None:
        now = self.clock.now
        if self.plan is None:
            self.plan = grid_plan(self.members, self.weights, len(local), self.row_size)
        machine = GridAllReduce(peer, self.plan, local, now + self.timeouts.allreduce_s)
        self.machines[peer] = machine
        self.joined_at[peer] = now
        self._apply(peer, machine.start(now))
        for event in self.waiting.pop(peer, []):
            self._feed(peer, event)
        for member, froze in self.left.items():
            if member != peer and self._watches(peer, member):
                self.clock.after(
                    self._detect(member, peer, froze), self._feed, peer, PeerLost(member)
                )
        self.clock.at(machine.deadline, self._feed, peer, DeadlineReached())
        self.clock.after(self.timeouts.join_wait_s, self._missing_row_mates, peer)

    # -- the machines ------------------------------------------------------------------------

    def _watches(self, observer: bytes, peer: bytes) -> bool:
        machine = self.machines[observer]
        same_row = machine.row_index[peer] == machine.my_row
        return same_row or peer in self.contacts[observer]

    def _missing_row_mates(self, peer: bytes) -> None:
        self._missing_settled()
        machine = self.machines[peer]
        for i in machine.plan.row(machine.my_row):
            member = machine.plan.peers[i]
            if member not in self.joined_at:
                self._feed(peer, PeerLost(member))

    def _failed(self, machine: GridAllReduce) -> bool:
        return machine.state is GridState.FAILED

    def _suspect(self, sender: bytes, peer: bytes, at: float) -> None:
        """``peer`` may not answer ``sender``: lost to it at ``at`` unless it joined by then."""
        if (sender, peer) not in self._suspected:
            self._suspected.add((sender, peer))
            self.clock.at(max(at, self.clock.now), self._unanswered, sender, peer)

    def _unanswered(self, sender: bytes, peer: bytes) -> None:
        if peer in self.left or peer not in self.joined_at:
            self._feed(sender, PeerLost(peer))
        else:
            self._suspected.discard((sender, peer))

    def _apply(self, peer: bytes, actions: list[object]) -> None:
        for action in actions:
            if isinstance(action, SendItem):
                # In the machine's order; a chain's sub-part alone in its instant, so that
                # sub-parts follow each other down one stream and the chain pipelines (items
                # sent in one instant all land at its end), and other items together.
                queue = self._paced.setdefault(peer, deque())
                queue.append(action)
                if len(queue) == 1:
                    self.clock.at(self.clock.now, self._pump, peer)
            elif isinstance(action, DropPeer):
                self.dropped.setdefault(peer, {})[action.peer] = action.reason
            elif isinstance(action, Finish | Fail):
                if isinstance(action, Finish):
                    self.finished_at[peer] = self.clock.now
                else:  # its session closes: the peers it talks to see it gone
                    self._closed(peer)
                self._settle(peer)
                self._outcome(peer, action)

    def _pump(self, peer: bytes) -> None:
        queue = self._paced[peer]
        if peer in self.closed:  # its session ended: what it had not sent yet is not sent
            queue.clear()
            return
        first = queue.popleft()
        self._send(peer, first)
        if not isinstance(first.item, Accumulated | Reduced):
            while queue and not isinstance(queue[0].item, Accumulated | Reduced):
                self._send(peer, queue.popleft())
        if queue:
            self.clock.at(self.clock.now, self._pump, peer)

    def _send(self, peer: bytes, action: SendItem) -> None:
        dst, item = action.peer, action.item
        now = self.clock.now
        if dst not in self.joined_at and now >= self.joined_at[peer] + self.timeouts.join_wait_s:
            # past the join wait it is in another group (or gone): its handler refuses our hello
            latency = self.network.latency(peer, dst) + self.network.latency(dst, peer)
            self._suspect(peer, dst, now + latency)
            return
        self.contacts[peer].add(dst)
        self.contacts[dst].add(peer)
        if dst in self.left:
            self._suspect(peer, dst, self.clock.now + self._detect(dst, peer, self.left[dst]))
        elif dst not in self.joined_at:
            self._suspect(peer, dst, self.joined_at[peer] + self.timeouts.join_wait_s)
        size = self._size(item)
        self.sent_bytes[peer] += size
        self.network.send(peer, dst, size, self._feed, dst, ItemReceived(peer, item))

    def _closed(self, peer: bytes) -> None:
        for observer in self.machines:
            if observer != peer and self._watches(observer, peer):
                latency = self.network.latency(peer, observer)
                self.clock.after(latency, self._feed, observer, PeerLost(peer))

    def _size(self, item: object) -> float:
        plan, bpp = self.sized, self.bytes_per_param
        header = ITEM_HEADER_BYTES + EXCLUSION_BYTES * (
            len(getattr(item, "excluded", ())) + len(getattr(item, "forward", ()))
        )
        if isinstance(item, RawPart | Gathered):
            start, stop = plan.part(item.column)
            return header + (stop - start) * bpp
        if isinstance(item, Accumulated | Reduced):
            start, stop = plan.sub(item.column, item.sub)
            per = 8.0 if isinstance(item, Accumulated) else bpp
            return header + (stop - start) * per
        return header

    # -- figures -----------------------------------------------------------------------------

    def limit_s(self, vector: VectorModel) -> float:
        return limit_s(self.network, self.members, vector)

    def allreduce_s(self) -> float:
        if not self.finished_at:
            return math.nan
        return max(self.finished_at.values()) - max(self.joined_at.values())

    def sent_over_vector(self, vector: VectorModel) -> float:
        """The most bytes one member sent, over the simulated vector's size."""
        return max(self.sent_bytes.values()) / vector.nbytes


class HierarchicalRounds(ButterflyRounds):
    """Matchmaking into one group, then the hierarchical all-reduce (module docstring)."""

    def __init__(self, config: ButterflyConfig, run_seed: bytes = b"sim") -> None:
        super().__init__(config, run_seed)
        self.matchmaking = MatchmakingConfig(
            config.max_group_size,
            run_seed,
            config.confirm_timeout_s,
            one_group=True,
            shards=config.shards,
            schedule=config.schedule,
        )

    def _session(self, group: Group, outcome: Outcome) -> SimGrid:  # type: ignore[override]
        world = self.world
        return SimGrid(
            world.clock,
            world.network,
            group,
            self.config.vector,
            self.timeouts,
            self.config.max_group_size,
            outcome=outcome,
        )

    def sent_over_vector(self, round_number: int) -> float:
        """The most bytes one peer sent in a round's all-reduce, over the vector's size."""
        grids = self.by_round.get(round_number, [])
        return max((g.sent_over_vector(self.config.vector) for g in grids), default=math.nan)  # type: ignore[attr-defined]
