"""``swarmtrain local --pipeline-stages S``: SWARM parallelism on this machine, the product's way.

Writes a pipeline run config (``run.toml``, what ``swarmtrain init`` writes with ``[pipeline]
stages = S``, ``microbatches``, ``run.rounds`` and, for ``--model-factory MODULE:FUNCTION``,
``[model] factory`` set; the model is a small ``diloco.ByteTransformer`` of max(S, 2) blocks),
then runs, as separate processes on 127.0.0.1, exactly what volunteers run
(``swarmtrain.commands.local``'s child-process helpers, as the DiLoCo ``swarmtrain local``):

* ``swarmtrain coordinator --config run.toml``: the signed spec, bootstrap, DHT, relay;
* N ``swarmtrain node`` stage servers (server i pinned to stage i mod S, and with
  ``--pipeline-slow-stage`` slowed there, through the hidden ``--pipeline-hook`` option;
  ``--allow-model`` for a user's model);
* 2 ``swarmtrain node --role trainer`` that train ``--rounds`` rounds of microbatches.

It reads what those commands show anyone: their stdout lines (``swarmtrain.pipeline.lines``'
``read_line``: which stage a server serves, its averaging rounds) while they run, and their
``--json`` summaries at the end (a stage server writes its own on SIGINT, how it stops: its
stage, moves and the digests of its latest averaging rounds; a trainer its losses and
failovers). ``--json`` writes ``{stages, servers_per_stage, loss_first, loss_last,
stage_hashes_agree, averaging_rounds, rebalances, failovers, seconds}``. Every child runs in its
own session, gets SIGINT when done and SIGKILL after a grace period, and stops by itself a
minute after our deadline (the ``lifetime_s`` hook), so nothing outlives us.

API: ``add_arguments(parser)`` adds the ``--pipeline-*`` options (the ``local`` parser already
has ``--peers``, ``--rounds``, ``--json`` and ``-v``); ``run(args) -> int`` runs it. The pieces
(``pipeline_config``, ``start_node``, ``Child``, ``stop_all``, ``summarize``) also serve the
pipeline integration tests and ``bench.swarm``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from swarmtrain.commands import local
from swarmtrain.config import FACTORY_PATTERN, RunConfig, config_from_mapping
from swarmtrain.pipeline.lines import read_line
from swarmtrain.pipeline.node import PipelineHooks

__all__ = [
    "Child",
    "PipelineFailed",
    "add_arguments",
    "combine",
    "main",
    "pipeline_config",
    "run",
    "run_pipeline",
    "start_node",
    "stop_all",
    "summarize",
]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
TRAINERS = 2
AVERAGE_EVERY_S = 5.0
REBALANCE_EVERY_S = 3.0
CONTEXT = 32  # bytes per sequence, and the model's context


class PipelineFailed(local.LocalFailed):
    """The pipeline run did not finish: a process failed or the run timed out."""


def pipeline_config(
    run_id: str,
    stages: int,
    rounds: int,
    microbatches: int,
    *,
    factory: str = "",
    lr: float = 3e-3,
    average_every_s: float = AVERAGE_EVERY_S,
    rebalance_every_s: float = REBALANCE_EVERY_S,
) -> RunConfig:
    """The run spec of a local pipeline: ``swarmtrain init``'s defaults with the pipeline set and
    a model small enough for a laptop (``roles.model_config(stages, context=32)``'s shape)."""
    return config_from_mapping(
        {
            "run": {"id": run_id, "rounds": rounds},
            "model": {
                "d_model": 64, "n_layers": max(stages, 2), "n_heads": 4, "context": CONTEXT,
                "factory": factory,
            },
            "training": {"batch_size": 8, "sequence_length": CONTEXT, "inner_lr": lr},
            "pipeline": {
                "stages": stages, "microbatches": microbatches,
                "average_every_s": average_every_s, "rebalance_every_s": rebalance_every_s,
            },
        }
    )  # fmt: skip


class Child(local.Child):
    """A ``swarmtrain node`` of a pipeline run: its stdout lines (``lines``), those that show an
    event as the event (``events``, ``read_line``'s dicts plus ``at``, when the line arrived),
    each line also handed to ``on_line``; its ``--json`` summary once it exited (``summary()``)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        summary_path: Path | None = None,
        on_line: Callable[[Child, str], None] | None = None,
    ) -> None:
        self.lines: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.summary_path = summary_path
        self._changed = threading.Condition()
        self._ended = False  # stdout closed: the child exited (poll() may lag behind)
        self._forward = on_line
        super().__init__(name, argv, log_path, self._on_line)

    def _on_line(self, line: str) -> None:
        event = read_line(line)
        with self._changed:
            self.lines.append(line)
            if event is not None:
                self.events.append({**event, "at": time.time()})
            self._changed.notify_all()
        if self._forward is not None:
            self._forward(self, line)

    def _stdout_ended(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of ``kind`` so far."""
        with self._changed:
            return [e for e in self.events if e["event"] == kind]

    def stage(self) -> int | None:
        """The stage this server serves, as its lines tell (None before it serves)."""
        stage = None
        for e in self.of("serving") + self.of("moved") + self.of("restarting"):
            stage = e["to_stage"] if e["event"] == "moved" else e["stage"]
        return stage if isinstance(stage, int) else None

    def wait_event(self, kind: str, timeout_s: float) -> dict[str, Any]:
        """The first event of ``kind``; raises PipelineFailed when the child exits or
        ``timeout_s`` passes first."""

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if e["event"] == kind), None)

        with self._changed:
            self._changed.wait_for(
                lambda: found() is not None or self._ended or self.proc.poll() is not None,
                timeout=timeout_s,
            )
            event = found()
        if event is None:
            raise PipelineFailed(
                f"{self.name}: no {kind!r} line within {timeout_s:.0f} s; "
                f"log: {self.last_log_line() or 'none'}"
            )
        return event

    def summary(self) -> dict[str, Any] | None:
        """The ``--json`` summary the node wrote when it ended, or None (none, or killed)."""
        if self.summary_path is None:
            return None
        try:
            data = local.read_summary(self.summary_path)
        except local.LocalFailed:
            return None
        return dict(data)


def start_node(
    name: str,
    workdir: Path,
    join: str,
    *,
    threads: int = 1,
    extra: Sequence[str] = (),
    verbose: bool = False,
    program: Sequence[str] = local.SWARMTRAIN,
    on_line: Callable[[Child, str], None] | None = None,
) -> Child:
    """``swarmtrain node --join JOIN`` (``program``: another entry point to the same CLI, such
    as a test's fault hook) with its state in ``workdir / name``, its log in ``name.log``."""
    node_dir = workdir / name
    argv = local.node_argv(join, node_dir, threads, verbose=verbose, extra=extra, program=program)
    return Child(name, argv, workdir / f"{name}.log", node_dir / "summary.json", on_line)


def stop_all(children: Sequence[local.Child], grace_s: float = local.STOP_GRACE_S) -> None:
    """Interrupt every child at once, then wait for each (their shutdowns overlap; a node's
    takes seconds, more on a loaded machine, and a server writes its summary at the end)."""
    for child in children:
        child.interrupt()
    for child in children:
        child.stop(grace_s)


def combine(
    num_stages: int, servers: Sequence[Mapping[str, Any]], trainers: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The ``--json`` summary (without ``seconds``) from the nodes' ``--json`` summaries."""
    per_stage = [0] * num_stages
    digests: dict[tuple[int, int], set[str]] = defaultdict(set)
    members: dict[tuple[int, int], int] = defaultdict(int)
    for server in servers:
        stage = server.get("stage")
        if isinstance(stage, int) and 0 <= stage < num_stages:
            per_stage[stage] += 1
        for average in server.get("averages") or ():
            key = (average["stage"], average["round"])
            digests[key].add(average["digest"])
            members[key] += 1
    # A round only one server of its stage reported shows nothing about agreement.
    shared = [key for key in digests if members[key] >= 2]
    firsts = [t["losses"][0] for t in trainers if t.get("losses")]
    lasts = [t["losses"][-1] for t in trainers if t.get("losses")]
    return {
        "stages": num_stages,
        "servers_per_stage": per_stage,
        "loss_first": _mean(firsts),
        "loss_last": _mean(lasts),
        "stage_hashes_agree": bool(shared) and all(len(digests[k]) == 1 for k in digests),
        "averaging_rounds": len(shared),
        "rebalances": sum(int(s.get("moves") or 0) for s in servers),
        "failovers": sum(int(t.get("failovers") or 0) for t in trainers),
    }


def summarize(
    num_stages: int, servers: Sequence[Child], trainers: Sequence[Child]
) -> dict[str, Any]:
    """``combine`` over the summaries the children wrote (a server killed wrote none)."""
    return combine(
        num_stages,
        [s for s in (c.summary() for c in servers) if s is not None],
        [t for t in (c.summary() for c in trainers) if t is not None],
    )


def _mean(values: Sequence[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(numbers) / len(numbers) if numbers else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--pipeline-*`` options of ``swarmtrain local``."""
    parser.add_argument(
        "--pipeline-stages", type=int, default=None, metavar="S",
        help="cut the model into S stages served by --peers stage servers, plus 2 trainers",
    )  # fmt: skip
    parser.add_argument(
        "--model-factory", default="", metavar="MODULE:FUNCTION",
        help="with --pipeline-stages: train the nn.Sequential this function returns instead of "
        "the default model (docs/pipelines.md; it must be importable here) [default model]",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-microbatches", type=int, default=8, metavar="M",
        help="microbatches per trainer per round [8]",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-slow-stage", type=int, default=None, metavar="K",
        help="make stage K slower on every server (to watch rebalancing)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-slow-ms", type=float, default=100.0, metavar="MS",
        help="delay per call of --pipeline-slow-stage, on every server that serves it [100]",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-timeout", type=float, default=None, metavar="SECONDS",
        help="give up after this long [scaled with rounds]",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the local pipeline swarm; 0 when it trained, 1 on failure (message on stderr)."""
    try:
        summary = run_pipeline(args, lambda line: print(line, flush=True))
    except local.LocalFailed as exc:
        print(f"swarmtrain local --pipeline-stages: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    rounds = summary["averaging_rounds"]
    hashes = (
        "no averaging round finished"
        if not rounds
        else f"stage hashes {'agree' if summary['stage_hashes_agree'] else 'DIFFER'} "
        f"over {rounds} averaging rounds"
    )
    losses = (
        f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} nats/byte"
        if summary["loss_first"] is not None and summary["loss_last"] is not None
        else "no loss reported"
    )
    print(
        f"{summary['stages']} stages, servers per stage {summary['servers_per_stage']} in "
        f"{summary['seconds']} s: {losses}, {hashes}, {summary['rebalances']} rebalances, "
        f"{summary['failovers']} failovers"
    )
    return 0


def run_pipeline(args: argparse.Namespace, emit: Callable[[str], None]) -> dict[str, Any]:
    """Run it to the end; the summary (also written to ``args.json``). Raises PipelineFailed
    (LocalFailed when the coordinator does not start)."""
    stages = int(args.pipeline_stages or 2)
    peers = int(getattr(args, "peers", None) or 2 * stages)
    rounds = int(getattr(args, "rounds", None) or 3)
    microbatches = int(getattr(args, "pipeline_microbatches", 8))
    if stages < 1 or peers < stages:
        raise PipelineFailed(f"--peers {peers} cannot serve {stages} stages (one server each)")
    factory = str(getattr(args, "model_factory", "") or "")
    if factory and not re.fullmatch(FACTORY_PATTERN, factory):
        raise PipelineFailed(f"--model-factory {factory!r}: expected MODULE:FUNCTION")
    timeout_s = args.pipeline_timeout or 90.0 + rounds * microbatches * 3.0 * max(1, peers / 4)
    try:
        config = pipeline_config(
            f"pipe-{os.urandom(4).hex()}", stages, rounds, microbatches, factory=factory
        )
    except ValueError as exc:  # ConfigError: e.g. more stages than blocks
        raise PipelineFailed(str(exc)) from exc
    slow_stage = getattr(args, "pipeline_slow_stage", None)
    slow_ms = getattr(args, "pipeline_slow_ms", 100.0) if slow_stage is not None else None
    allow = ["--allow-model", factory] if factory else []
    verbose = bool(getattr(args, "verbose", False))
    threads = max(1, (os.cpu_count() or 1) // (peers + TRAINERS))
    # Nodes stop by themselves a while after our deadline, should we die without stopping them.
    lifetime_s = timeout_s + 60
    lock = threading.Lock()

    def show(child: Child, line: str) -> None:
        with lock:
            emit(f"[{child.name}] {line}")

    children: list[local.Child] = []  # the coordinator, then the nodes
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swarm-pipe-")))
        # Registered after the temporary directory, so children stop before it is removed.
        stack.callback(lambda: stop_all(list(reversed(children))))
        dashboard = local.dashboard_flags(getattr(args, "dashboard_port", None))
        join = local.start_coordinator(workdir, config, children, emit, dashboard)
        emit(f"run {config.run.id}: {peers} stage servers and {TRAINERS} trainers join {join}")
        servers = []
        for i in range(peers):
            hooks = PipelineHooks(
                stage=i % stages, slow_stage=slow_stage, slow_ms=slow_ms, lifetime_s=lifetime_s
            )
            server = start_node(
                f"server{i}", workdir, join, threads=threads, extra=[*hooks.argv(), *allow],
                verbose=verbose, on_line=show,
            )  # fmt: skip
            servers.append(server)
            children.append(server)
        # Trainers start with the servers (they wait, bounded, until every stage is served):
        # importing torch and joining overlap.
        trainers = []
        for i in range(TRAINERS):
            trainer = start_node(
                f"trainer{i}", workdir, join, threads=threads,
                extra=["--role", "trainer", *PipelineHooks(lifetime_s=lifetime_s).argv()],
                verbose=verbose, on_line=show,
            )  # fmt: skip
            trainers.append(trainer)
            children.append(trainer)
        for s in servers:
            s.wait_event("serving", START_TIMEOUT_S)
        deadline = started + timeout_s
        for t in trainers:
            try:
                t.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise PipelineFailed(
                    f"{t.name} still running after {timeout_s:.0f} s: {t.last_log_line()}"
                ) from None
            if t.proc.returncode != 0:
                raise PipelineFailed(f"{t.name} exited {t.proc.returncode}: {t.last_log_line()}")
        _wait_one_more_average(servers)
        stop_all(servers)
        summary = summarize(stages, servers, trainers)
        if summary["loss_first"] is None:
            raise PipelineFailed(f"the trainers wrote no losses: {trainers[0].last_log_line()}")
    summary["seconds"] = round(time.monotonic() - started, 1)
    json_path = getattr(args, "json", None)
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(summary) + "\n")
    return summary


def _wait_one_more_average(servers: Sequence[Child]) -> None:
    """Servers average on clock epochs (every 5 s by default); a short run can end between two.
    Wait (bounded) for one more round on every server that shares its stage (one alone on its
    stage has nobody to average with), so the summary shows whether the stages agree."""
    where = [s.stage() for s in servers]
    waited = [s for s, k in zip(servers, where, strict=True) if where.count(k) >= 2]
    counts = [len(s.of("averaged")) for s in waited]
    until = time.monotonic() + 2 * AVERAGE_EVERY_S + 10
    while time.monotonic() < until and any(
        len(s.of("averaged")) <= n for s, n in zip(waited, counts, strict=True)
    ):
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmtrain.pipeline.local")
    parser.add_argument("--peers", type=int, default=None, help="stage servers [2 per stage]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per trainer [3]")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
