"""Stochastic wiring and failover of microbatches through pipeline stages (SWARM parallelism).

Theory of operation
-------------------
A trainer sends each microbatch forward through one server per stage, then backward through the
same servers in reverse. Nobody fixes the pipeline: for every hop the trainer draws a server of
that stage at random, with probability proportional to its *routing weight*

    weight = throughput x (relay_factor if relayed else 1) / (1 + queue)

so fast, idle, directly reachable servers get more work and a slow one still gets some (its
measurement stays fresh). The randomness is an injected ``Rng`` (``random.Random(seed)`` in a
driver, a fixed sequence in tests).

``Router`` is the trainer's view, shared by all its microbatches: the announced servers (replaced
on every DHT read) and the penalties. A server whose hop fails (dead, timed out, refused) is
*excluded* for ``exclude_s`` (doubled per consecutive failure, up to ``max_exclude_s``); a success
clears its record. ``Router.pick`` never stalls while the stage has any server: it prefers servers
not tried yet for this hop, and among them those not excluded; when all of them are excluded it
retries the one whose exclusion ends first instead of waiting. Only when every server of the stage
was tried for this hop does it go back to one already tried. It returns None only for a stage with
no server at all, which the route turns into a clear error.

``MicrobatchRoute`` is the state machine of one microbatch (h11 style, events in, actions out):

    FORWARD(0) -> ... -> FORWARD(S-1) -> LOSS -> BACKWARD(S-1) -> ... -> BACKWARD(0) -> DONE
         any hop --HopFailed--> same hop on another server of that stage (or FAILED)

* ``Start`` orders ``Forward(0, server)``. ``HopDone`` of a forward records that server as the
  holder of the stage's forward context and orders the next forward, or ``ComputeLoss`` after the
  last stage. ``LossComputed`` orders ``Backward(S-1, holder, send_inputs=False)``.
* A backward goes to the server that ran the forward of that stage (it holds the context). If that
  server fails, the backward is retried on another server of the stage with ``send_inputs=True``:
  the trainer resends the stage's inputs and the new server recomputes the forward.
* ``HopFailed`` penalizes the server (unless ``penalize=False``: the server is fine but lost our
  context) and retries the hop on another server; after ``max_attempts_per_hop`` tries of one hop
  or when the stage has no server the route FAILS with a reason naming the stage.
* ``DeadlineReached`` (the driver's clock passed ``route.deadline``) FAILS the route.
* An event that does not match the pending hop raises ``LocalProtocolError`` (a driver bug) and
  changes nothing; any event after DONE or FAILED raises too.

This module is sans-IO: no trio, libp2p, sockets, clocks or randomness; ``now`` is an argument.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from p2p import LocalProtocolError
from swarm.pipeline.records import DEFAULT_RELAY_FACTOR, ServerAnnouncement

# A server with zero measured throughput still gets a sliver of traffic, so a fresh measurement
# can show it recovered.
MIN_WEIGHT_FRACTION = 1e-3


def penalizes(refusal_code: str | None) -> bool:
    """Whether a failed hop counts against its server (``HopFailed.penalize``); ``refusal_code``
    is the server's refusal (``swarm.pipeline.wire.REFUSAL_CODES``), None for a timeout or a
    broken connection. Only a lost context does not: the server is fine, it evicted our forward
    or never ran it, and the hop is replayed elsewhere with the inputs resent."""
    return refusal_code != "unknown-microbatch"


class Rng(Protocol):
    """What routing needs of a random source: ``random.Random`` has it."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class RoutingConfig:
    num_stages: int
    relay_factor: float = DEFAULT_RELAY_FACTOR
    exclude_s: float = 5.0
    max_exclude_s: float = 60.0
    max_attempts_per_hop: int = 8

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if not 0 < self.relay_factor <= 1:
            raise ValueError("relay_factor must be in (0, 1]")
        if self.exclude_s < 0 or self.max_exclude_s < self.exclude_s:
            raise ValueError("need 0 <= exclude_s <= max_exclude_s")
        if self.max_attempts_per_hop < 1:
            raise ValueError("max_attempts_per_hop must be >= 1")


@dataclass
class _Penalty:
    failures: int = 0
    until: float = 0.0


class Router:
    """Servers by stage and their penalties; draws the server of each hop."""

    def __init__(self, config: RoutingConfig, rng: Rng) -> None:
        self.config = config
        self.rng = rng
        self._by_stage: list[list[ServerAnnouncement]] = [[] for _ in range(config.num_stages)]
        self._penalties: dict[bytes, _Penalty] = {}

    def update(self, announcements: Iterable[ServerAnnouncement]) -> None:
        """Replace the view with a fresh read (servers missing from it are gone)."""
        by_stage: list[list[ServerAnnouncement]] = [[] for _ in range(self.config.num_stages)]
        seen: set[bytes] = set()
        for a in sorted(announcements, key=lambda a: a.peer_id):
            if a.stage < self.config.num_stages and a.peer_id not in seen:
                seen.add(a.peer_id)
                by_stage[a.stage].append(a)
        self._by_stage = by_stage

    def servers(self, stage: int) -> list[ServerAnnouncement]:
        return list(self._by_stage[stage])

    def stage_of(self, peer_id: bytes) -> int | None:
        for stage, servers in enumerate(self._by_stage):
            if any(a.peer_id == peer_id for a in servers):
                return stage
        return None

    def weight(self, a: ServerAnnouncement) -> float:
        return a.effective_throughput(self.config.relay_factor) / (1 + a.queue)

    def excluded(self, peer_id: bytes, now: float) -> bool:
        penalty = self._penalties.get(peer_id)
        return penalty is not None and penalty.until > now

    def penalize(self, peer_id: bytes, now: float) -> None:
        penalty = self._penalties.setdefault(peer_id, _Penalty())
        penalty.failures += 1
        span = self.config.exclude_s * 2 ** min(penalty.failures - 1, 16)
        penalty.until = now + min(self.config.max_exclude_s, span)

    def succeeded(self, peer_id: bytes) -> None:
        self._penalties.pop(peer_id, None)

    def pick(self, stage: int, now: float, tried: Iterable[bytes] = ()) -> bytes | None:
        """A server of ``stage`` for a hop that already failed on the ``tried`` servers.

        Returns None only when the stage has no server at all.
        """
        servers = self._by_stage[stage]
        if not servers:
            return None
        tried = set(tried)
        fresh = [a for a in servers if a.peer_id not in tried]
        # A server not tried for this hop first (the hop failed on the others), even an excluded
        # one; among tried ones, those not excluded (they only lost a context) come first.
        for pool in (fresh, servers):
            usable = [a for a in pool if not self.excluded(a.peer_id, now)]
            if usable:
                return self._draw(usable)
            if pool:
                # Every one is excluded: retry the one whose exclusion ends first rather than
                # stall (it may have recovered; a dead one fails fast and costs one attempt).
                return min(pool, key=lambda a: (self._until(a.peer_id), a.peer_id)).peer_id
        return None

    def _until(self, peer_id: bytes) -> float:
        penalty = self._penalties.get(peer_id)
        return penalty.until if penalty is not None else 0.0

    def _draw(self, pool: list[ServerAnnouncement]) -> bytes:
        weights = [self.weight(a) for a in pool]
        floor = max(max(weights) * MIN_WEIGHT_FRACTION, 1e-12)
        weights = [max(w, floor) for w in weights]
        point = self.rng.random() * sum(weights)
        for a, w in zip(pool, weights, strict=True):
            point -= w
            if point < 0:
                return a.peer_id
        return pool[-1].peer_id  # rounding left point at 0 after the last subtraction


class RouteState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    DONE = "done"
    FAILED = "failed"


# -- events (facts the driver reports) -------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class HopDone:
    stage: int
    peer_id: bytes


@dataclass(frozen=True)
class HopFailed:
    stage: int
    peer_id: bytes
    reason: str
    penalize: bool = True


@dataclass(frozen=True)
class LossComputed:
    pass


@dataclass(frozen=True)
class DeadlineReached:
    pass


Event = Start | HopDone | HopFailed | LossComputed | DeadlineReached

# -- actions (orders to the driver) ----------------------------------------------------------------


@dataclass(frozen=True)
class Forward:
    stage: int
    peer_id: bytes


@dataclass(frozen=True)
class Backward:
    stage: int
    peer_id: bytes
    send_inputs: bool


@dataclass(frozen=True)
class ComputeLoss:
    pass


@dataclass(frozen=True)
class Finish:
    path: tuple[bytes, ...]
    failovers: int


@dataclass(frozen=True)
class Fail:
    reason: str


Action = Forward | Backward | ComputeLoss | Finish | Fail


@dataclass
class MicrobatchRoute:
    """One microbatch's way through the stages; see the module docstring."""

    router: Router
    deadline: float
    state: RouteState = RouteState.IDLE
    stage: int = 0
    failovers: int = 0
    holders: list[bytes | None] = field(default_factory=list)
    pending: bytes | None = None
    _tried: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.holders = [None] * self.router.config.num_stages

    def handle(self, event: Event, now: float) -> list[Action]:
        if self.state in (RouteState.DONE, RouteState.FAILED):
            raise LocalProtocolError(f"{type(event).__name__} after the route ended")
        if isinstance(event, DeadlineReached):
            return self._fail(f"microbatch deadline passed at stage {self.stage} ({self.state})")
        if isinstance(event, Start):
            self._expect(RouteState.IDLE, event)
            self.state = RouteState.FORWARD
            return self._hop(0, now)
        if isinstance(event, LossComputed):
            self._expect(RouteState.LOSS, event)
            self.state = RouteState.BACKWARD
            return self._hop(self.router.config.num_stages - 1, now)
        if isinstance(event, HopDone | HopFailed):
            if self.state not in (RouteState.FORWARD, RouteState.BACKWARD):
                raise LocalProtocolError(f"{type(event).__name__} in state {self.state}")
            if (event.stage, event.peer_id) != (self.stage, self.pending):
                raise LocalProtocolError(f"{event} does not match the pending hop")
            if isinstance(event, HopFailed):
                return self._failover(event, now)
            return self._advance(event.peer_id, now)
        raise LocalProtocolError(f"unknown event {event!r}")

    def _expect(self, state: RouteState, event: Event) -> None:
        if self.state is not state:
            raise LocalProtocolError(f"{type(event).__name__} in state {self.state}")

    def _advance(self, peer_id: bytes, now: float) -> list[Action]:
        self.router.succeeded(peer_id)
        last = self.router.config.num_stages - 1
        if self.state is RouteState.FORWARD:
            self.holders[self.stage] = peer_id
            if self.stage == last:
                self.state, self.pending = RouteState.LOSS, None
                return [ComputeLoss()]
            return self._hop(self.stage + 1, now)
        self.holders[self.stage] = peer_id  # after a failover, the server that took over
        if self.stage == 0:
            self.state, self.pending = RouteState.DONE, None
            return [Finish(tuple(h or b"" for h in self.holders), self.failovers)]
        return self._hop(self.stage - 1, now)

    def _hop(self, stage: int, now: float) -> list[Action]:
        self.stage = stage
        self._tried = []
        holder = self.holders[stage] if self.state is RouteState.BACKWARD else None
        if holder is not None:
            self.pending = holder
            return [Backward(stage, holder, send_inputs=False)]
        return self._order(now)

    def _failover(self, event: HopFailed, now: float) -> list[Action]:
        if event.penalize:
            self.router.penalize(event.peer_id, now)
        self._tried.append(event.peer_id)
        self.failovers += 1
        if self.state is RouteState.BACKWARD:
            self.holders[self.stage] = None  # the context is gone with that attempt
        if len(self._tried) >= self.router.config.max_attempts_per_hop:
            return self._fail(
                f"stage {self.stage}: {len(self._tried)} attempts failed (last: {event.reason})"
            )
        return self._order(now)

    def _order(self, now: float) -> list[Action]:
        peer = self.router.pick(self.stage, now, self._tried)
        if peer is None:
            return self._fail(f"stage {self.stage} has no server")
        self.pending = peer
        if self.state is RouteState.FORWARD:
            return [Forward(self.stage, peer)]
        return [Backward(self.stage, peer, send_inputs=True)]

    def _fail(self, reason: str) -> list[Action]:
        self.state, self.pending = RouteState.FAILED, None
        return [Fail(reason)]
