"""``swarmtrain coordinator``: create a run, sign its spec, and serve as the run's public helper.

The coordinator is a relay-role node (bootstrap, DHT server, circuit relay hop, dial-back
reachability service, exactly what ``swarmtrain relay`` runs) that also answers
``/swarmtrain/runspec/1`` with the run spec and its signature. It does not train. Its peer id is
in the join address it prints, so a volunteer who runs the printed command knows whose signature
to demand; ``fetch_spec`` is that check, on the volunteer's side.

Output on stdout, nothing else there: the run line, then the exact command volunteers run; for
a pipeline run (``pipeline.stages > 0``) two commands: a stage server's, then a trainer's
(``--role trainer``). A verified run (``verify.rate > 0``) also prints each dispute and verdict
and each audit that found a part wrong (``swarmtrain.verified.referee``). With
``--dashboard-port`` it serves a live web page of the run (``swarmtrain.dashboard``), fed by
``read_run`` every second, and prints ``dashboard at URL`` right after the run line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.crypto.keys import KeyPair

from p2p import (
    Host,
    Message,
    Node,
    P2PError,
    PeerID,
    call_unary,
    join_addr,
    join_address_problem,
    message,
    open_node,
    serve_unary,
    subkey_values,
)
from swarmtrain.commands.relay import RelayOptions, keep_serving, relay_node_config
from swarmtrain.config import RunConfig, run_seed_of
from swarmtrain.dashboard.history import Reading, RunHistory, RunInfo
from swarmtrain.dashboard.options import DashboardListener
from swarmtrain.dashboard.server import Dashboard
from swarmtrain.keys import progress_key
from swarmtrain.membership.plan import best_state
from swarmtrain.membership.progress import Progress, decode_all
from swarmtrain.pipeline.progress import pipeline_status, trainer_progress
from swarmtrain.runspec import MAX_SIGNATURE_BYTES, MAX_SPEC_BYTES, RunSpec, sign_spec, verify_spec
from swarmtrain.verified.referee import RefereeService

log = logging.getLogger(__name__)

SPEC_PROTOCOL = "/swarmtrain/runspec/1"
SPEC_TIMEOUT_S = 10.0
PROGRESS_LOG_S = 10.0


@message(403, max_bytes=64)
class RunSpecRequest(Message):
    version: int


@message(404, max_bytes=MAX_SPEC_BYTES + MAX_SIGNATURE_BYTES + 64)
class RunSpecReply(Message):
    spec: bytes
    signature: bytes


def serve_spec(host: Host, spec: bytes, signature: bytes) -> None:
    """Answer every ``RunSpecRequest`` with these bytes (handler failures are the RPC layer's:
    logged, never fatal)."""

    async def handle(peer: PeerID, request: RunSpecRequest) -> RunSpecReply:
        return RunSpecReply(spec, signature)

    serve_unary(host, SPEC_PROTOCOL, RunSpecRequest, handle)


def coordinator_of(join: str) -> PeerID:
    """The peer id at the end of a join address: the identity the run spec must be signed by."""
    problem = join_address_problem(join)
    if problem is not None:
        raise P2PError(f"bad --join address {join!r}: {problem}")
    return PeerID.from_base58(multiaddr.Multiaddr(join).value_for_protocol("p2p"))


async def fetch_spec(node: Node, coordinator: PeerID) -> RunSpec:
    """The run spec from ``coordinator``, verified against its peer id.

    Raises SpecRefused (unsigned, tampered with, issued by someone else, malformed) or P2PError
    (the coordinator cannot be reached or serves no spec, e.g. a plain relay)."""
    try:
        await node.reach(coordinator)
        reply = await call_unary(
            node.host,
            coordinator,
            SPEC_PROTOCOL,
            RunSpecRequest(1),
            RunSpecReply,
            deadline_s=SPEC_TIMEOUT_S,
        )
    except P2PError as exc:
        raise P2PError(
            f"no run spec from {coordinator} (is --join a coordinator's address?): {exc}"
        ) from exc
    return verify_spec(reply.spec, reply.signature, coordinator)


@dataclass(frozen=True)
class CoordinatorOptions:
    config: RunConfig
    relay: RelayOptions
    dashboard: DashboardListener | None = None  # --dashboard-port: bound before the loop


def new_run_id() -> str:
    return f"run-{os.urandom(4).hex()}"


MAX_REMEMBERED_RUNS = 64


def pick_run_id(config: RunConfig, config_path: Path | None, memory: Path) -> tuple[RunConfig, str]:
    """``config`` with a run id, and a warning line ("" when none). ``[run] id = ""`` gets a
    fresh one; ``memory`` (beside the coordinator's identity) remembers the last id picked per
    config file, so a coordinator restarted on the same file says that its nodes' checkpoints
    belong to another run now, and how to continue that one instead."""
    if config.run.id:
        return config, ""
    picked = new_run_id()
    if config_path is None:
        return config.replace(run={"id": picked}), ""
    try:
        seen = json.loads(memory.read_text())
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    key = str(config_path.resolve())
    previous = seen.pop(key, None)
    seen[key] = picked
    with contextlib.suppress(OSError):  # a read-only home loses the warning, not the run
        kept = dict(list(seen.items())[-MAX_REMEMBERED_RUNS:])
        memory.write_text(json.dumps(kept, indent=1) + "\n")
    warning = ""
    if isinstance(previous, str):
        warning = (
            f"warning: {config_path} sets no [run] id, so this start is a new run, {picked}; the "
            f"last start on it was {previous}, whose nodes will not join this one. To continue "
            f'that run, set id = "{previous}" under [run] in {config_path} and restart'
        )
    return config.replace(run={"id": picked}), warning


async def run_coordinator(
    key_pair: KeyPair, options: CoordinatorOptions, emit: Callable[[str], None]
) -> None:
    """Run until cancelled (Ctrl+C). ``emit`` gets the run line, then the join command."""
    config = options.config
    if not config.run.id:  # the CLI picks it (pick_run_id); a library caller may not
        config = config.replace(run={"id": new_run_id()})
    async with open_node(relay_node_config(key_pair, options.relay)) as node:
        spec = RunSpec(config, str(node.host.peer_id), time.time())
        data, signature = sign_spec(spec, key_pair)
        serve_spec(node.host, data, signature)
        metrics = options.relay.metrics
        if metrics is not None:
            metrics.watch_node(node)
        join = join_addr(node)
        lines = join_lines(config, str(node.host.peer_id), join)
        async with trio.open_nursery() as nursery:
            referee = None
            if config.verify.rate > 0:
                referee = RefereeService(node, config, run_seed_of(config.run.id), emit)
                if metrics is not None:
                    metrics.watch_referee(referee)
            if options.dashboard is not None:
                info = RunInfo(
                    config.run.id,
                    hashlib.sha256(data).hexdigest(),
                    str(node.host.peer_id),
                    config.run.rounds,
                    config.pipeline.stages,
                    config.verify.rate,
                    config.swarm.state_quorum,
                )
                dashboard = Dashboard(
                    RunHistory(info), lambda: read_run(node, config, referee), options.dashboard
                )
                # The run line first (scripts read it there), the command(s) to copy last.
                lines.insert(1, f"dashboard at {await nursery.start(dashboard.run)}")
            for line in lines:
                emit(line)
            for addr in node.host.addrs()[1:]:
                log.info("also reachable at %s", addr)
            nursery.start_soon(keep_serving, node, options.relay.status_interval_s)
            if config.is_pipeline:
                nursery.start_soon(_log_stages, node, config, PROGRESS_LOG_S)
            else:
                nursery.start_soon(_log_progress, node, config, PROGRESS_LOG_S)
            if referee is not None:
                nursery.start_soon(referee.run)


async def read_progress(dht: Any, run_id: str) -> list[Progress]:
    """Every peer's latest progress record, malformed ones skipped; raises P2PError when the
    read fails."""
    records = await dht.get_records(progress_key(run_id), latest=True)
    values = subkey_values(records, now=time.time())
    return decode_all({str(PeerID(records[k].owner)): v for k, v in values.items()})


async def read_run(node: Node, config: RunConfig, referee: RefereeService | None) -> Reading:
    """What the dashboard shows, read now: progress (or a pipeline's stages and trainers), the
    referee's verdicts, and how we are connected to each peer. Raises P2PError."""
    now = time.time()
    verdicts = tuple(referee.verdicts) if referee is not None else ()
    if config.is_pipeline:
        stages = await pipeline_status(node.dht, config.run.id, config.pipeline.stages)
        trainers = await trainer_progress(node.dht, config.run.id)
        return Reading(now, trainers=trainers, stages=tuple(stages), verdicts=verdicts)
    progress = await read_progress(node.dht, config.run.id)
    links = {}
    for p in progress:
        kind = node.host.connection_kind(PeerID.from_base58(p.peer_id))
        if kind is not None:
            links[p.peer_id] = kind
    return Reading(now, progress=tuple(progress), verdicts=verdicts, links=links)


def join_lines(config: RunConfig, coordinator: str, join: str) -> list[str]:
    """The run line, then the command(s) volunteers run."""
    if not config.is_pipeline:
        return [
            f"run {config.run.id}: {config.run.rounds} rounds, H={config.training.inner_steps}, "
            f"model {config.model.kind}, data {config.data.kind} (fingerprint "
            f"{config.data.fingerprint or 'none'}"
            + (
                f", pretrained {config.model.pretrained_sha256[:16]}"
                if config.model.pretrained
                else ""
            )
            + f"), spec signed by {coordinator}",
            f"swarmtrain node --join {join}",
        ]
    # A stage server imports a user's model only when it names it itself (--allow-model).
    model = (
        f"model {config.model.factory} (servers need it installed), "
        if config.model.factory
        else ""
    )
    allow = f" --allow-model {config.model.factory}" if config.model.factory else ""
    return [
        f"run {config.run.id}: pipeline of {config.pipeline.stages} stages, {model}"
        f"{config.run.rounds} trainer rounds of {config.pipeline.microbatches} microbatches, spec "
        f"signed by {coordinator}; stage servers run the first command, trainers the second",
        f"swarmtrain node --join {join}{allow}",
        f"swarmtrain node --join {join} --role trainer",
    ]


async def _log_stages(node: Node, config: RunConfig, interval_s: float) -> None:
    """The coordinator's view of its pipeline run, in its log: servers and capacity per stage."""
    last = None
    while True:
        await trio.sleep(interval_s)
        try:
            rows = await pipeline_status(node.dht, config.run.id, config.pipeline.stages)
        except P2PError as exc:
            log.info("could not read the pipeline's servers: %s", exc)
            continue
        servers = [int(r["servers"]) for r in rows]
        if servers == last:
            continue
        last = servers
        log.info(
            "run %s: servers per stage %s, capacity %s samples/s",
            config.run.id,
            servers,
            [round(float(r["capacity"]), 1) for r in rows],
        )


async def _log_progress(node: Node, config: RunConfig, interval_s: float) -> None:
    """The coordinator's view of its run, in its log: round, peers, loss (what status shows:
    the state a joiner would adopt, ``plan.best_state``)."""
    run_id = config.run.id
    last = None
    while True:
        await trio.sleep(interval_s)
        try:
            progress = await read_progress(node.dht, run_id)
        except P2PError as exc:
            log.info("could not read the run's progress: %s", exc)
            continue
        agreed = best_state(progress, config.run.rounds, config.swarm.state_quorum)
        if agreed is None or agreed.round == last:
            continue
        last = agreed.round
        losses = [
            p.loss for p in progress if p.round == agreed.round and p.peer_id in agreed.holders
        ]
        log.info(
            "run %s: round %d agreed by %d peers (state %s), mean loss %.3f",
            run_id,
            agreed.round,
            len(agreed.holders),
            agreed.state_hash.hex()[:12],
            sum(losses) / len(losses),
        )
