"""A SWARM pipeline in the simulator: the real ``Router``, ``MicrobatchRoute`` and ``plan_move`` on
the virtual clock and ``Network``, with servers that come and go.

Model (every figure ``PipelineSim.run`` returns rests on it):

* ``servers`` stage servers, each with a compute rate in microbatches/s (log-uniform over
  ``rate_range``) and a link drawn from ``network``; ``trainers`` trainers with links drawn from
  ``trainer_network`` (datacenter-class by default: a trainer carries every stage's traffic).
  Initial server ``i`` serves stage ``i mod stages`` (or ``initial_stages[i]``).
* A trainer keeps ``in_flight`` microbatches going, each one a ``MicrobatchRoute`` over the
  trainer's ``Router``, and carries out its orders as ``PipelineTrainer.train_microbatch`` does:
  every hop goes trainer -> server -> trainer (``activation_bytes`` each way, twice that to the
  server when a backward resends the stage's inputs); the loss costs nothing. A hop that gets no
  reply within ``hop_timeout_s`` fails (``hop_timeout``); a server that crashed resets the
  connection one latency after its crash or after the hop was sent to it (``connection``); a
  refusal fails the hop with its code, penalized by ``routing.penalizes``. A route that fails
  (``Fail``: no server, attempts, deadline) is a lost microbatch; the trainer starts the next one
  a ``refresh_every_s`` later (a stage with no server would otherwise spin).
* A server serves its queue one request at a time, FIFO. As the real server accounts its costs (a
  backward recomputes the forward), a forward takes ``1/4`` of ``1/rate`` and a backward ``3/4``,
  so a stage's capacity is the sum of its servers' rates. A forward leaves a context (at most
  ``max_contexts``, oldest evicted); a backward without inputs and without its context is refused
  ``unknown-microbatch``, a request for another stage ``wrong-stage``. A request whose trainer
  gave up on it is still computed, as the real handler's is: with too many microbatches in
  flight, queues outgrow ``hop_timeout_s`` and the retries pile up behind wasted work.
* Announcements: every ``announce_every_s`` each serving server stores its record (rate as
  throughput, queue, relayed) for ``announce_ttl_s``; right after, every trainer's ``Router``
  is updated with the unexpired records, so a dead server stays routable until its record expires.
* Rebalancing as ``StageServer`` runs it: from ``rebalance_after_s`` on, at the middle of every
  ``rebalance_every_s`` epoch, ``plan_move`` on the records; a planned move quiets the next
  ``rebalance_quiet_epochs`` epochs. Every server reads the same store here, so one evaluation
  stands for all of them. The mover keeps serving its stage while it downloads ``stage_bytes``
  from the target stage's fastest server (timed at the pair's rate, beside the holder's other
  traffic rather than queued behind it), then serves the target. A joiner downloads its stage the
  same way before it announces.
* Churn (``churn`` > 0), as ``Simulation``'s: in each ``round_s`` span, Poisson(churn x present
  servers) departures at uniform times (a freeze with ``freeze_share``, else a crash) and
  Poisson(churn x ``servers``) joins, each at a stage drawn uniformly (the operator's pick; the
  rebalancer evens it out).

``throughput_per_s`` counts microbatches that finished every stage forward and backward in
``[warmup_s, seconds]``. ``bound_per_s`` is the time average over that window of an upper bound:
min over stages of the sum of its present servers' ``min(rate, up_bps / (16 x activation_bytes))``
(a server sends two activations per microbatch), and the trainers' ``up_bps / (16 x stages x
activation_bytes)`` summed.

Randomness: one generator per concern seeded from ``seed`` (links, rates, churn, each trainer's
router), so a run is a function of its config, and the same seed without churn gives the same
swarm.

The module runs past the ~400-line guide: trainers, servers, announcements, rebalancing and churn
all act on one table of microbatches and one store of records on one clock; split apart they
would pass those around.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from swarm.pipeline.rebalance import RebalanceConfig, plan_move
from swarm.pipeline.records import PARAM_HASH_BYTES, ServerAnnouncement
from swarm.pipeline.routing import (
    Action,
    Backward,
    ComputeLoss,
    DeadlineReached,
    Event,
    Fail,
    Finish,
    Forward,
    HopDone,
    HopFailed,
    LossComputed,
    MicrobatchRoute,
    Router,
    RoutingConfig,
    Start,
    penalizes,
)
from swarm.sim.clock import Clock
from swarm.sim.network import Network, NetworkConfig, PeerLink, draw_link

_PEER_ID_PREFIX = bytes.fromhex("002408011220")
_NO_HASH = bytes(PARAM_HASH_BYTES)
REFUSAL_BYTES = 100
FORWARD_SHARE = 0.25  # of a microbatch's cost at a stage (``StageServer._measure_part``)


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline run (module docstring); times in virtual seconds."""

    stages: int = 4
    servers: int = 64
    trainers: int = 8
    in_flight: int = 16
    seconds: float = 120.0
    warmup_s: float = 20.0
    seed: int = 0
    churn: float = 0.0
    round_s: float = 60.0
    freeze_share: float = 0.5
    rate_range: tuple[float, float] = (0.25, 2.0)
    activation_bytes: float = 1e6
    stage_bytes: float = 1e8
    initial_stages: tuple[int, ...] | None = None
    network: NetworkConfig = field(default_factory=NetworkConfig)
    trainer_network: NetworkConfig = field(
        default_factory=lambda: NetworkConfig(datacenter_share=1.0)
    )
    # the trainer's (``TrainerConfig``) and the server's (``StageServerConfig``) defaults
    hop_timeout_s: float = 15.0
    microbatch_timeout_s: float = 120.0
    refresh_every_s: float = 1.0
    exclude_s: float = 5.0
    max_attempts_per_hop: int = 8
    relay_factor: float = 0.5
    announce_every_s: float = 1.0
    announce_ttl_s: float = 6.0
    max_contexts: int = 64
    rebalance_every_s: float | None = 3.0
    rebalance_after_s: float = 8.0
    rebalance_quiet_epochs: int = 2
    min_gain: float = 0.1  # of the mover's contribution at the bottleneck (``rebalance``)

    def __post_init__(self) -> None:
        if min(self.stages, self.servers, self.trainers, self.in_flight) < 1:
            raise ValueError("pipeline stages, servers, trainers and in_flight must be >= 1")
        if not 0 <= self.warmup_s < self.seconds:
            raise ValueError("pipeline warmup_s must be in [0, seconds)")
        if not (0.0 <= self.churn <= 1.0 and 0.0 <= self.freeze_share <= 1.0):
            raise ValueError("pipeline churn and freeze_share must be in [0, 1]")
        low, high = self.rate_range
        if not 0 < low <= high or self.round_s <= 0:
            raise ValueError("pipeline rate_range must be 0 < low <= high, round_s > 0")
        if self.activation_bytes <= 0 or self.stage_bytes < 0:
            raise ValueError("pipeline activation_bytes must be > 0, stage_bytes >= 0")
        if self.initial_stages is not None and (
            len(self.initial_stages) != self.servers
            or not all(0 <= s < self.stages for s in self.initial_stages)
        ):
            raise ValueError("pipeline initial_stages must name a stage for every server")


@dataclass(frozen=True)
class PipelineFigures:
    """What one run did; ``lost`` counts lost microbatches by kind (``deadline``, ``attempts``,
    ``no_server``); ``hop_failures`` by ``trainer.HOP_FAILURE_KINDS`` name."""

    throughput_per_s: float
    bound_per_s: float
    started: int
    completed: int
    lost: dict[str, int]
    in_flight: int
    hops: int
    failovers: int
    hop_failures: dict[str, int]
    moves: int
    departures: int
    joins: int
    servers_per_stage: tuple[int, ...]
    events: int


@dataclass
class _Server:
    peer: bytes
    stage: int
    rate: float
    link: PeerLink
    serving: bool = True
    present: bool = True
    froze: bool = False
    busy: bool = False
    moving: bool = False  # downloading its next stage: ``_rebalance_forever`` awaits ``move_to``
    queue: deque[_Request] = field(default_factory=deque)
    contexts: OrderedDict[int, None] = field(default_factory=OrderedDict)
    announced: dict[tuple[int, int], ServerAnnouncement] = field(default_factory=dict)


@dataclass
class _Microbatch:
    id: int
    trainer: _Trainer
    route: MicrobatchRoute
    token: int = 0
    pending: bytes | None = None  # the server of the hop awaiting its reply
    ended: str | None = None
    finished_at: float | None = None
    path: tuple[bytes, ...] = ()  # the servers that ran its backwards (``Finish.path``)


@dataclass(frozen=True, slots=True)
class _Request:
    mb: _Microbatch
    token: int
    stage: int
    forward: bool
    with_inputs: bool


@dataclass
class _Trainer:
    peer: bytes
    router: Router
    up_bps: float


def pipeline_peer_id(seed: int, role: str, index: int) -> bytes:
    digest = hashlib.sha256(f"swarmtrain/sim/pipeline/{seed}/{role}/{index}".encode()).digest()
    return _PEER_ID_PREFIX + digest


class PipelineSim:
    """One pipeline run (module docstring): ``run()`` returns its ``PipelineFigures``.
    ``leave_at(peer, t, froze=)`` scripts a departure; ``records`` keeps every microbatch's end
    (``done``, ``lost:<kind>``, or None while in flight), ``hit`` the microbatches whose pending
    hop was on a server when it left."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = c = config
        self.clock = Clock()
        self.network = Network(self.clock, c.network, np.random.default_rng([c.seed, 13]))
        self._link_rng = np.random.default_rng([c.seed, 10])
        self._rate_rng = np.random.default_rng([c.seed, 11])
        self._churn_rng = np.random.default_rng([c.seed, 12])
        self.routing = RoutingConfig(
            num_stages=c.stages,
            relay_factor=c.relay_factor,
            exclude_s=c.exclude_s,
            max_exclude_s=max(c.exclude_s, RoutingConfig.max_exclude_s),
            max_attempts_per_hop=c.max_attempts_per_hop,
        )
        self.rule = RebalanceConfig(
            num_stages=c.stages, relay_factor=c.relay_factor, min_gain=c.min_gain
        )
        self.servers: dict[bytes, _Server] = {}
        self.trainers = [self._add_trainer(i) for i in range(c.trainers)]
        for i in range(c.servers):
            stage = c.initial_stages[i] if c.initial_stages is not None else i % c.stages
            self._add_server(stage)
        self.records: dict[int, _Microbatch] = {}
        self._active: dict[int, _Microbatch] = {}
        self.hit: dict[bytes, list[int]] = {}
        self._store: dict[bytes, tuple[ServerAnnouncement, float]] = {}
        self._bounds: list[tuple[float, float]] = []
        self._quiet_until = -1
        self.completed_at: list[float] = []
        self.lost: Counter[str] = Counter()
        self.hop_failures: Counter[str] = Counter()
        self.hops = self.failovers = self.moves = self.departures = self.joins = 0

    # -- setup -------------------------------------------------------------------------------

    def _add_trainer(self, index: int) -> _Trainer:
        c = self.config
        peer = pipeline_peer_id(c.seed, "trainer", index)
        link = draw_link(c.trainer_network, self._link_rng)
        self.network.add(peer, link)
        rng = random.Random(int.from_bytes(peer[-8:], "big"))
        return _Trainer(peer, Router(self.routing, rng), link.up_bps)

    def _add_server(self, stage: int) -> _Server:
        c = self.config
        peer = pipeline_peer_id(c.seed, "server", len(self.servers))
        link = draw_link(c.network, self._link_rng)
        low, high = c.rate_range
        rate = float(math.exp(self._rate_rng.uniform(math.log(low), math.log(high))))
        self.network.add(peer, link)
        server = self.servers[peer] = _Server(peer, stage, rate, link)
        return server

    # -- running -----------------------------------------------------------------------------

    def run(self) -> PipelineFigures:
        c = self.config
        self.clock.at(0.0, self._tick)
        for trainer in self.trainers:
            for _ in range(c.in_flight):
                self.clock.at(0.0, self._start, trainer)
        if c.rebalance_every_s:
            first = int(c.rebalance_after_s // c.rebalance_every_s) + 1
            self.clock.at((first + 0.5) * c.rebalance_every_s, self._rebalance, first)
        if c.churn:
            self.clock.at(0.0, self._churn_span)
        self._bound_changed()
        self.clock.run(until=c.seconds)
        return self.figures()

    def leave_at(self, peer: bytes, t: float, *, froze: bool = False) -> None:
        self.clock.at(t, self._leave, peer, froze)

    def figures(self) -> PipelineFigures:
        c = self.config
        window = c.seconds - c.warmup_s
        done = sum(c.warmup_s <= t <= c.seconds for t in self.completed_at)
        per_stage = [0] * c.stages
        for s in self.servers.values():
            if s.present and s.serving:
                per_stage[s.stage] += 1
        return PipelineFigures(
            throughput_per_s=done / window,
            bound_per_s=self._mean_bound(c.warmup_s, c.seconds),
            started=len(self.records),
            completed=len(self.completed_at),
            lost=dict(sorted(self.lost.items())),
            in_flight=len(self._active),
            hops=self.hops,
            failovers=self.failovers,
            hop_failures=dict(sorted(self.hop_failures.items())),
            moves=self.moves,
            departures=self.departures,
            joins=self.joins,
            servers_per_stage=tuple(per_stage),
            events=self.clock.events_run,
        )

    # -- the capacity bound ------------------------------------------------------------------

    def bound_now(self) -> float:
        c = self.config
        per_message_bits = 16 * c.activation_bytes
        stages = [0.0] * c.stages
        for s in self.servers.values():
            if s.present and s.serving:
                stages[s.stage] += min(s.rate, s.link.up_bps / per_message_bits)
        trainers = sum(t.up_bps for t in self.trainers) / (per_message_bits * c.stages)
        return min(min(stages), trainers)

    def _bound_changed(self) -> None:
        self._bounds.append((self.clock.now, self.bound_now()))

    def _mean_bound(self, start: float, end: float) -> float:
        total = 0.0
        for i, (t, value) in enumerate(self._bounds):
            until = self._bounds[i + 1][0] if i + 1 < len(self._bounds) else end
            total += value * max(0.0, min(until, end) - max(t, start))
        return total / (end - start)

    # -- announcements and rebalancing -------------------------------------------------------

    def _tick(self) -> None:
        now = self.clock.now
        for s in self.servers.values():
            if s.present and s.serving:
                self._store[s.peer] = (self._announcement(s), now + self.config.announce_ttl_s)
        for peer in [p for p, (_, expires) in self._store.items() if expires <= now]:
            del self._store[peer]
        view = [a for a, _ in self._store.values()]
        for trainer in self.trainers:
            trainer.router.update(view)
        self.clock.after(self.config.announce_every_s, self._tick)

    def _announcement(self, s: _Server) -> ServerAnnouncement:
        key = (s.stage, len(s.queue) + s.busy)
        found = s.announced.get(key)
        if found is None:
            relayed = s.link.relayed
            found = ServerAnnouncement(s.peer, key[0], s.rate, key[1], relayed, -1, _NO_HASH)
            s.announced[key] = found
        return found

    def _rebalance(self, epoch: int) -> None:
        period = self.config.rebalance_every_s
        assert period is not None
        self.clock.at((epoch + 1.5) * period, self._rebalance, epoch + 1)
        if epoch <= self._quiet_until:
            return
        move = plan_move([a for a, _ in self._store.values()], epoch, self.rule)
        if move is None:
            return
        self._quiet_until = epoch + self.config.rebalance_quiet_epochs
        mover = self.servers[move.peer_id]
        if mover.present and not mover.moving and mover.stage == move.from_stage:
            mover.moving = True
            self._download(mover, move.to_stage, moving=True)

    def _download(self, server: _Server, stage: int, *, moving: bool) -> None:
        holders = [
            s for s in self.servers.values()
            if s.present and s.serving and s.stage == stage and s is not server
        ]  # fmt: skip
        if not holders or not self.config.stage_bytes:
            self._serve_stage(server, stage, None, moving)
            return
        holder = max(holders, key=lambda s: (s.rate, s.peer))
        seconds = 8 * self.config.stage_bytes / self.network.rate(holder.peer, server.peer)
        seconds += self.network.latency(holder.peer, server.peer)
        self.clock.after(seconds, self._serve_stage, server, stage, holder, moving)

    def _serve_stage(
        self, server: _Server, stage: int, holder: _Server | None, moving: bool
    ) -> None:
        if not server.present:
            return
        if holder is not None and not holder.present:
            self._download(server, stage, moving=moving)  # another holder, from the start
            return
        server.stage, server.serving, server.moving = stage, True, False
        server.contexts.clear()  # a move swaps the whole active stage
        self.moves += moving
        # Announced at once, as ``move_to`` and a starting server do.
        expires = self.clock.now + self.config.announce_ttl_s
        self._store[server.peer] = (self._announcement(server), expires)
        self._bound_changed()

    # -- churn -------------------------------------------------------------------------------

    def _churn_span(self) -> None:
        c, rng, now = self.config, self._churn_rng, self.clock.now
        present = [s.peer for s in self.servers.values() if s.present]
        leaving = min(len(present), int(rng.poisson(c.churn * len(present))))
        for victim in rng.choice(len(present), size=leaving, replace=False):
            froze = bool(rng.random() < c.freeze_share)
            self.clock.at(now + rng.uniform(0.0, c.round_s), self._leave, present[victim], froze)
        for _ in range(int(rng.poisson(c.churn * c.servers))):
            stage = int(rng.integers(c.stages))
            self.clock.at(now + rng.uniform(0.0, c.round_s), self._join, stage)
        self.clock.after(c.round_s, self._churn_span)

    def _join(self, stage: int) -> None:
        self.joins += 1
        server = self._add_server(stage)
        server.serving = False
        self._download(server, stage, moving=False)

    def _leave(self, peer: bytes, froze: bool) -> None:
        server = self.servers[peer]
        if not server.present:
            return
        server.present, server.froze = False, froze
        self.departures += 1
        self.network.leave(peer)
        server.queue.clear()
        hit = self.hit.setdefault(peer, [])
        for mb in self._active.values():
            if mb.pending == peer:
                hit.append(mb.id)
                if not froze:  # the connection resets; a frozen server just stops answering
                    delay = self.network.latency(peer, mb.trainer.peer)
                    self.clock.after(delay, self._failed, mb, mb.token, "connection")
        self._bound_changed()

    # -- trainers ----------------------------------------------------------------------------

    def _start(self, trainer: _Trainer) -> None:
        now = self.clock.now
        route = MicrobatchRoute(trainer.router, deadline=now + self.config.microbatch_timeout_s)
        mb = _Microbatch(len(self.records), trainer, route)
        self.records[mb.id] = self._active[mb.id] = mb
        self._handle(mb, Start())

    def _handle(self, mb: _Microbatch, event: Event) -> None:
        if not isinstance(event, Start | DeadlineReached) and self.clock.now >= mb.route.deadline:
            event = DeadlineReached()
        self._act(mb, mb.route.handle(event, self.clock.now))

    def _act(self, mb: _Microbatch, actions: list[Action]) -> None:
        (action,) = actions
        mb.token += 1
        mb.pending = None
        if isinstance(action, ComputeLoss):
            self._handle(mb, LossComputed())
        elif isinstance(action, Finish):
            mb.ended, mb.finished_at, mb.path = "done", self.clock.now, action.path
            del self._active[mb.id]
            self.completed_at.append(self.clock.now)
            self.failovers += action.failovers
            self._start(mb.trainer)
        elif isinstance(action, Fail):
            kind = ("deadline" if "deadline" in action.reason
                    else "no_server" if "no server" in action.reason else "attempts")  # fmt: skip
            mb.ended = f"lost:{kind}"
            del self._active[mb.id]
            self.lost[kind] += 1
            self.failovers += mb.route.failovers
            self.clock.after(self.config.refresh_every_s, self._start, mb.trainer)
        else:
            self._send_hop(mb, action)

    def _send_hop(self, mb: _Microbatch, action: Forward | Backward) -> None:
        c, now = self.config, self.clock.now
        mb.pending = action.peer_id
        server = self.servers[action.peer_id]
        timeout = min(now + c.hop_timeout_s, mb.route.deadline)
        self.clock.at(max(now, timeout), self._timed_out, mb, mb.token)
        if not server.present and not server.froze:  # the dial is refused
            delay = 2 * self.network.latency(mb.trainer.peer, server.peer)
            self.clock.after(delay, self._failed, mb, mb.token, "connection")
            return
        forward = isinstance(action, Forward)
        with_inputs = not forward and action.send_inputs  # type: ignore[union-attr]
        request = _Request(mb, mb.token, action.stage, forward, with_inputs)
        size = c.activation_bytes * (2 if with_inputs else 1)
        self.network.send(mb.trainer.peer, server.peer, size, self._arrived, server, request)

    def _timed_out(self, mb: _Microbatch, token: int) -> None:
        if mb.token != token or mb.ended is not None:
            return
        if self.clock.now >= mb.route.deadline:
            self._handle(mb, DeadlineReached())
        else:
            self._failed(mb, token, "hop_timeout")

    def _failed(self, mb: _Microbatch, token: int, kind: str, code: str | None = None) -> None:
        if mb.token != token or mb.ended is not None:
            return
        self.hop_failures[kind] += 1
        stage, peer = mb.route.stage, mb.pending
        assert peer is not None
        self._handle(mb, HopFailed(stage, peer, kind, penalizes(code)))

    def _replied(self, mb: _Microbatch, token: int) -> None:
        if mb.token != token or mb.ended is not None:
            return
        self.hops += 1
        assert mb.pending is not None
        self._handle(mb, HopDone(mb.route.stage, mb.pending))

    # -- servers -----------------------------------------------------------------------------

    def _arrived(self, server: _Server, request: _Request) -> None:
        server.queue.append(request)
        if not server.busy:
            self._serve_next(server)

    def _serve_next(self, server: _Server) -> None:
        while server.queue and server.present:
            request = server.queue.popleft()
            refusal = None
            if request.stage != server.stage:
                refusal = "wrong-stage"
            elif not (request.forward or request.with_inputs or request.mb.id in server.contexts):
                refusal = "unknown-microbatch"
            if refusal is None:
                share = FORWARD_SHARE if request.forward else 1 - FORWARD_SHARE
                server.busy = True
                self.clock.after(share / server.rate, self._computed, server, request)
                return
            self.network.send(server.peer, request.mb.trainer.peer, REFUSAL_BYTES,
                              self._refused, request, refusal)  # fmt: skip

    def _computed(self, server: _Server, request: _Request) -> None:
        server.busy = False
        if not server.present:
            return
        if request.forward:
            server.contexts[request.mb.id] = None
            while len(server.contexts) > self.config.max_contexts:
                server.contexts.popitem(last=False)
        else:
            server.contexts.pop(request.mb.id, None)
        trainer = request.mb.trainer.peer
        size = self.config.activation_bytes
        self.network.send(server.peer, trainer, size, self._replied, request.mb, request.token)
        self._serve_next(server)

    def _refused(self, request: _Request, code: str) -> None:
        self._failed(request.mb, request.token, code.replace("-", "_"), code)
