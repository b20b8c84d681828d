"""The two roles of a SWARM pipeline run, which ``swarmtrain node`` runs for a run spec with
``pipeline.stages > 0`` (``swarmtrain.pipeline.node``; ``swarmtrain local --pipeline-stages``
starts such nodes).

* The model: ``diloco.ByteTransformer`` of a given ``ByteTransformerConfig``, cut into S stages
  (embedding + first blocks / middle blocks / last blocks + head), or a user's model
  (``[model] factory``: ``swarmtrain.pipeline.model``) cut into S groups of layers balanced by
  parameter count; ``stage_builder`` builds stage k with the same seeded parameters on every
  server.
* ``serve``: a ``swarm.StageServer`` on a running node, until cancelled.
* ``train``: a ``swarm.PipelineTrainer`` that drives ``rounds`` rounds of ``microbatches``
  microbatches through the servers, retrying a failed microbatch, and publishes each round's
  figures (``swarmtrain.pipeline.progress``) for ``swarmtrain status``.

Both report what happens as event dicts (``{"event": "averaged", ...}``) to an ``emit`` callback:
``swarmtrain node`` turns them into lines for a human (``swarmtrain.pipeline.node.describe``).
Torch and the model are imported inside the functions: importing this module stays cheap for the
CLI.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from p2p import Node
from swarmtrain.config import RunConfig
from swarmtrain.pipeline.progress import TrainerProgress, publish_trainer_progress

if TYPE_CHECKING:
    from diloco import ByteTransformerConfig
    from swarm.pipeline.server import StageServer

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]

MICROBATCH_ATTEMPTS = 4


# -- the model, cut into stages -----------------------------------------------------------------


def model_config(num_stages: int, d_model: int = 64, context: int = 64) -> ByteTransformerConfig:
    """The small model ``swarmtrain local --pipeline-stages`` cuts (max(S, 2) blocks)."""
    from diloco import ByteTransformerConfig

    return ByteTransformerConfig(
        d_model=d_model, n_layers=max(num_stages, 2), n_heads=4, context=context
    )


def shape_of(config: RunConfig) -> ByteTransformerConfig:
    """The model a run spec names (``[model]``): what DiLoCo nodes train whole and pipeline
    servers cut into ``pipeline.stages`` stages."""
    from diloco import ByteTransformerConfig

    return ByteTransformerConfig(
        d_model=config.model.d_model,
        n_layers=config.model.n_layers,
        n_heads=config.model.n_heads,
        context=config.model.context,
    )


def cut_stages(model: Any, num_stages: int) -> list[Any]:
    """``ByteTransformer`` as ``num_stages`` modules whose composition is the model's forward:
    embeddings + first blocks / middle blocks / last blocks + final norm + head. Raises
    ValueError when there are fewer blocks than stages."""
    import torch
    from torch import nn

    blocks = list(model.blocks)
    if not 1 <= num_stages <= len(blocks):
        raise ValueError(f"{num_stages} stages for {len(blocks)} blocks")
    bounds = [round(i * len(blocks) / num_stages) for i in range(num_stages + 1)]

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.position = model.embed, model.position

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(idx.shape[1], device=idx.device)
            return self.embed(idx) + self.position(positions)

    class Stage(nn.Module):
        def __init__(self, first: bool, last: bool, part: list[nn.Module]) -> None:
            super().__init__()
            self.embedding = Embed() if first else None
            self.blocks = nn.ModuleList(part)
            self.ln_final = model.ln_final if last else None
            self.head = model.head if last else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.embedding is not None:
                x = self.embedding(x)
            for block in self.blocks:
                x = block(x)
            if self.head is not None:
                x = self.head(self.ln_final(x))
            return x

    return [
        Stage(k == 0, k == num_stages - 1, blocks[bounds[k] : bounds[k + 1]])
        for k in range(num_stages)
    ]


def _slowed(module: Any, delay_s: float) -> Any:
    """``module`` that also sleeps ``delay_s`` per call: a slower machine, as the stage server
    measures it (the sleep happens in its worker thread). A fixed delay rather than a multiple
    of the compute time, so the slowdown does not depend on the machine's load."""
    import torch
    from torch import nn

    class Slowed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(delay_s)
            return self.inner(x)

    return Slowed()


def stage_builder(
    num_stages: int,
    *,
    seed: int,
    batch_size: int,
    context: int,
    lr: float,
    shape: ByteTransformerConfig | None = None,
    factory: str = "",
    slow_stage: int | None = None,
    slow_s: float = 0.0,
    machine_slow_s: float = 0.0,
) -> Callable[[int], Any]:
    """``build_stage(k)`` for ``StageServer``: every call builds the same seeded parameters.

    ``shape`` is the whole model's (default: ``model_config(num_stages, context=context)``);
    ``factory`` (``"module:function"``, already allowed) replaces it with a user's model;
    ``context`` is the length of the sequences trainers send (the probe's example input)."""
    model_shape = shape if shape is not None else model_config(num_stages, context=context)

    def build(k: int) -> Any:
        import torch

        from diloco import ByteTransformer
        from swarm.pipeline.server import StageModule
        from swarmtrain.pipeline.model import cut_model

        if factory:
            stages, examples = cut_model(
                factory, seed, num_stages, batch_size=batch_size, context=context
            )
            module, example = stages[k], examples[k]
        else:
            model = ByteTransformer(model_shape, seed=seed)
            module = cut_stages(model, num_stages)[k]
            if k == 0:
                example = torch.zeros(batch_size, context, dtype=torch.int64)
            else:
                example = torch.zeros(batch_size, context, model.config.d_model)
        # A slow stage (every server that serves it) and a slow machine (whatever it serves).
        delay_s = (slow_s if slow_stage == k else 0.0) + machine_slow_s
        if delay_s > 0:
            module = _slowed(module, delay_s)
        return StageModule(module, example, lambda params: torch.optim.Adam(params, lr=lr))

    return build


# -- stage server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """What a stage server needs; ``average_every_s`` and ``rebalance_every_s`` must be equal on
    every server of a run (they are clock epochs), so they come from the run spec or the parent."""

    run_id: str
    num_stages: int
    shape: ByteTransformerConfig
    seed: int  # of the initial parameters: the same on every server
    batch_size: int
    sequence_length: int
    lr: float
    average_every_s: float | None = 5.0  # None: never average
    rebalance_every_s: float | None = 3.0  # None: never move
    rebalance_after_s: float = 8.0
    relayed: bool | None = None  # None: decided from our reachability
    slow_stage: int | None = None
    slow_s: float = 0.0
    machine_slow_s: float = 0.0
    progress_every_s: float | None = None  # a "progress" event this often, when counts moved
    model_factory: str = ""  # "module:function": a user's model instead of ``shape``


def check_model(settings: ServerSettings) -> None:
    """Build and cut a user's model once (nothing for the default model), so a server that
    cannot import it, or whose model breaks the contract, fails before it joins the stages.
    Raises ``pipeline_model.ModelContractError``."""
    if settings.model_factory:
        from swarmtrain.pipeline.model import cut_model

        cut_model(
            settings.model_factory,
            settings.seed,
            settings.num_stages,
            batch_size=settings.batch_size,
            context=settings.sequence_length,
        )


def new_server(node: Node, settings: ServerSettings, stage: int, emit: Emit) -> StageServer:
    """A ``StageServer`` for ``stage``; its ``averaged`` events also carry the forward and
    backward counts so far. Raises ValueError for a stage outside the run's."""
    from swarm.pipeline.server import StageServer, StageServerConfig

    build = stage_builder(
        settings.num_stages,
        seed=settings.seed,
        batch_size=settings.batch_size,
        context=settings.sequence_length,
        lr=settings.lr,
        shape=settings.shape,
        factory=settings.model_factory,
        slow_stage=settings.slow_stage,
        slow_s=settings.slow_s,
        machine_slow_s=settings.machine_slow_s,
    )
    config = StageServerConfig(
        run_id=settings.run_id,
        num_stages=settings.num_stages,
        average_every_s=settings.average_every_s,
        rebalance_every_s=settings.rebalance_every_s,
        rebalance_after_s=settings.rebalance_after_s,
        relayed=settings.relayed,
    )
    box: list[StageServer] = []

    def on_event(event: dict[str, Any]) -> None:
        if box and event.get("event") == "averaged":
            stats = box[0].statistics
            event = {**event, "forwards": stats.forwards, "backwards": stats.backwards}
        emit(event)

    server = StageServer(node, config, build, stage, on_event=on_event)
    box.append(server)
    return server


def server_final(server: StageServer) -> dict[str, Any]:
    """The ``final`` event of a server: where it ended and what it did."""
    stats = server.statistics
    return {
        "event": "final",
        "stage": server.stage,
        "forwards": stats.forwards,
        "backwards": stats.backwards,
        "moves": stats.moves,
        "averaged_rounds": stats.averaged_rounds,
        "failed_rounds": stats.failed_rounds,
    }


async def serve(
    node: Node,
    settings: ServerSettings,
    stage: int,
    emit: Emit,
    *,
    task_status: trio.TaskStatus[StageServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``stage`` until cancelled; started (``nursery.start``) with the server once it
    serves, after emitting ``ready``. Raises what ``StageServer.run`` raises."""
    server = new_server(node, settings, stage, emit)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        emit({"event": "ready", "peer": node.host.peer_id.to_bytes().hex()})
        if settings.progress_every_s:
            nursery.start_soon(_report_progress, server, settings.progress_every_s, emit)
        task_status.started(server)


async def _report_progress(server: StageServer, every_s: float, emit: Emit) -> None:
    def counts() -> tuple[int, ...]:
        stats = server.statistics
        return (server.stage, stats.forwards, stats.backwards, stats.averaged_rounds, stats.moves)

    last = counts()
    while True:
        await trio.sleep(every_s)
        now = counts()
        if now != last:
            last = now
            emit(
                {
                    **server_final(server),
                    "event": "progress",
                    "throughput": round(server.throughput(), 2),
                }
            )


# -- trainer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerSettings:
    """What a trainer needs. Its batches are ``inner_batches(run_seed=data_seed, peer_id=ours)``:
    trainers of a run draw different data without agreeing on anything."""

    run_id: str
    num_stages: int
    batch_size: int
    sequence_length: int
    rounds: int
    microbatches: int
    data_seed: int
    route_seed: int | None = None  # the router's draws; None: random
    in_flight: int = 2
    hop_timeout_s: float = 15.0
    duration_s: float = 0.0  # > 0: rounds until this many seconds, instead of ``rounds``
    stop_on_failure: bool = False  # a fixed pipeline (bench.swarm): no failover, no retry
    wait_for_servers_s: float = 60.0
    corpus_bytes: int = 1 << 20  # the first MiB of the standard library's source


class NoServers(RuntimeError):
    """Some stage had no server within ``wait_for_servers_s``."""


async def train(node: Node, settings: TrainerSettings, emit: Emit) -> dict[str, Any]:
    """Train, emitting ``ready``, a ``round`` event per round and ``microbatch_failed`` per failed
    attempt (both with the hop failures so far by kind: ``swarm.pipeline.trainer``'s
    ``hop_failure_kind``). Returns ``{losses (mean per round, None for a round with none done),
    failovers, failed, samples, seconds, stopped?}``. Raises NoServers, P2PError."""
    import torch
    from torch.nn import functional as F

    from diloco import load_stdlib_corpus
    from swarm.pipeline.trainer import PipelineTrainer, TrainerConfig

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    corpus = await trio.to_thread.run_sync(
        lambda: load_stdlib_corpus(max_bytes=settings.corpus_bytes)
    )
    config = TrainerConfig(
        run_id=settings.run_id,
        num_stages=settings.num_stages,
        seed=settings.route_seed,
        hop_timeout_s=settings.hop_timeout_s,
        max_attempts_per_hop=1 if settings.stop_on_failure else 8,
    )
    trainer = PipelineTrainer(node, config, loss_fn)
    async with trio.open_nursery() as nursery:
        await nursery.start(trainer.run)
        with trio.move_on_after(settings.wait_for_servers_s):
            await trainer.wait_for_servers()
        per_stage = trainer.servers_per_stage()
        if min(per_stage) == 0:
            raise NoServers(
                f"stage {per_stage.index(0)} has no server after "
                f"{settings.wait_for_servers_s:.0f} s (servers per stage {per_stage})"
            )
        emit({"event": "ready", "servers_per_stage": per_stage})
        summary = await _train_rounds(node, trainer, settings, corpus, emit)
        nursery.cancel_scope.cancel()
    return summary


async def _train_rounds(
    node: Node, trainer: Any, settings: TrainerSettings, corpus: Any, emit: Emit
) -> dict[str, Any]:
    from diloco import inner_batches
    from swarm.pipeline.trainer import MicrobatchFailed

    summary: dict[str, Any] = {"losses": [], "failovers": 0, "failed": 0, "samples": 0}
    me = node.host.peer_id.to_bytes()

    async def one(
        batch: tuple[Any, Any], losses: list[float], paths: list[tuple[bytes, ...]],
        limit: trio.Semaphore,
    ) -> None:  # fmt: skip
        async with limit:
            for attempt in range(MICROBATCH_ATTEMPTS):
                if "stopped" in summary:
                    return
                try:
                    result = await trainer.train_microbatch(*batch)
                except MicrobatchFailed as exc:
                    summary["failed"] += 1
                    emit(
                        {
                            "event": "microbatch_failed",
                            "attempt": attempt,
                            "reason": str(exc),
                            "hop_failures": dict(trainer.statistics.hop_failures),
                        }
                    )
                    if settings.stop_on_failure:
                        summary["stopped"] = str(exc)
                        return
                    await trainer.refresh()
                    await trio.sleep(0.5 * (attempt + 1))
                    continue
                losses.append(result.loss)
                paths.append(result.path)
                return

    began = time.monotonic()
    round_number = 0
    while "stopped" not in summary:
        if settings.duration_s and time.monotonic() - began >= settings.duration_s:
            break
        if not settings.duration_s and round_number >= settings.rounds:
            break
        started = time.monotonic()
        batches = inner_batches(
            corpus,
            run_seed=settings.data_seed,
            round=round_number,
            peer_id=me,
            steps=settings.microbatches,
            batch_size=settings.batch_size,
            context=settings.sequence_length,
        )
        losses: list[float] = []
        paths: list[tuple[bytes, ...]] = []  # each finished microbatch's server per stage
        limit = trio.Semaphore(settings.in_flight)
        async with trio.open_nursery() as round_nursery:
            for batch in batches:
                round_nursery.start_soon(one, batch, losses, paths, limit)
        seconds = time.monotonic() - started
        loss = sum(losses) / len(losses) if losses else None
        summary["losses"].append(loss)
        summary["failovers"] = trainer.statistics.failovers
        summary["samples"] += len(losses) * settings.batch_size
        summary["seconds"] = round(time.monotonic() - began, 3)
        samples_per_s = len(losses) * settings.batch_size / seconds
        stats = trainer.statistics
        emit(
            {
                "event": "round",
                "round": round_number,
                "loss": loss,
                "microbatches": len(losses),
                "seconds": round(seconds, 2),
                "samples_per_s": round(samples_per_s, 2),
                "tokens_per_s": samples_per_s * settings.sequence_length,
                "failovers": stats.failovers,
                "servers_per_stage": trainer.servers_per_stage(),
                # How many servers this round's microbatches went through, per stage (those
                # that did each stage's backward: after a failover, the one that took over).
                "route_servers_per_stage": [
                    len({path[k] for path in paths}) for k in range(settings.num_stages)
                ],
                "hops": stats.hops,
                "hop_failures": dict(stats.hop_failures),
            }
        )
        progress = TrainerProgress(
            round_number, loss, len(losses), samples_per_s, summary["failovers"], time.time()
        )
        await publish_trainer_progress(node, settings.run_id, progress)
        round_number += 1
    summary["seconds"] = round(time.monotonic() - began, 3)
    return summary
