"""``swarmtrain local --pipeline-stages S``: SWARM parallelism on this machine.

Cuts the default model (``diloco.ByteTransformer``) into S stages (embedding + first blocks /
middle blocks / last blocks + head), or with ``--model-factory MODULE:FUNCTION`` a user's model
(``swarmtrain.pipeline.model``: S groups of layers balanced by parameter count; typing the flag
is the allowing), then runs, as separate processes on 127.0.0.1: a relay
(bootstrap and DHT), N stage servers (server i starts on stage i mod S) and 2 trainers that hold
the data and drive microbatches through the servers with stochastic wiring and failover. Servers
of a stage average their parameters every few seconds and move to the bottleneck stage when the
rebalancing rule says so. At the end it sums up, and ``--json`` writes
``{stages, servers_per_stage, loss_first, loss_last, stage_hashes_agree, rebalances, failovers}``.

Roles run through this module too (their code is ``swarmtrain.pipeline.roles``, which
``swarmtrain node`` runs for a pipeline run spec): ``python -m swarmtrain.pipeline.local
_server ...`` and ``_trainer ...`` print one JSON object per stdout line (``ready``,
``serving``, ``averaged``, ``moved``, ``round``, ``final``); the parent reads them. Every child
has a lifetime limit (``--lifetime-s``), runs in its own session, gets SIGINT when done and
SIGKILL after a grace period, so nothing outlives the command.

API: ``add_arguments(parser)`` adds the ``--pipeline-*`` options (the ``local`` parser already
has ``--peers``, ``--rounds``, ``--json`` and ``-v``); ``run(args) -> int`` runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from swarmtrain.commands import local
from swarmtrain.config import FACTORY_PATTERN
from swarmtrain.pipeline.model import ModelContractError
from swarmtrain.pipeline.progress import pipeline_status
from swarmtrain.pipeline.roles import (
    ServerSettings,
    TrainerSettings,
    check_model,
    cut_stages,
    model_config,
    serve,
    server_final,
    stage_builder,
    train,
)

# The model's cut and the status rows live in pipeline_roles / pipeline_progress (shared with
# ``swarmtrain node``); tests and bench.swarm import them from here too.
__all__ = [
    "Child",
    "PipelineFailed",
    "add_arguments",
    "cut_stages",
    "main",
    "model_config",
    "pipeline_status",
    "role_argv",
    "role_main",
    "run",
    "run_pipeline",
    "stage_builder",
    "start_relay",
    "stop_all",
    "summarize",
]

log = logging.getLogger(__name__)

SWARMTRAIN = (sys.executable, "-m", "swarmtrain.cli")
ROLE = (sys.executable, "-m", "swarmtrain.pipeline.local")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
TRAINERS = 2
AVERAGE_EVERY_S = 5.0


# -- roles (child processes) ---------------------------------------------------------------------


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps({**event, "at": round(time.time(), 3)}), flush=True)


def _node_config(join: str, identity: Path) -> Any:
    from p2p import HostConfig, NodeConfig, load_or_create_identity

    key_pair = load_or_create_identity(identity)
    return NodeConfig(
        HostConfig(key_pair, listen_addrs=("/ip4/127.0.0.1/tcp/0",)), bootstrap=(join,)
    )


def serve_role(opts: argparse.Namespace) -> int:
    """Serve ``--stage`` until SIGINT or ``--lifetime-s``; the ``final`` event at the end."""
    import torch
    import trio

    from p2p import open_node

    torch.set_num_threads(1)
    torch.manual_seed(0)
    settings = ServerSettings(
        run_id=opts.run_id,
        num_stages=opts.stages,
        shape=model_config(opts.stages, context=opts.context),
        seed=opts.seed,
        batch_size=opts.batch_size,
        sequence_length=opts.context,
        lr=opts.lr,
        average_every_s=opts.average_every_s or None,
        rebalance_every_s=opts.rebalance_every_s or None,
        rebalance_after_s=opts.rebalance_after_s,
        relayed=False,
        slow_stage=opts.slow_stage,
        slow_s=opts.slow_ms / 1000,
        machine_slow_s=opts.machine_slow_ms / 1000,
        model_factory=opts.model_factory,
    )
    try:
        check_model(settings)
    except ModelContractError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    holder: list[Any] = []

    async def main() -> None:
        config = _node_config(opts.join, opts.identity)
        with trio.move_on_after(opts.lifetime_s):
            async with open_node(config) as node, trio.open_nursery() as nursery:
                holder.append(await nursery.start(serve, node, settings, opts.stage, _emit))

    with suppress(KeyboardInterrupt):  # SIGINT from the parent: the normal way to stop
        trio.run(main)
    if holder:
        _emit(server_final(holder[0]))
    return 0


def train_role(opts: argparse.Namespace) -> int:
    """Train ``--rounds`` rounds of ``--microbatches`` (or rounds until ``--duration-s``)."""
    import torch
    import trio

    from p2p import open_node

    torch.set_num_threads(1)
    settings = TrainerSettings(
        run_id=opts.run_id,
        num_stages=opts.stages,
        batch_size=opts.batch_size,
        sequence_length=opts.context,
        rounds=opts.rounds,
        microbatches=opts.microbatches,
        data_seed=opts.seed,
        route_seed=opts.seed,
        in_flight=opts.in_flight,
        hop_timeout_s=opts.hop_timeout_s,
        duration_s=opts.duration_s,
        stop_on_failure=opts.stop_on_failure,
        wait_for_servers_s=START_TIMEOUT_S,
    )
    summary: dict[str, Any] = {}

    async def main() -> None:
        with trio.fail_after(opts.lifetime_s):
            async with open_node(_node_config(opts.join, opts.identity)) as node:
                summary.update(await train(node, settings, _emit))

    trio.run(main)
    _emit({"event": "final", **summary})
    return 0


def _role_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"pipeline_local {role}")
    p.add_argument("--join", required=True)
    p.add_argument("--identity", type=Path, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lifetime-s", type=float, default=600.0)
    if role == "_server":
        p.add_argument("--stage", type=int, required=True)
        p.add_argument("--model-factory", default="", help="MODULE:FUNCTION [default model]")
        p.add_argument("--lr", type=float, default=3e-3)
        p.add_argument("--average-every-s", type=float, default=AVERAGE_EVERY_S)
        p.add_argument("--rebalance-every-s", type=float, default=3.0)
        p.add_argument("--rebalance-after-s", type=float, default=8.0)
        p.add_argument("--slow-stage", type=int, default=None)
        p.add_argument("--slow-ms", type=float, default=0.0, help="delay per stage call")
        p.add_argument(
            "--machine-slow-ms", type=float, default=0.0, help="delay per call, any stage"
        )
    else:
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--microbatches", type=int, default=8)
        p.add_argument("--in-flight", type=int, default=2)
        p.add_argument("--hop-timeout-s", type=float, default=15.0)
        p.add_argument("--duration-s", type=float, default=0.0, help="train this long instead")
        p.add_argument("--stop-on-failure", action="store_true", help="no failover (bench)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def role_main(argv: Sequence[str]) -> int:
    role, rest = argv[0], argv[1:]
    opts = _role_parser(role).parse_args(rest)
    logging.basicConfig(
        level=logging.INFO if opts.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return serve_role(opts) if role == "_server" else train_role(opts)


# -- the orchestrator ----------------------------------------------------------------------------


class Child(local.Child):
    """A child whose stdout lines are JSON events: kept in ``events``, handed to ``on_event``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        on_event: Callable[[Child, dict[str, Any]], None],
    ) -> None:
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._ended = False  # stdout closed: the child exited (poll() may lag behind)
        self._on_event = on_event
        super().__init__(name, argv, log_path, self._on_line)

    def _on_line(self, text: str) -> None:
        line = text.strip()
        try:
            event = json.loads(line)
        except ValueError:
            event = {"event": "text", "text": line}
        if not isinstance(event, dict):
            event = {"event": "text", "text": line}
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()
        self._on_event(self, event)

    def _stdout_ended(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_event(self, kind: str, timeout_s: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if e.get("event") == kind), None)

        with self._changed:
            self._changed.wait_for(
                lambda: found() is not None or self._ended or self.proc.poll() is not None,
                timeout=timeout_s,
            )
            event = found()
        if event is None:
            raise PipelineFailed(
                f"{self.name}: no {kind!r} within {timeout_s:.0f} s; "
                f"log: {self.last_log_line() or 'none'}"
            )
        return event

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        super().stop(grace_s)


def stop_all(children: Sequence[Child], grace_s: float = STOP_GRACE_S) -> None:
    """Interrupt every child at once, then wait for each (their shutdowns overlap)."""
    for child in children:
        child.interrupt()
    for child in children:
        child.stop(grace_s)


class PipelineFailed(Exception):
    """The pipeline run did not finish: a process failed or the run timed out."""


def summarize(
    num_stages: int, servers: Sequence[Child], trainers: Sequence[Child]
) -> dict[str, Any]:
    """The ``--json`` summary from the children's events."""
    finals = [next((e for e in s.events if e.get("event") == "final"), None) for s in servers]
    per_stage = [0] * num_stages
    for server, final in zip(servers, finals, strict=True):
        stage = final.get("stage") if final else _last_stage(server)
        if isinstance(stage, int) and 0 <= stage < num_stages:
            per_stage[stage] += 1
    digests: dict[tuple[int, int], set[str]] = defaultdict(set)
    members: dict[tuple[int, int], int] = defaultdict(int)
    for server in servers:
        for e in server.events:
            if e.get("event") == "averaged":
                digests[(e["stage"], e["round"])].add(e["digest"])
                members[(e["stage"], e["round"])] += 1
    shared = [key for key in digests if members[key] >= 2]
    trainer_finals = [
        next((e for e in t.events if e.get("event") == "final"), {}) for t in trainers
    ]
    firsts = [f["losses"][0] for f in trainer_finals if f.get("losses")]
    lasts = [f["losses"][-1] for f in trainer_finals if f.get("losses")]
    return {
        "stages": num_stages,
        "servers_per_stage": per_stage,
        "loss_first": _mean(firsts),
        "loss_last": _mean(lasts),
        "stage_hashes_agree": bool(shared) and all(len(digests[k]) == 1 for k in digests),
        "averaging_rounds": len(shared),
        "rebalances": sum(1 for s in servers for e in s.events if e.get("event") == "moved"),
        "failovers": sum(int(f.get("failovers", 0)) for f in trainer_finals),
    }


def _of(child: Child, kind: str) -> list[dict[str, Any]]:
    return [e for e in list(child.events) if e.get("event") == kind]


def _last_stage(server: Child) -> int | None:
    stage = None
    for e in server.events:
        if e.get("event") == "serving":
            stage = e.get("stage")
        elif e.get("event") == "moved":
            stage = e.get("to_stage")
    return stage


def _mean(values: Sequence[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(numbers) / len(numbers) if numbers else None


def start_relay(workdir: Path, children: list[Child]) -> str:
    lines: queue.Queue[str] = queue.Queue()
    relay = Child(
        "relay",
        [
            *SWARMTRAIN,
            "relay",
            "--identity",
            str(workdir / "relay.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ],
        workdir / "relay.log",
        lambda child, event: lines.put(event.get("text", "")),
    )
    children.append(relay)
    try:
        return lines.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        raise PipelineFailed(f"the relay printed no address: {relay.last_log_line()}") from None


def role_argv(
    role: str, join: str, identity: Path, run_id: str, stages: int, extra: Sequence[str] = ()
) -> list[str]:
    return [
        *ROLE, role, "--join", join, "--identity", str(identity), "--run-id", run_id,
        "--stages", str(stages), *extra,
    ]  # fmt: skip


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
    except PipelineFailed as exc:
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
    print(
        f"{summary['stages']} stages, servers per stage {summary['servers_per_stage']} in "
        f"{summary['seconds']} s: loss {summary['loss_first']:.3f} -> "
        f"{summary['loss_last']:.3f} nats/byte, {hashes}, {summary['rebalances']} rebalances, "
        f"{summary['failovers']} failovers"
    )
    return 0


def run_pipeline(args: argparse.Namespace, emit: Callable[[str], None]) -> dict[str, Any]:
    stages = int(args.pipeline_stages or 2)
    peers = int(getattr(args, "peers", None) or 2 * stages)
    rounds = int(getattr(args, "rounds", None) or 3)
    microbatches = int(getattr(args, "pipeline_microbatches", 8))
    if stages < 1 or peers < stages:
        raise PipelineFailed(f"--peers {peers} cannot serve {stages} stages (one server each)")
    factory = str(getattr(args, "model_factory", "") or "")
    if factory and not re.fullmatch(FACTORY_PATTERN, factory):
        raise PipelineFailed(f"--model-factory {factory!r}: expected MODULE:FUNCTION")
    model = ["--model-factory", factory] if factory else []
    timeout_s = args.pipeline_timeout or 90.0 + rounds * microbatches * 3.0 * max(1, peers / 4)
    run_id = f"pipe-{os.urandom(4).hex()}"
    slow = []
    if args.pipeline_slow_stage is not None:
        slow = ["--slow-stage", str(args.pipeline_slow_stage)]
        slow += ["--slow-ms", str(args.pipeline_slow_ms)]
    verbose = ["-v"] if getattr(args, "verbose", False) else []
    lock = threading.Lock()

    def on_event(child: Child, event: dict[str, Any]) -> None:
        if event.get("event") in ("round", "moved", "averaged", "ready", "microbatch_failed"):
            with lock:
                emit(f"[{child.name}] {json.dumps(event)}")

    children: list[Child] = []
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swarm-pipe-")))
        stack.callback(lambda: stop_all(list(reversed(children))))
        join = start_relay(workdir, children)
        lifetime = ["--lifetime-s", str(timeout_s + 30)]
        servers = []
        for i in range(peers):
            argv = role_argv(
                "_server", join, workdir / f"server{i}.key", run_id, stages,
                ["--stage", str(i % stages), *model, *slow, *lifetime, *verbose],
            )  # fmt: skip
            servers.append(Child(f"server{i}", argv, workdir / f"server{i}.log", on_event))
        children.extend(servers)
        # Trainers start with the servers (they wait, bounded, until every stage is served):
        # importing torch and joining overlap.
        trainers = []
        for i in range(TRAINERS):
            argv = role_argv(
                "_trainer", join, workdir / f"trainer{i}.key", run_id, stages,
                ["--rounds", str(rounds), "--microbatches", str(microbatches), "--seed", str(i),
                 *lifetime, *verbose],
            )  # fmt: skip
            trainers.append(Child(f"trainer{i}", argv, workdir / f"trainer{i}.log", on_event))
        children.extend(trainers)
        for s in servers:
            s.wait_event("ready", START_TIMEOUT_S)
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
        # Servers average on clock epochs (every 5 s by default); a short run can end between
        # two. Wait for one more round on every server that shares its stage (one alone on its
        # stage has nobody to average with), so the summary shows the stages agree.
        where = [_last_stage(s) for s in servers]
        waited = [s for s, k in zip(servers, where, strict=True) if where.count(k) >= 2]
        counts = [len(_of(s, "averaged")) for s in waited]
        wait_until = time.monotonic() + 2 * AVERAGE_EVERY_S + 10
        while time.monotonic() < wait_until and any(
            len(_of(s, "averaged")) <= n for s, n in zip(waited, counts, strict=True)
        ):
            time.sleep(0.1)
        stop_all(servers)
        summary = summarize(stages, servers, trainers)
    summary["seconds"] = round(time.monotonic() - started, 1)
    json_path = getattr(args, "json", None)
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(summary) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_server", "_trainer"):
        return role_main(argv)
    parser = argparse.ArgumentParser(prog="python -m swarmtrain.pipeline.local")
    parser.add_argument("--peers", type=int, default=None, help="stage servers [2 per stage]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per trainer [3]")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
