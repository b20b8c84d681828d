"""A pipeline stage server: serves one stage of a model to trainers, averages it with the other
servers of that stage, and moves to the bottleneck stage when the rebalancing rule says so.

The caller cuts the model: ``build_stage(k)`` returns a ``StageModule`` (the ``nn.Module`` of stage
k, an example input for the throughput probe, an optimizer factory). Every server must build the
same initial parameters for a stage (a seeded init), so servers of a stage agree before their first
averaging. Nothing here knows the model.

Services, all children of ``StageServer.run``'s nursery:

* **forward / backward** (``swarm.pipeline.wire``): a forward keeps the stage's inputs per
  (trainer, microbatch id), at most ``max_contexts`` of them (oldest evicted); a backward
  *recomputes* the forward from those inputs (or from inputs the trainer resends after a failover)
  and backpropagates. Recomputing, rather than keeping the autograd graph, is what lets the
  optimizer step and the averaging change the parameters between a microbatch's forward and its
  backward (a kept graph would see its saved tensors modified in place) and lets any server of
  the stage take over a backward. Every ``accumulate`` backwards, the optimizer steps.
* **announce**: our ``ServerAnnouncement`` (stage, measured samples/s, queue, relayed, parameter
  hash) as our signed subkey under ``servers_key(run)``, every ``announce_every_s``.
* **average** (point 5): at every multiple of ``average_every_s`` of the clock (servers of a stage
  see different numbers of microbatches under stochastic wiring, so a step count cannot align
  them; a clock epoch can), the servers of a stage average their parameters with the swarm
  all-reduce (``swarm.averaging.averager``, one run id per stage) while serving pauses, so they
  leave the round bit-identical. Each publishes the SHA-256 of the result and keeps that snapshot:
  it is what ``params`` downloads serve, so a download can be checked against the announced hash.
* **join**: a server that starts on a stage other servers already serve downloads their
  parameters first (as a move does), so a restarted server does not drag the stage back to the
  initial parameters at its first averaging.
* **rebalance** (point 4): at every ``rebalance_every_s`` epoch,
``swarm.pipeline.rebalance.plan_move`` on the announcements; the one server it names downloads the
target stage's parameters from a server of that stage (hash-checked against that server's signed
announcement and the bytes), builds the stage, and serves it from then on.

Torch runs in worker threads, one job at a time (``self._lock``), so the DHT, the announcements
and the all-reduce never wait behind a microbatch. A handler that fails replies with a refusal and
logs; nothing it raises reaches the host.

This module runs past the ~400-line guide: its services share one active stage, its lock and its
averaged snapshot (a move swaps all three at once); split apart they would pass those around.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import trio

from p2p import Node, P2PError, PeerID, Reachability, RemoteProtocolError, RpcStream, Stream
from swarm.averaging.averager import Averager, AveragerConfig
from swarm.errors import AveragingFailed
from swarm.pipeline.rebalance import RebalanceConfig, plan_move
from swarm.pipeline.records import (
    ServerAnnouncement,
    decode_announcements,
    encode_announcement,
    param_digest,
    servers_key,
)
from swarm.pipeline.wire import (
    BACKWARD_PROTOCOL,
    FORWARD_PROTOCOL,
    PARAMS_PROTOCOL,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    HopRefused,
    ParamsReply,
    ParamsRequest,
    fetch_params,
    from_fields,
    to_fields,
)

log = logging.getLogger(__name__)

DOWNLOAD_PASSES = 3


@dataclass
class StageModule:
    """What ``build_stage(k)`` returns: stage k's module, an input like a trainer sends (for the
    throughput probe) and how to make its optimizer."""

    module: torch.nn.Module
    example_input: torch.Tensor
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StageServerConfig:
    """Periods and limits of a stage server (seconds unless named otherwise). The defaults suit
    loopback and LAN swarms; ``average_every_s`` and ``rebalance_every_s`` must be equal on every
    server of a run (they define the shared clock epochs)."""

    run_id: str
    num_stages: int
    announce_every_s: float = 1.0
    announce_ttl_s: float = 6.0
    average_every_s: float | None = 5.0  # None: never average
    averaging_timeout_s: float = 20.0
    matchmaking_timeout_s: float = 2.0
    rebalance_every_s: float | None = 3.0  # None: never move
    rebalance_after_s: float = 8.0  # let every server announce before anyone judges
    rebalance_quiet_epochs: int = 2  # epochs nobody moves after a move was planned
    min_gain: float = 0.1  # of the mover's contribution at the bottleneck (``rebalance``)
    relay_factor: float = 0.5
    relayed: bool | None = None  # None: relayed when we are private and hold relay slots
    max_contexts: int = 64
    accumulate: int = 1
    request_timeout_s: float = 30.0
    download_timeout_s: float = 30.0
    throughput_ema: float = 0.2


class Refusal(Exception):
    """A request this server will not serve; ``code`` goes back to the trainer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ServerStatistics:
    forwards: int = 0
    backwards: int = 0
    optimizer_steps: int = 0
    refusals: int = 0
    averaged_rounds: int = 0
    failed_rounds: int = 0
    moves: int = 0
    # Requests served by (stage, kind: forward, backward, params); refusals by their code.
    served: Counter[tuple[int, str]] = field(default_factory=Counter)
    refusals_by_code: Counter[str] = field(default_factory=Counter)
    # The latest events (serving, joined, averaged, average_failed, moved), newest last; bounded
    # for long runs.
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))


class _Active:
    """The stage being served: module, optimizer, forward contexts, the averaged snapshot."""

    def __init__(self, stage: int, built: StageModule, max_contexts: int) -> None:
        self.stage = stage
        self.module = built.module.train()
        self.params = list(self.module.parameters())
        self.optimizer = built.make_optimizer(self.params)
        self.example_input = built.example_input
        self.contexts: OrderedDict[tuple[bytes, bytes], torch.Tensor] = OrderedDict()
        self.max_contexts = max_contexts
        self.pending = 0
        self.snapshot_round = -1
        self.snapshot = [p.detach().numpy().copy() for p in self.params]
        self.snapshot_hash = param_digest(self.snapshot)

    def load(self, arrays: list[np.ndarray]) -> None:
        if [tuple(a.shape) for a in arrays] != [tuple(p.shape) for p in self.params]:
            raise ValueError("downloaded parameters do not fit this stage's module")
        with torch.no_grad():
            for p, a in zip(self.params, arrays, strict=True):
                p.copy_(torch.from_numpy(np.array(a, dtype=np.float32)))


class StageServer:
    """Serve with ``await nursery.start(server.run)``; cancel the nursery to stop."""

    def __init__(
        self,
        node: Node,
        config: StageServerConfig,
        build_stage: Callable[[int], StageModule],
        stage: int,
        *,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not 0 <= stage < config.num_stages:
            raise ValueError(f"stage {stage} not in [0, {config.num_stages})")
        self.node = node
        self.config = config
        self.build_stage = build_stage
        self.me = node.host.peer_id.to_bytes()
        self.statistics = ServerStatistics()
        self._on_event = on_event
        self._initial_stage = stage
        self._active: _Active | None = None
        self._lock = trio.Lock()
        self._queue = 0
        self._seconds_per_sample = 0.0
        self._averager: Averager | None = None
        self._averager_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def stage(self) -> int:
        return self._active.stage if self._active is not None else self._initial_stage

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._active = await trio.to_thread.run_sync(self._build, self._initial_stage)
        # Joining a stage that is already served (a restart, a late server): start from its
        # current averaged parameters, not from the initial ones.
        joined = await self._download(self._initial_stage, await self.read_servers())
        if joined is not None:
            self._active = joined
            self._event("joined", stage=self.stage, round=joined.snapshot_round)
        await trio.to_thread.run_sync(self._probe)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            host = self.node.host
            host.set_handler(FORWARD_PROTOCOL, self._serve_forward)
            host.set_handler(BACKWARD_PROTOCOL, self._serve_backward)
            host.set_handler(PARAMS_PROTOCOL, self._serve_params)
            await self._start_averager()
            await self.announce()
            self._event("serving", stage=self.stage, throughput=round(self.throughput(), 2))
            nursery.start_soon(self._announce_forever)
            if self.config.average_every_s:
                nursery.start_soon(self._average_forever, self.config.average_every_s)
            if self.config.rebalance_every_s:
                nursery.start_soon(self._rebalance_forever, self.config.rebalance_every_s)
            task_status.started()

    # -- measurements and announcements --------------------------------------------------------

    def throughput(self) -> float:
        """Samples/s through forward + backward, as measured (EMA) on real requests."""
        return 1.0 / self._seconds_per_sample if self._seconds_per_sample > 0 else 0.0

    def queue_length(self) -> int:
        """Requests waiting for the stage or computing on it now (what we announce)."""
        return self._queue

    def _measure(self, seconds: float, samples: int) -> None:
        per_sample = seconds / max(1, samples)
        a = self.config.throughput_ema
        current = self._seconds_per_sample
        self._seconds_per_sample = (
            per_sample if current == 0 else (1 - a) * current + a * per_sample
        )

    def _relayed(self) -> bool:
        if self.config.relayed is not None:
            return self.config.relayed
        private = self.node.reachability.status is not Reachability.PUBLIC
        return private and bool(self.node.relay_addrs())

    def announcement(self) -> ServerAnnouncement:
        active = self._active
        assert active is not None
        return ServerAnnouncement(
            self.me,
            active.stage,
            min(self.throughput(), 1e9),
            self._queue,
            self._relayed(),
            active.snapshot_round,
            active.snapshot_hash,
        )

    async def announce(self) -> int:
        value = encode_announcement(self.announcement())
        key = servers_key(self.config.run_id)
        return await self.node.dht.store(key, value, time.time() + self.config.announce_ttl_s)

    async def read_servers(self) -> list[ServerAnnouncement]:
        """Every server's announcement as the DHT holds it (ours added if it holds none)."""
        try:
            records = await self.node.dht.get_records(servers_key(self.config.run_id), latest=True)
        except P2PError as exc:
            log.debug("reading the servers failed: %s", exc)
            records = {}
        found = decode_announcements(
            [(r.owner, r.value) for r in records.values()], num_stages=self.config.num_stages
        )
        # Our record as the others read it, not our fresher figures: every server must feed
        # the rebalancing rule the same inputs. Ours only if the DHT has none of us yet.
        if not any(a.peer_id == self.me for a in found):
            found.append(self.announcement())
        return found

    async def _announce_forever(self) -> None:
        while True:
            await trio.sleep(self.config.announce_every_s)
            try:
                await self.announce()
            except P2PError as exc:
                log.warning("announcing failed: %s", exc)

    # -- torch work (worker threads, one at a time) --------------------------------------------

    def _build(self, stage: int) -> _Active:
        return _Active(stage, self.build_stage(stage), self.config.max_contexts)

    def _probe(self) -> None:
        """A first throughput figure before any request: one forward + backward of the example."""
        active = self._active
        assert active is not None
        started = time.perf_counter()
        x = active.example_input
        with torch.no_grad():
            active.module(x)  # the forward request
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = active.module(x)  # the backward request recomputes it, then backpropagates
        y.backward(torch.zeros_like(y))
        active.optimizer.zero_grad(set_to_none=True)
        self._seconds_per_sample = 0.0
        self._measure(time.perf_counter() - started, int(x.shape[0]))

    async def _compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._queue += 1
        try:
            async with self._lock:
                return await trio.to_thread.run_sync(fn, *args)
        finally:
            self._queue -= 1

    def _forward(self, stage: int, key: tuple[bytes, bytes], inputs: np.ndarray) -> np.ndarray:
        active = self._checked(stage)
        started = time.perf_counter()
        x = torch.from_numpy(inputs)
        with torch.no_grad():
            y = active.module(x)
        active.contexts[key] = x
        active.contexts.move_to_end(key)
        while len(active.contexts) > active.max_contexts:
            active.contexts.popitem(last=False)
        self._measure_part(time.perf_counter() - started, x.shape[0], forward=True)
        self.statistics.forwards += 1
        self.statistics.served[stage, "forward"] += 1
        return y.detach().float().numpy()

    def _backward(
        self,
        stage: int,
        key: tuple[bytes, bytes],
        grad_outputs: np.ndarray,
        inputs: np.ndarray | None,
    ) -> np.ndarray | None:
        active = self._checked(stage)
        started = time.perf_counter()
        x = torch.from_numpy(inputs) if inputs is not None else active.contexts.pop(key, None)
        if x is None:
            raise Refusal("unknown-microbatch", "no forward context here; resend the inputs")
        active.contexts.pop(key, None)
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = active.module(x)
            y.backward(torch.from_numpy(grad_outputs).to(y.dtype))
        active.pending += 1
        if active.pending >= self.config.accumulate:
            active.optimizer.step()
            active.optimizer.zero_grad(set_to_none=True)
            active.pending = 0
            self.statistics.optimizer_steps += 1
        self._measure_part(time.perf_counter() - started, x.shape[0], forward=False)
        self.statistics.backwards += 1
        self.statistics.served[stage, "backward"] += 1
        return x.grad.numpy() if x.grad is not None else None

    def _measure_part(self, seconds: float, samples: int, *, forward: bool) -> None:
        # A backward recomputes the forward and costs about twice it on top: a whole microbatch
        # costs forward + backward, about 1.75x what a backward alone measured here.
        self._measure(seconds * (4.0 if forward else 4.0 / 3.0), samples)

    def _checked(self, stage: int) -> _Active:
        active = self._active
        if active is None or active.stage != stage:
            serving = active.stage if active is not None else None
            raise Refusal("wrong-stage", f"this server serves stage {serving}, not {stage}")
        return active

    # -- handlers --------------------------------------------------------------------------------

    async def _serve_forward(self, stream: Stream) -> None:
        async def handle(rpc: RpcStream, peer: bytes) -> None:
            request = await rpc.receive(ForwardRequest)
            self._check_run(request.run_id)
            inputs = from_fields(request.dtype, request.shape, request.data)
            key = (peer, request.microbatch_id)
            outputs = await self._compute(self._forward, request.stage, key, inputs)
            await rpc.send(ForwardReply(request.microbatch_id, *to_fields(outputs)))

        await self._guarded(stream, handle)

    async def _serve_backward(self, stream: Stream) -> None:
        async def handle(rpc: RpcStream, peer: bytes) -> None:
            request = await rpc.receive(BackwardRequest)
            self._check_run(request.run_id)
            grad = from_fields(request.grad_dtype, request.grad_shape, request.grad_data)
            inputs = from_fields(request.input_dtype, request.input_shape, request.input_data)
            key = (peer, request.microbatch_id)
            grad_in = await self._compute(self._backward, request.stage, key, grad, inputs)
            await rpc.send(BackwardReply(request.microbatch_id, *to_fields(grad_in)))

        await self._guarded(stream, handle)

    async def _serve_params(self, stream: Stream) -> None:
        async def handle(rpc: RpcStream, peer: bytes) -> None:
            request = await rpc.receive(ParamsRequest)
            self._check_run(request.run_id)
            active = self._checked(request.stage)
            arrays = active.snapshot
            fields = [to_fields(a) for a in arrays]
            await rpc.send(
                ParamsReply(
                    active.stage,
                    active.snapshot_round,
                    active.snapshot_hash,
                    [f[0] for f in fields],
                    [f[1] for f in fields],
                    [f[2] for f in fields],
                )
            )
            self.statistics.served[active.stage, "params"] += 1

        await self._guarded(stream, handle)

    def _check_run(self, run_id: str) -> None:
        if run_id != self.config.run_id:
            raise Refusal("wrong-run", f"this server belongs to run {self.config.run_id!r}")

    async def _guarded(self, stream: Stream, handle: Callable[..., Any]) -> None:
        """Run ``handle`` under the request deadline; every failure becomes a refusal."""
        rpc = RpcStream(stream)
        peer = rpc.peer_id.to_bytes()
        refusal: tuple[str, str] | None = None
        try:
            with trio.fail_after(self.config.request_timeout_s):
                await handle(rpc, peer)
        except Refusal as exc:
            refusal = (exc.code, str(exc))
        except RemoteProtocolError as exc:
            refusal = ("bad-request", str(exc))
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            # torch's complaints about a tensor that does not fit the stage: the sender's fault
            refusal = ("bad-request", f"{type(exc).__name__}: {exc}")
        except trio.TooSlowError:
            refusal = ("timeout", "request took too long")
        except Exception as exc:
            log.warning("pipeline handler failed for %s: %r", str(rpc.peer_id)[-8:], exc)
            refusal = ("internal", f"{type(exc).__name__}")
        if refusal is not None:
            self.statistics.refusals += 1
            self.statistics.refusals_by_code[refusal[0]] += 1
            with trio.move_on_after(1):
                try:
                    await rpc.send(HopRefused(refusal[0], refusal[1][:1000]))
                except Exception as exc:  # the trainer may be gone already
                    log.debug("could not send a refusal: %r", exc)
        await rpc.close()

    # -- averaging within the stage --------------------------------------------------------------

    async def _start_averager(self) -> None:
        assert self._nursery is not None
        if self._averager_scope is not None:
            self._averager_scope.cancel()
        averager = Averager(
            self.node,
            AveragerConfig(
                run_id=self._stage_run_id(self.stage),
                matchmaking_timeout_s=self._matchmaking_timeout_s(),
                allreduce_timeout_s=self.config.averaging_timeout_s,
            ),
        )
        self._averager = averager
        self._averager_scope = await self._nursery.start(self._run_averager, averager)

    def _matchmaking_timeout_s(self) -> float:
        """At most 0.4 of the averaging period: a round that fails to match must end before the
        next boundary. Otherwise a server alone in a round (its peer late) skips the next
        boundary, and two servers out of phase alternate rounds and never meet (seen with a 2 s
        period and a 2 s matchmaking timeout)."""
        period = self.config.average_every_s
        timeout = self.config.matchmaking_timeout_s
        return min(timeout, 0.4 * period) if period else timeout

    def _stage_run_id(self, stage: int) -> str:
        return f"{self.config.run_id}-stage{stage}"

    async def _run_averager(
        self, averager: Averager, *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(averager.run)
                task_status.started(scope)

    async def _average_forever(self, period_s: float) -> None:
        while True:
            now = time.time()
            round_number = int(now // period_s) + 1
            await trio.sleep(round_number * period_s - now)
            await self.average(round_number)

    async def average(self, round_number: int) -> bool:
        """Average this stage's parameters with its other servers for ``round_number``.

        Returns False when there is nobody to average with or the round failed (logged)."""
        stage = self.stage
        peers = [a.peer_id for a in await self.read_servers() if a.stage == stage]
        if len(peers) < 2 or self._averager is None:
            return False
        averager = self._averager
        async with self._lock:
            active = self._active
            if active is None or active.stage != stage:
                return False  # we moved meanwhile
            tensors = [p.detach() for p in active.params]
            result = None
            with trio.move_on_after(
                self._matchmaking_timeout_s() + self.config.averaging_timeout_s
            ):
                try:
                    result = await averager.average(
                        tensors, 1.0, round_number=round_number, expected_peers=peers
                    )
                except AveragingFailed as exc:
                    log.info("stage %d round %d: averaging failed: %s", stage, round_number, exc)
            if result is None:
                self.statistics.failed_rounds += 1
                self._event("average_failed", stage=stage, round=round_number)
                return False
            await trio.to_thread.run_sync(self._adopt, active, round_number, result.tensors)
        self.statistics.averaged_rounds += 1
        self._event(
            "averaged",
            stage=stage,
            round=round_number,
            digest=active.snapshot_hash.hex(),
            group=len(result.contributors),
            matchmaking_s=result.matchmaking_s,
            allreduce_s=result.allreduce_s,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
        )
        try:
            await averager.publish_state_hash(round_number, active.snapshot_hash)
        except P2PError as exc:
            log.debug("publishing the stage hash failed: %s", exc)
        return True

    def _adopt(self, active: _Active, round_number: int, tensors: list[Any]) -> None:
        with torch.no_grad():
            for p, t in zip(active.params, tensors, strict=True):
                p.copy_(t)
        active.snapshot = [p.detach().numpy().copy() for p in active.params]
        active.snapshot_hash = param_digest(active.snapshot)
        active.snapshot_round = round_number

    # -- rebalancing -----------------------------------------------------------------------------

    async def _rebalance_forever(self, period_s: float) -> None:
        await trio.sleep(self.config.rebalance_after_s)
        rule = RebalanceConfig(
            num_stages=self.config.num_stages,
            relay_factor=self.config.relay_factor,
            min_gain=self.config.min_gain,
        )
        quiet_until = -1
        while True:
            # Half a period off the epoch boundary: away from the averaging instants, which
            # fall on whole multiples of their own period.
            now = time.time()
            epoch = int(now // period_s) + 1
            await trio.sleep(max(0.0, (epoch + 0.5) * period_s - now))
            if epoch <= quiet_until:
                continue
            servers = await self.read_servers()
            move = plan_move(servers, epoch, rule)
            if move is None:
                continue
            # Whoever moves, everyone who saw the move sits out the next epochs: the mover
            # needs time to download, build and announce, and until its new record is read a
            # stale view still counts it at its old stage and would pick a second mover there
            # (enough of those empty a stage; measured here on a loaded 2-core box).
            quiet_until = epoch + self.config.rebalance_quiet_epochs
            if move.peer_id != self.me or move.from_stage != self.stage:
                continue
            # A second, fresh read must name us again before we leave.
            again = plan_move(await self.read_servers(), epoch, rule)
            if again is not None and again.peer_id == self.me:
                await self.move_to(move.to_stage, servers, epoch=epoch)

    async def move_to(
        self, target: int, servers: list[ServerAnnouncement], *, epoch: int = -1
    ) -> bool:
        """Start serving ``target`` with parameters downloaded from one of its servers.

        Returns False (and keeps serving our stage) when no server of ``target`` gave
        parameters matching its announced hash."""
        source_stage = self.stage
        fresh = await self._download(target, servers)
        if fresh is None:
            return False
        async with self._lock:
            self._active = fresh
            await trio.to_thread.run_sync(self._probe)
        await self._start_averager()
        await self.announce()
        self.statistics.moves += 1
        self._event(
            "moved",
            epoch=epoch,
            from_stage=source_stage,
            to_stage=target,
            hash=fresh.snapshot_hash.hex(),
        )
        return True

    async def _download(self, stage: int, servers: list[ServerAnnouncement]) -> _Active | None:
        """``stage`` built with the parameters of one of its servers, or None.

        Holders are tried fastest first, over ``DOWNLOAD_PASSES`` passes a second apart. The bytes
        must hash to the digest the holder names, and that digest must be either the one in its
        signed announcement or the majority digest the stage's servers published for that
        averaging round: a round that ends between the holder's announcement and our download
        serves a newer snapshot than the record names, which the published hashes vouch for."""
        holders = sorted(
            (a for a in servers if a.stage == stage and a.peer_id != self.me),
            key=lambda a: -a.throughput,
        )
        for attempt in range(DOWNLOAD_PASSES):
            if attempt:
                await trio.sleep(1.0)
            for holder in holders:
                fresh = await self._download_from(stage, holder)
                if fresh is not None:
                    return fresh
        return None

    async def _vouched(self, stage: int, round_number: int, digest: bytes) -> bool:
        """Whether the servers of ``stage`` published ``digest`` as round ``round_number``'s."""
        if round_number < 0:
            return False
        reader = Averager(self.node, AveragerConfig(run_id=self._stage_run_id(stage)))
        try:
            agreement = await reader.state_agreement(round_number)
        except P2PError:
            return False
        return agreement.majority == digest.hex()

    async def _download_from(self, stage: int, holder: ServerAnnouncement) -> _Active | None:
        try:
            with trio.fail_after(self.config.download_timeout_s):
                await self.node.reach(PeerID(holder.peer_id))
                round_number, digest, arrays = await fetch_params(
                    self.node.host, holder.peer_id, self.config.run_id, stage
                )
        except (P2PError, trio.TooSlowError) as exc:
            log.info("downloading stage %d from %s failed: %r", stage, holder.peer_id, exc)
            return None
        computed = await trio.to_thread.run_sync(param_digest, arrays)
        if computed != digest or (
            digest != holder.param_hash and not await self._vouched(stage, round_number, digest)
        ):
            log.warning("stage %d parameters from %s fail their hash", stage, holder)
            return None
        try:
            fresh = await trio.to_thread.run_sync(self._build_loaded, stage, arrays)
        except ValueError as exc:
            log.warning("stage %d parameters do not fit: %s", stage, exc)
            return None
        fresh.snapshot_round, fresh.snapshot_hash = round_number, digest
        return fresh

    def _build_loaded(self, stage: int, arrays: list[np.ndarray]) -> _Active:
        fresh = self._build(stage)
        fresh.load(arrays)
        fresh.snapshot = [np.array(a, dtype=np.float32) for a in arrays]
        return fresh

    def _event(self, kind: str, **fields: Any) -> None:
        event = {"event": kind, "peer": self.me.hex()[-12:], **fields}
        self.statistics.events.append(event)
        if self._on_event is not None:
            self._on_event(event)
