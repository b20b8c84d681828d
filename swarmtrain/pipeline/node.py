"""``swarmtrain node`` on a pipeline run spec (``pipeline.stages > 0``): stage server or trainer.

``swarmtrain.commands.node.run_node`` fetches and verifies the spec, then hands its running node
(``PeerRuntime``) here (``swarmtrain local --pipeline-stages`` starts such nodes). The roles are
``swarmtrain.pipeline.roles``', with every setting from the spec (the hooks aside, below): the model
shape (``[model]``), the microbatch (``training.batch_size`` x ``training.sequence_length``), the
servers' learning rate (``training.inner_lr``), the trainer's rounds (``run.rounds`` of
``pipeline.microbatches``) and the servers' clock epochs (``pipeline.average_every_s``,
``pipeline.rebalance_every_s``). Every server builds the initial parameters from the run id's seed,
so the servers of a stage agree before they first average. A spec may name a user's model
(``[model] factory``): a server imports it only when its own ``--allow-model`` list names it
(``pipeline_model.check_allowed``), and builds and cuts it once before it joins, so a missing module
or a broken model is a one-line error. Trainers never import the model (they send bytes and read
logits), so they need no flag.

* A **server** starts on the stage with the fewest servers in the DHT records (ties broken by a
  hash of its peer id and the stage, so servers that start together spread out), then serves
  until Ctrl+C; rebalancing moves it later if another stage becomes the bottleneck. Servers that
  start together can still all read empty records and land on one stage, and rebalancing cannot
  fill a stage nobody serves (a move downloads the target stage's parameters from its servers).
  So every ``EMPTY_CHECK_S`` a server checks for an empty stage: if one looks empty on two reads
  in a row, one server of the most served stage (``empty_stage_move``: the same choice on every
  server) restarts there from the initial parameters, which are all an unserved stage has left.
* A **trainer** waits (bounded) until every stage has a server, trains its rounds and exits.

The roles report events (dicts); here they become lines for a human
(``swarmtrain.pipeline.lines``, which also reads them back for ``swarmtrain local
--pipeline-stages`` and the tests). The role runs as a task in the runtime's nursery; the
calling thread waits on an event it can be interrupted in, so Ctrl+C cancels the role
(shutdown is cancellation), prints a summary line and returns the summary marked ``stopped``
(``swarmtrain node`` writes its ``--json`` then).

``PipelineHooks`` are test and demo settings that are no part of a run spec (a server's starting
stage, a slowed stage, a trainer's microbatches in flight ...): ``swarmtrain node
--pipeline-hook KEY=VALUE``, hidden from ``--help``, as ``--cheat`` is for verified runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from p2p import Node, P2PError
from swarmtrain.config import RunConfig
from swarmtrain.metrics import Metrics
from swarmtrain.pipeline.lines import LINES, describe, format_loss
from swarmtrain.pipeline.model import check_allowed
from swarmtrain.pipeline.observe import observer_for
from swarmtrain.pipeline.progress import pipeline_status, servers_by_stage
from swarmtrain.pipeline.roles import (
    ServerSettings,
    TrainerSettings,
    check_model,
    serve,
    server_final,
    shape_of,
    train,
)
from swarmtrain.runtime import PeerRuntime
from swarmtrain.tracking import Tracker

ROLES = ("server", "trainer")
# A server's summary keeps its latest averaging rounds (the server keeps 256 events in all).
MAX_SUMMARY_AVERAGES = 128
# A server prints its counts this often (when they changed): its only sign of life when it is
# alone on its stage and never averages.
PROGRESS_EVERY_S = 15.0
EMPTY_CHECK_S = 3.0


@dataclass(frozen=True)
class PipelineHooks:
    """Settings for tests and demos that a run spec does not hold: ``None`` keeps the role's
    default. They shape one process only (where it starts, how slow it is, how it drives), never
    what the servers of a run must agree on (clock epochs, model, learning rate: the spec).

    A server: ``stage`` it starts on (no least-served choice, and no empty-stage restarts: the
    caller placed every server), ``slow_stage`` and ``slow_ms`` (a delay per call of that stage,
    ``--pipeline-slow-stage``), ``machine_slow_ms`` (a delay per call of any stage: a slower
    machine), ``rebalance_after_s`` (no move before this long after starting). A trainer:
    ``in_flight`` microbatches, ``hop_timeout_s``, ``duration_s`` (rounds until then instead of
    ``run.rounds``), ``stop_on_failure`` (no failover or retry: a fixed pipeline, bench.swarm).
    Either: ``lifetime_s``, after which it stops as on Ctrl+C, so that a server started by a
    program that died (``swarmtrain local``, a test) does not serve forever."""

    stage: int | None = None
    slow_stage: int | None = None
    slow_ms: float | None = None
    machine_slow_ms: float | None = None
    rebalance_after_s: float | None = None
    in_flight: int | None = None
    hop_timeout_s: float | None = None
    duration_s: float | None = None
    stop_on_failure: bool | None = None
    lifetime_s: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> PipelineHooks:
        """From ``KEY=VALUE`` items; raises ValueError for an unknown key or a bad value."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in items:
            key, sep, text = item.partition("=")
            kind = kinds.get(key.replace("-", "_"))
            if not sep or kind is None:
                names = ", ".join(kinds)
                raise ValueError(f"--pipeline-hook {item!r}: expected KEY=VALUE, KEY in {names}")
            try:
                if kind.startswith("bool"):
                    value: Any = {"1": True, "true": True, "0": False, "false": False}[text]
                else:
                    value = (int if kind.startswith("int") else float)(text)
            except (KeyError, ValueError):
                raise ValueError(f"--pipeline-hook {item!r}: bad value for {key}") from None
            if not isinstance(value, bool) and value < 0:
                raise ValueError(f"--pipeline-hook {item!r}: must not be negative")
            values[key.replace("-", "_")] = value
        return cls(**values)

    def argv(self) -> list[str]:
        """These hooks as ``swarmtrain node`` options."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out += ["--pipeline-hook", f"{f.name}={str(value).lower()}"]
        return out


def least_served(servers_per_stage: list[int], peer_id: bytes) -> int:
    """The stage a new server starts on: the fewest servers; among those, the first in an order
    that hashes our peer id, so servers that read the same records pick different stages."""

    def rank(stage: int) -> tuple[int, bytes]:
        tag = b"swarmtrain/stage-choice/1\x00" + peer_id + stage.to_bytes(2, "big")
        return servers_per_stage[stage], hashlib.sha256(tag).digest()

    return min(range(len(servers_per_stage)), key=rank)


def empty_stage_move(
    by_stage: list[list[bytes]], me: bytes, my_stage: int, epoch: int
) -> int | None:
    """The stage we restart on because nobody serves it, or None (the usual case).

    When a stage has no server, the most served stage (if it has two or more) gives up the one
    server that ranks first by sha256(epoch, peer id); it takes the lowest empty stage."""
    empty = [k for k, peers in enumerate(by_stage) if not peers]
    if not empty:
        return None
    donor = max(range(len(by_stage)), key=lambda k: (len(by_stage[k]), -k))
    if donor != my_stage or len(by_stage[donor]) < 2 or me not in by_stage[donor]:
        return None
    tag = b"swarmtrain/fill-stage/1\x00%d\x00" % epoch
    mover = min(by_stage[donor], key=lambda peer: hashlib.sha256(tag + peer).digest())
    return empty[0] if mover == me else None


async def wait_empty_stage(node: Node, run_id: str, num_stages: int, stage: int) -> int:
    """Until ``empty_stage_move`` names us; returns the stage to restart on."""
    me = node.host.peer_id.to_bytes()
    # A stage must look empty on two reads in a row (the second judged with the first's epoch,
    # so the same server is named): a missed or late announcement on a loaded machine is not an
    # empty stage, and restarting there would serve initial parameters beside trained ones.
    pending: tuple[int, int] | None = None  # (epoch, target) of a first read that named us
    while True:
        now = time.time()
        epoch = int(now // EMPTY_CHECK_S) + 1
        await trio.sleep(epoch * EMPTY_CHECK_S - now)
        by_stage = None
        with trio.move_on_after(EMPTY_CHECK_S), contextlib.suppress(P2PError):
            by_stage = await servers_by_stage(node.dht, run_id, num_stages)
        if by_stage is None:
            pending = None
        elif pending is None:
            target = empty_stage_move(by_stage, me, stage, epoch)
            pending = None if target is None else (epoch, target)
        elif empty_stage_move(by_stage, me, stage, pending[0]) == pending[1]:
            return pending[1]
        else:
            pending = None


async def choose_stage(node: Node, run_id: str, num_stages: int) -> int:
    """``least_served`` on the servers' records (none readable yet: every stage has 0)."""
    try:
        with trio.move_on_after(15):
            rows = await pipeline_status(node.dht, run_id, num_stages)
            return least_served([int(r["servers"]) for r in rows], node.host.peer_id.to_bytes())
    except P2PError:
        pass
    return least_served([0] * num_stages, node.host.peer_id.to_bytes())


def _hooked(settings: Any, **fields: Any) -> Any:
    """``settings`` with the hooks that are set (``fields``: hook value by settings field)."""
    return dataclasses.replace(settings, **{k: v for k, v in fields.items() if v is not None})


def server_settings(
    config: RunConfig, seed: int, hooks: PipelineHooks | None = None
) -> ServerSettings:
    hooks = hooks or PipelineHooks()
    settings = ServerSettings(
        run_id=config.run.id,
        num_stages=config.pipeline.stages,
        shape=shape_of(config),
        seed=seed,
        batch_size=config.training.batch_size,
        sequence_length=config.training.sequence_length,
        lr=config.training.inner_lr,
        average_every_s=config.pipeline.average_every_s,
        rebalance_every_s=config.pipeline.rebalance_every_s or None,
        progress_every_s=PROGRESS_EVERY_S,
        model_factory=config.model.factory,
    )
    return _hooked(
        settings,
        slow_stage=hooks.slow_stage,
        slow_s=None if hooks.slow_ms is None else hooks.slow_ms / 1000,
        machine_slow_s=None if hooks.machine_slow_ms is None else hooks.machine_slow_ms / 1000,
        rebalance_after_s=hooks.rebalance_after_s,
    )


def trainer_settings(
    config: RunConfig,
    seed: int,
    peer_id: bytes,
    wait_for_servers_s: float,
    hooks: PipelineHooks | None = None,
) -> TrainerSettings:
    hooks = hooks or PipelineHooks()
    settings = TrainerSettings(
        run_id=config.run.id,
        num_stages=config.pipeline.stages,
        batch_size=config.training.batch_size,
        sequence_length=config.training.sequence_length,
        rounds=config.run.rounds,
        microbatches=config.pipeline.microbatches,
        data_seed=seed,
        route_seed=int.from_bytes(hashlib.sha256(peer_id).digest()[:8], "big"),
        wait_for_servers_s=wait_for_servers_s,
    )
    return _hooked(
        settings,
        in_flight=hooks.in_flight,
        hop_timeout_s=hooks.hop_timeout_s,
        duration_s=hooks.duration_s,
        stop_on_failure=hooks.stop_on_failure,
    )


@dataclass
class PipelineSummary:
    """What a pipeline node did: a server's final counts and its latest averaging rounds (stage,
    round, digest, group: the servers of a stage agree when their digests of a round do), or a
    trainer's rounds, losses and microbatch counts."""

    role: str
    peer_id: str
    stopped: bool = False  # interrupted (Ctrl+C) rather than finished
    server: dict[str, Any] = field(default_factory=dict)  # server_final() + "averages"
    rounds: list[dict[str, Any]] = field(default_factory=list)  # the trainer's round events
    trained: dict[str, Any] = field(default_factory=dict)  # what roles.train() returned
    seconds: float = 0.0

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rounds if isinstance(r.get("loss"), float)]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "role": self.role,
            "peer_id": self.peer_id,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 1),
        }
        if self.role == "server":
            out.update({k: v for k, v in self.server.items() if k != "event"})
        else:
            losses = self.losses()
            out.update(
                {
                    "rounds": len(self.rounds),
                    "losses": [r.get("loss") for r in self.rounds],
                    "loss_first": losses[0] if losses else None,
                    "loss_last": losses[-1] if losses else None,
                    "microbatches": sum(int(r["microbatches"]) for r in self.rounds),
                    "failovers": self.rounds[-1]["failovers"] if self.rounds else 0,
                    "samples": self.trained.get("samples", 0),
                    "failed": self.trained.get("failed", 0),  # microbatch attempts
                    # with stop_on_failure: the failure that ended training
                    "gave_up": self.trained.get("stopped"),
                }
            )
        return out

    def done_line(self) -> str:
        head = "stopped" if self.stopped else "done"
        summary = self.to_json()
        if self.role == "server":
            s = self.server
            return (
                f"{head}: stage server, last on stage {s.get('stage')}, {s.get('forwards', 0)} "
                f"forwards, {s.get('backwards', 0)} backwards, {s.get('averaged_rounds', 0)} "
                f"averaged rounds ({s.get('failed_rounds', 0)} failed), {s.get('moves', 0)} moves"
            )
        return (
            f"{head}: trainer, {summary['rounds']} rounds, loss "
            f"{format_loss(summary['loss_first'])} -> {format_loss(summary['loss_last'])}, "
            f"{summary['microbatches']} microbatches, "
            f"{summary['failovers']} failovers in {summary['seconds']} s"
        )


def run_pipeline(
    runtime: PeerRuntime,
    config: RunConfig,
    role: str,
    *,
    seed: int,
    wait_for_servers_s: float,
    emit: Callable[[str], None],
    allow_models: Sequence[str] = (),
    hooks: PipelineHooks | None = None,
    metrics: Metrics | None = None,
    trackers: Sequence[Tracker] = (),
) -> PipelineSummary:
    """Run ``role`` on the runtime's node: a server until Ctrl+C, a trainer until its last round.
    ``metrics`` (``--metrics-port``) and ``trackers`` (``--log-to``) are fed the role's rounds
    and figures (``swarmtrain.pipeline.observe``).

    Returns the summary. On Ctrl+C once the role runs, the role is cancelled, the summary line
    is emitted and the summary returned with ``stopped`` set (the caller re-raises
    KeyboardInterrupt once it wrote the summary). Raises ``ModelRefused`` (a server, for a
    spec's model factory not in ``allow_models``) and ``ModelContractError`` (it cannot be
    imported or breaks the contract) before serving, ValueError for a hooked stage outside the
    run's; else what the role raised (``NoServers``, P2PError, ValueError), with the role
    already stopped."""
    hooks = hooks or PipelineHooks()
    node = runtime.node
    assert node is not None
    summary = PipelineSummary(role, str(node.host.peer_id))
    done = threading.Event()
    box: dict[str, Any] = {}
    began = time.monotonic()
    observer = observer_for(role, config.pipeline.stages, metrics, trackers, runtime.call_sync)

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "round":
            summary.rounds.append(event)
        if observer is not None:  # before the line: a scrape after it shows the event
            observer.on_event(event)
        line = describe(event)
        if line is not None:
            emit(line)

    if role == "server":
        settings = server_settings(config, seed, hooks)
        if config.model.factory:
            check_allowed(config.model.factory, allow_models, run_id=config.run.id)
            check_model(settings)
            emit(
                f"model {config.model.factory} (allowed by --allow-model) builds and cuts "
                f"into {config.pipeline.stages} stages"
            )
        pinned = hooks.stage
        if pinned is not None and not 0 <= pinned < config.pipeline.stages:
            raise ValueError(f"--pipeline-hook stage={pinned}: the run has stages 0 to "
                             f"{config.pipeline.stages - 1}")  # fmt: skip
        if pinned is None:
            stage = runtime.call(choose_stage, node, config.run.id, config.pipeline.stages)
            emit(f"stage server {node.host.peer_id} starting on stage {stage} (the least served)")
        else:
            stage = pinned
            emit(f"stage server {node.host.peer_id} starting on stage {stage} (pinned)")

        async def start_server(nursery: trio.Nursery, current: int) -> None:
            box["server"] = await nursery.start(serve, node, settings, current, on_event)
            if observer is not None:
                observer.serving(box["server"])

        async def work() -> None:
            current = stage
            if pinned is not None:  # placed by the caller: it serves no empty stage here
                async with trio.open_nursery() as nursery:
                    await start_server(nursery, current)
                return
            while True:
                async with trio.open_nursery() as nursery:
                    await start_server(nursery, current)
                    target = await wait_empty_stage(
                        node, config.run.id, settings.num_stages, current
                    )
                    nursery.cancel_scope.cancel()
                emit(LINES["restarting"].format(stage=target))
                current = target
    else:
        emit(f"trainer {node.host.peer_id}: waiting until every stage has a server")
        trainer = trainer_settings(
            config, seed, node.host.peer_id.to_bytes(), wait_for_servers_s, hooks
        )

        async def work() -> None:
            box["trained"] = await train(node, trainer, on_event)

    async def service(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await work()
        except Exception as exc:  # handed to the caller's thread; the runtime lives on
            box["error"] = exc
        finally:
            done.set()

    runtime.start(service)
    until = None if hooks.lifetime_s is None else began + hooks.lifetime_s
    try:
        while not done.wait(0.5):
            if until is not None and time.monotonic() > until:
                emit(f"lifetime of {hooks.lifetime_s:.0f} s (--pipeline-hook) is over: stopping")
                raise KeyboardInterrupt  # the one way a role stops: as on Ctrl+C
    except KeyboardInterrupt:
        runtime.close()  # cancels the role: the server stops serving, the trainer its round
        summary.stopped = True
        _finish(summary, box, began)
        emit(summary.done_line())
        return summary
    _finish(summary, box, began)
    if "error" in box:
        raise box["error"]
    return summary


def _finish(summary: PipelineSummary, box: dict[str, Any], began: float) -> None:
    summary.seconds = time.monotonic() - began
    summary.trained = box.get("trained", {})
    if "server" in box:
        server = box["server"]
        averages = [
            {k: e[k] for k in ("stage", "round", "digest", "group")}
            for e in list(server.statistics.events)
            if e.get("event") == "averaged"
        ]
        summary.server = {**server_final(server), "averages": averages[-MAX_SUMMARY_AVERAGES:]}
