"""``swarmtrain node``: the volunteer. Join a run, then train with DiLoCo or serve a pipeline.

One process is one peer: a p2p node with the swarm averager in a background thread
(``swarmtrain.runtime.PeerRuntime``), and the torch work in the main thread. Before anything
trains, the node fetches the run spec from the coordinator named in ``--join`` and checks the
coordinator's signature (``swarmtrain.commands.coordinator.fetch_spec``): the model, the seed, H
and the number of rounds all come from the spec. A DiLoCo run's rounds are
``swarmtrain.training.loop``; a pipeline run's roles are ``swarmtrain.pipeline.node``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import trio

import swarm
from diloco import load_stdlib_corpus
from p2p import (
    HostConfig,
    NodeConfig,
    PeerID,
    load_or_create_identity,
    peer_id_of,
    subkey_values,
)
from swarmtrain.admission import (
    REFRESH_S,
    TOKEN_TTL_S,
    Admission,
    base64_token_bytes,
    own_problem,
)
from swarmtrain.commands.coordinator import coordinator_of, fetch_spec
from swarmtrain.commands.export import save_spec
from swarmtrain.config import FACTORY_PATTERN, RunConfig, run_seed_of, with_base
from swarmtrain.faults import NO_FAULTS, Faults
from swarmtrain.keys import admissions_key
from swarmtrain.membership.state_sync import StateServer
from swarmtrain.metrics import Metrics, RoundSample
from swarmtrain.paths import make_folder
from swarmtrain.pipeline.model import check_allowed
from swarmtrain.pipeline.node import ROLES, PipelineHooks, PipelineSummary, run_pipeline
from swarmtrain.runspec import RunSpec
from swarmtrain.runtime import PeerRuntime
from swarmtrain.tracking import Tracker
from swarmtrain.training.loop import NodeSummary, averager_config, train
from swarmtrain.training.ranks import LocalRanks
from swarmtrain.training.ranks_plan import check_fsdp, check_nproc, check_run, threads_per_rank
from swarmtrain.training.workload import build_model, check_data, load_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeOptions:
    join: tuple[str, ...]
    state_dir: Path
    identity: Path | None = None  # default: state_dir / "identity.key"
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    threads: int | None = None
    device: str = "auto"  # auto | cpu | cuda: where the inner steps run
    json_path: Path | None = None
    # How long a node behind the swarm waits for the next round boundary before it syncs anyway;
    # for a pipeline trainer, how long it waits for every stage to have a server.
    join_wait_s: float = 120.0
    # A pipeline run's role: "server" (the default there) or "trainer"; refused for DiLoCo runs.
    role: str | None = None
    # Model factories ("module:function") a pipeline spec may make this node import (a server).
    allow_models: tuple[str, ...] = ()
    # A verified run's cheater, for tests and demos (``--cheat``, ``--cheat-reduce``, hidden
    # from --help): handed to the averager and the verification, nowhere else.
    faults: Faults = NO_FAULTS
    # A pipeline node's test and demo settings (``--pipeline-hook KEY=VALUE``, hidden).
    pipeline_hooks: PipelineHooks | None = None
    # A token run's join token (``swarmtrain coordinator token``), as text.
    token: str | None = None
    # Local data-parallel ranks of the inner phase (``--nproc-per-node``): this process is
    # rank 0, the swarm peer; it spawns the others (``swarmtrain.training.ranks``).
    nproc_per_node: int = 1
    # ``--fsdp``: those ranks shard the model (FSDP2) instead of each holding a replica.
    fsdp: bool = False
    # ``--metrics-port``: fed the node's rounds and sampled from its p2p node; None: off.
    metrics: Metrics | None = None
    # ``--log-to``: experiment trackers fed the same rounds (``swarmtrain.tracking``).
    trackers: tuple[Tracker, ...] = ()
    # ``--data-dir``: the folder the spec's relative paths (data files, tokenizer, pretrained
    # weights) are read from, this node's copy of the run.toml's folder (``config.with_base``);
    # the command line checked it is a folder (``swarmtrain.cli._path_options``).
    data_dir: Path = Path(".")

    def __post_init__(self) -> None:
        if not self.join:
            raise ValueError("--join is required: the coordinator's address (…/p2p/ID)")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        for factory in self.allow_models:
            if not re.fullmatch(FACTORY_PATTERN, factory):
                raise ValueError(f"--allow-model {factory!r}: expected MODULE:FUNCTION")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.fsdp and self.nproc_per_node < 2:
            raise ValueError(
                "--fsdp shards the model across the node's local ranks: it needs "
                f"--nproc-per-node 2 or more, got {self.nproc_per_node}"
            )


def _admit(
    config: RunConfig,
    coordinator: PeerID,
    runtime: PeerRuntime,
    options: NodeOptions,
    emit: Callable[[str], None],
) -> Admission:
    """Check that we are a member of a permissioned run (ValueError naming why not), store our
    token (a token run), and from now on read only the members' entries of the run's keys."""
    admission = Admission(config, coordinator)
    if admission.open:
        return admission
    problem = own_problem(admission, runtime.peer_id, options.token, time.time())
    if problem is not None and not options.faults.ignore_admission:
        raise ValueError(problem)
    runtime.admits = admission.admits_id
    if admission.mode == "token":
        key = admissions_key(config.run.id)
        node = runtime.node
        assert node is not None

        async def refresh() -> None:
            records = await node.dht.get_records(key, latest=True)
            values = subkey_values(records, now=time.time())
            found = {str(PeerID(records[s].owner)): v for s, v in values.items()}
            admission.refresh(found, time.time())

        async def keep_fresh(*, task_status: trio.TaskStatus[None]) -> None:
            task_status.started()
            stored = -float("inf")
            while True:
                if options.token and time.monotonic() - stored > TOKEN_TTL_S / 2:
                    data = base64_token_bytes(options.token)
                    with contextlib.suppress(Exception):
                        await node.dht.store(key, data, time.time() + TOKEN_TTL_S)
                        stored = time.monotonic()
                with contextlib.suppress(Exception):
                    await refresh()
                await trio.sleep(REFRESH_S)

        if options.token:
            runtime.store(key, base64_token_bytes(options.token), TOKEN_TTL_S)
        runtime.call(refresh)
        runtime.start(keep_fresh)
    emit(f"run {config.run.id} admits {admission.mode} members only; this peer is one")
    return admission


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else the CPU. Raises ValueError for ``cuda``
    without one (before anything joins or trains), or for an unknown name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (use cpu or auto)")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def run_node(options: NodeOptions, emit: Callable[[str], None]) -> NodeSummary | PipelineSummary:
    """Fetch the run spec, catch up with the swarm, train until DiLoCo's round reaches the
    spec's ``rounds``; ``emit`` gets one progress line per round. For a pipeline spec, run a
    stage server (until Ctrl+C) or, with ``role="trainer"``, a trainer
    (``swarmtrain.pipeline.node``). Returns the summary (also written to ``options.json_path``).
    KeyboardInterrupt propagates after the node is closed (the last round boundary's checkpoint
    is on disk); a pipeline role interrupted writes its summary first (how a stage server
    ends). Raises SpecRefused (the spec is unsigned or tampered with), P2PError when the node
    cannot join or reach the coordinator, ValueError (before anything trains) for data whose
    fingerprint is not the spec's or too small, a model that cannot be built or does not fit the
    data (``training.workload``), for a checkpoint of another config or a
    ``role`` on a DiLoCo run, RuntimeError when the agreed state cannot be downloaded or a
    pipeline stage has no server."""
    device = resolve_device(options.device)
    nproc = options.nproc_per_node
    check_nproc(
        nproc, device.type, cuda_devices=torch.cuda.device_count(), cpus=os.cpu_count() or 1
    )
    if nproc > 1:
        # K ranks share what one process would use: --threads, else torch's default.
        torch.set_num_threads(threads_per_rank(options.threads, nproc, torch.get_num_threads()))
    elif options.threads:
        torch.set_num_threads(options.threads)
    make_folder(options.state_dir, "--state-dir")
    key_pair = load_or_create_identity(options.identity or options.state_dir / "identity.key")
    coordinator = coordinator_of(options.join[0])
    node_config = NodeConfig(
        HostConfig(key_pair, listen_addrs=options.listen), bootstrap=options.join
    )
    # The stdlib corpus (seconds of reading and hashing the standard library) does not depend on
    # the spec: load it while the node joins and fetches the spec, so a joiner is ready sooner
    # (a run on a user's files reads those once the spec names them).
    loader = ThreadPoolExecutor(1, thread_name_prefix="corpus")
    corpus = loader.submit(load_stdlib_corpus)
    loader.shutdown(wait=False)
    log.info("joining via %s", options.join[0])
    runtime = PeerRuntime(node_config)
    if options.metrics is not None:
        options.metrics.watch_node(runtime.node, runtime.call_sync)
    summary: NodeSummary | PipelineSummary
    ranks: LocalRanks | None = None
    try:
        node = runtime.node
        assert node is not None
        log.info("joined; fetching the run spec from coordinator %s", str(coordinator)[-8:])
        spec: RunSpec = runtime.call(fetch_spec, node, coordinator)
        # The spec's relative paths, as this node finds them (the spec itself is kept as
        # signed: ``save_spec`` below).
        config = with_base(spec.config, options.data_dir)
        # Before the node takes part in anything: data that is not the run's (another Python's
        # standard library, other files) is refused with one line, exit status 1.
        local_data = corpus.result() if config.data.kind == "stdlib" else load_data(config)
        check_data(config, local_data)
        check_run(nproc, config)  # a pipeline or verified run refuses several local ranks
        if options.fsdp:
            check_fsdp(nproc, config)
        if config.is_pipeline:
            summary = _run_pipeline(options, config, runtime, coordinator, emit)
        else:
            if options.role is not None:
                raise ValueError(
                    f"--role {options.role}: run {config.run.id} is a DiLoCo run "
                    "(pipeline.stages = 0), where every node trains the whole model; "
                    "run the node without --role"
                )
            emit(
                f"run {config.run.id}: spec signed by coordinator {str(coordinator)[-8:]} "
                f"verified; {config.run.rounds} rounds, H={config.training.inner_steps}"
            )
            # So is a model that cannot be built or does not fit the data, and a user's model
            # this node's operator did not allow (a spec alone never makes a node import code).
            check_allowed(config.model.factory, options.allow_models, run_id=config.run.id)
            model = build_model(config, local_data.vocab_size)
            what = (
                f"{config.model.factory} (allowed by --allow-model)"
                if config.model.factory
                else config.model.kind
            )
            emit(
                f"model {what}: {sum(p.numel() for p in model.parameters()):,} "
                f"parameters; data {config.data.kind}: {len(local_data.train):,} training "
                f"tokens, fingerprint {local_data.fingerprint[:12]} as the spec's"
            )
            save_spec(options.state_dir, spec)  # what ``swarmtrain export`` rebuilds
            admission = _admit(config, coordinator, runtime, options, emit)
            admit = None if admission.open else admission.admits
            if nproc > 1:
                # Spawned now, so they load the data and build the model while we join.
                ranks = LocalRanks(
                    config, runtime.peer_id.to_bytes(), nproc, device, torch.get_num_threads(),
                    fsdp=options.fsdp,
                )  # fmt: skip
                sharding = ", sharding the model (FSDP2)" if options.fsdp else ""
                emit(
                    f"{nproc} local ranks ({device.type}){sharding}: this process is rank 0, "
                    "the peer"
                )
            averager = swarm.Averager(
                node,
                dataclasses.replace(averager_config(config, coordinator), admit=admit),
                faults=options.faults,
            )
            runtime.start(averager.run)
            server = StateServer(node, config.run.id, admit=admit)
            runtime.call_sync(server.install)
            summary = train(
                config,
                model,
                runtime,
                averager,
                server,
                local_data,
                device,
                emit,
                coordinator,
                state_dir=options.state_dir,
                join_wait_s=options.join_wait_s,
                faults=options.faults,
                ranks=ranks,
                on_round=_round_observers(options),
            )
            summary.peer_id = str(peer_id_of(key_pair))
    except Exception as exc:
        # A rank that died breaks rank 0's collective with a transport error: name the rank.
        failed = ranks.failed_rank() if ranks is not None else ""
        if failed:
            raise RuntimeError(failed) from exc
        raise
    finally:
        if ranks is not None:
            ranks.close()
        runtime.close()
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(summary.to_json()) + "\n")
    if isinstance(summary, PipelineSummary) and summary.stopped:
        raise KeyboardInterrupt
    return summary


def _round_observers(options: NodeOptions) -> Callable[[RoundSample], None] | None:
    """What each finished round is told to: the metrics and every tracker; None: nothing."""
    observers = [t.observe_round for t in options.trackers]
    if options.metrics is not None:
        observers.append(options.metrics.observe_round)
    if not observers:
        return None

    def observe(sample: RoundSample) -> None:
        for observer in observers:
            observer(sample)

    return observe


def _run_pipeline(
    options: NodeOptions,
    config: RunConfig,
    runtime: PeerRuntime,
    coordinator: PeerID,
    emit: Callable[[str], None],
) -> PipelineSummary:
    role = options.role or "server"
    emit(
        f"run {config.run.id}: spec signed by coordinator {str(coordinator)[-8:]} verified; "
        f"pipeline of {config.pipeline.stages} stages, {config.run.rounds} trainer rounds of "
        f"{config.pipeline.microbatches} microbatches; this node: {role}"
    )
    if options.device == "cuda":
        log.warning("--device cuda: pipeline roles run on the CPU")
    return run_pipeline(
        runtime,
        config,
        role,
        seed=run_seed_of(config.run.id),
        wait_for_servers_s=options.join_wait_s,
        emit=emit,
        allow_models=options.allow_models,
        hooks=options.pipeline_hooks,
        metrics=options.metrics,
        trackers=options.trackers,
    )
