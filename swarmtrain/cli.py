"""``swarmtrain``: the command line.

    swarmtrain id       [--identity PATH]
    swarmtrain relay    [--identity PATH] [--listen MULTIADDR ...] [--announce MULTIADDR ...]
    swarmtrain doctor   [--identity PATH] [--listen MULTIADDR ...] [--join MULTIADDR ...]
                        [--ping PEER_ID ...] [--linger SECONDS] [--json]
    swarmtrain init     [PATH]
    swarmtrain coordinator [--config run.toml] [--rounds R] [--identity PATH] [--listen MA ...]
                        [--announce MA ...] [--dashboard-port PORT [--dashboard-host HOST]]
    swarmtrain node     --join MULTIADDR [--role server|trainer] [--state-dir DIR]
                        [--device auto|cpu|cuda] [--json PATH] [--listen MULTIADDR ...]
                        [--allow-model MODULE:FUNCTION ...] [--nproc-per-node K [--fsdp]]
    swarmtrain status   --join MULTIADDR [--json] [--probe]
    swarmtrain local    [--config run.toml] [--peers N] [--rounds R] [--inner-steps H]
                        [--workdir DIR] [--json PATH] [--nproc-per-node K] [--dashboard-port PORT]
                        [--pipeline-stages S [--pipeline-slow-stage K]
                         [--model-factory MODULE:FUNCTION] ...]
    swarmtrain verify   [--steps S] [--model-config PATH] [--cheat-step K --cheat-op J]
                        [--threads T] [--json]
    swarmtrain export   --state-dir DIR --out DIR [--json PATH]

Progress and problems go to stderr as log lines; results go to stdout. Ctrl+C stops cleanly
(exit status 130); SIGTERM (systemd, ``docker stop``) stops the same way, with the same cleanup
and line, and exit status 143 (128 + 15, what a shell reports for a process SIGTERM ended). A
failure prints one line that names its cause and exits with status 1; a bad address or path
option is refused before the command writes, imports or dials anything (``_run``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib.metadata
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import NoReturn

import trio
from libp2p.crypto.keys import KeyPair

from p2p import (
    MAX_WORK_BITS,
    IdentityError,
    P2PError,
    PeerID,
    create_identity,
    default_identity_path,
    identity_work,
    join_address_problem,
    listen_address_problem,
    load_or_create_identity,
    peer_id_of,
    peer_id_problem,
)
from swarmtrain.cli_help import describe
from swarmtrain.commands import verify as verify_cmd
from swarmtrain.commands.doctor import DoctorOptions, DoctorReport, format_report, run_doctor
from swarmtrain.commands.local import LocalFailed, LocalOptions, run_local
from swarmtrain.commands.local_progress import LocalProgress
from swarmtrain.commands.relay import RelayOptions, run_relay
from swarmtrain.config import ConfigError, RunConfig, default_toml, load_config, with_base
from swarmtrain.dashboard.options import add_dashboard_arguments
from swarmtrain.dashboard.options import options_from as dashboard_options_from
from swarmtrain.faults import Faults, parse_task_fault
from swarmtrain.host_memory import release_large_blocks
from swarmtrain.metrics import Metrics, add_metrics_arguments, options_from
from swarmtrain.paths import Use, path_problem, plain_os_error
from swarmtrain.pipeline import local as pipeline_local
from swarmtrain.runspec import SpecRefused
from swarmtrain.tracking import Tracker, open_trackers

log = logging.getLogger("swarmtrain")


def _add_common(
    parser: argparse.ArgumentParser, *, listen_default: str, identity_default: str | None = None
) -> None:
    where = identity_default or str(default_identity_path())
    parser.add_argument(
        "--identity",
        type=Path,
        default=None,
        help=f"Ed25519 key file, created (mode 0600) if absent [{where}]",
    )
    parser.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="MULTIADDR",
        help=f"address to listen on, repeatable [{listen_default}]",
    )
    parser.add_argument(
        "--upnp",
        action="store_true",
        help="ask the home router for a UPnP port mapping (adds about 4 s when none answers)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _add_read_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="close an inbound control stream (DHT, ping, run spec, dial-back, identify) whose "
        "peer sends no request, or not all of one, within S seconds [10]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description="Decentralized peer-to-peer training."
    )
    parser.add_argument("--version", action="version", version=f"swarmtrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p_id = sub.add_parser("id", help="print the peer id of the identity (creating it if absent)")
    p_id.add_argument(
        "--identity",
        type=Path,
        default=None,
        help=f"the Ed25519 key file (a node's is <state-dir>/identity.key) "
        f"[{default_identity_path()}]",
    )
    p_id.add_argument(
        "--work",
        type=int,
        default=0,
        metavar="BITS",
        help="make the absent identity with this many bits of proof of work, as a run with "
        "run.identity_work_bits asks (about 2**BITS key generations; 20 bits ~1 min); an "
        "existing identity is only checked: exit 1 when it has fewer [0]",
    )

    p_relay = sub.add_parser(
        "relay",
        help="run a public helper peer: bootstrap, DHT server, circuit relay, dial-back service",
    )
    _add_common(p_relay, listen_default="/ip4/0.0.0.0/tcp/4002")
    _add_read_timeout(p_relay)
    add_metrics_arguments(p_relay)
    p_relay.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="address to advertise instead of the listen addresses (public IP, port forward)",
    )

    p_doc = sub.add_parser(
        "doctor", help="check identity, reachability, relays and connectivity to other peers"
    )
    _add_common(p_doc, listen_default="/ip4/0.0.0.0/tcp/0")
    p_doc.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="a relay/bootstrap peer's address (…/p2p/ID); without it, doctor starts a relay "
        "in this process on loopback and checks against that",
    )
    p_doc.add_argument(
        "--ping", action="append", default=[], metavar="PEER_ID", help="peer to find and reach"
    )
    p_doc.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="stay online this long after the report so others can --ping us",
    )
    p_doc.add_argument(
        "--bulk-mib",
        type=float,
        default=4.0,
        metavar="MIB",
        help="send this much over the bulk data plane to each pinged peer (0: skip) [4]",
    )
    p_doc.add_argument("--json", action="store_true", help="print one JSON object")

    p_node = sub.add_parser("node", help="join a run as a volunteer: train and contribute")
    _add_common(
        p_node, listen_default="/ip4/0.0.0.0/tcp/0", identity_default="<state-dir>/identity.key"
    )
    add_metrics_arguments(p_node)
    p_node.add_argument(
        "--log-to",
        action="append",
        default=[],
        metavar="KIND:WHERE",
        help="also log each round to an experiment tracker: tensorboard:DIR (event files; "
        "needs the tensorboard package) or wandb:PROJECT (only if wandb is installed); "
        "repeatable [off]",
    )
    p_node.add_argument(
        "--join",
        action="append",
        required=True,
        metavar="MULTIADDR",
        help="a bootstrap/relay peer's address (…/p2p/ID), repeatable",
    )
    p_node.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"checkpoints and identity.key; a restart with the same one resumes "
        f"[{_default_state_dir()}]",
    )
    p_node.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads [torch's default]"
    )
    p_node.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the inner steps run; the shared state stays on the CPU [auto: cuda if any]",
    )
    p_node.add_argument(
        "--role",
        choices=["server", "trainer"],
        default=None,
        help="pipeline runs only (pipeline.stages > 0): serve a stage until Ctrl+C, or train "
        "run.rounds rounds [server]",
    )
    p_node.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="a model factory ([model] factory) a spec may make this node import, "
        "repeatable; the node refuses a spec naming any other [none: no user code]",
    )
    p_node.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="K",
        help="run the inner phase as data parallel over K local processes (gloo on the CPU, "
        "NCCL on CUDA, one device each); this one stays the swarm peer; --threads is shared "
        "among them; not for pipeline or verified runs [1]",
    )
    p_node.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc-per-node K >= 2: the K ranks shard the model, its gradients and the "
        "inner AdamW state (FSDP2) instead of each holding all of them, for a model that does "
        "not fit one device; not with training.overlap, fragments > 1 or fp16 [off]",
    )
    p_node.add_argument(
        "--data-dir",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="where the run spec's relative paths ([data] paths, path, tokenizer; [model] "
        "pretrained) are read from: this machine's copy of the folder that holds the "
        "coordinator's run.toml, the files laid out under it as beside that run.toml "
        "[the working directory]",
    )
    p_node.add_argument("--json", type=Path, default=None, metavar="PATH", help="write a summary")
    p_node.add_argument(
        "--token",
        default=None,
        help="a token run's join token (from the run's operator: swarmtrain coordinator token)",
    )
    # ... and one that commits its task honestly, then sends other values in round ROUND.
    p_node.add_argument("--cheat-send", type=int, default=None, help=argparse.SUPPRESS)
    # A stranger that does not refuse itself, for the admission tests: the members must.
    p_node.add_argument("--ignore-admission", action="store_true", help=argparse.SUPPRESS)
    # A cheater for tests and demos of a verified run (verify.rate > 0): flips one bit of
    # operator OP's output at inner step STEP of this node's task in round ROUND.
    p_node.add_argument("--cheat", type=_cheat, default=None, help=argparse.SUPPRESS)
    # ... and a lying reducer: every part this node reduces in round ROUND is off.
    p_node.add_argument("--cheat-reduce", type=int, default=None, help=argparse.SUPPRESS)
    # A slow warm-up for the membership tests: stall this long after announcing our start.
    p_node.add_argument("--slow-start", type=float, default=0.0, help=argparse.SUPPRESS)
    # A pipeline node's test and demo settings, repeatable (swarmtrain.pipeline.node.PipelineHooks:
    # a server's starting stage, a slowed stage, ...); swarmtrain local --pipeline-stages sets them.
    p_node.add_argument(
        "--pipeline-hook", action="append", default=[], metavar="KEY=VALUE", help=argparse.SUPPRESS
    )

    p_export = sub.add_parser(
        "export",
        help="write a node's trained model (its newest checkpoint) as safetensors, or a "
        "save_pretrained folder for a transformers model",
    )
    p_export.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="the node's --state-dir (run.spec, diloco-*.ckpt)",
    )
    p_export.add_argument(
        "--out", type=Path, required=True, help="folder to create (refused if not empty)"
    )
    p_export.add_argument(
        "--data-dir",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="the node's --data-dir, where a relative [data] tokenizer is copied from "
        "[the working directory]",
    )
    p_export.add_argument("--json", type=Path, default=None, help="also write the report here")

    p_init = sub.add_parser("init", help="write a commented default run config")
    p_init.add_argument("path", type=Path, nargs="?", default=Path("run.toml"), help="[run.toml]")
    p_init.add_argument("--force", action="store_true", help="overwrite an existing file")

    p_coord = sub.add_parser(
        "coordinator",
        help="create a run (signed run spec) and serve as its bootstrap, DHT server and relay",
    )
    _add_common(p_coord, listen_default="/ip4/0.0.0.0/tcp/4001")
    _add_read_timeout(p_coord)
    add_metrics_arguments(p_coord)
    add_dashboard_arguments(p_coord)
    p_coord.add_argument(
        "--config", type=Path, default=None, help="run config [the embedded default run]"
    )
    p_coord.add_argument("--rounds", type=int, default=None, help="override run.rounds")
    p_coord.add_argument(
        "action",
        nargs="?",
        choices=["token"],
        default=None,
        help='token: print a join token for --peer (a run.admission = "token" run) and exit',
    )
    p_coord.add_argument("--peer", default=None, metavar="PEER_ID", help="token: who it admits")
    p_coord.add_argument(
        "--expires",
        default="24h",
        metavar="DURATION",
        help="token: how long it admits, e.g. 30m, 24h, 7d [24h]",
    )
    p_coord.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="address to advertise instead of the listen addresses (public IP, port forward)",
    )

    p_status = sub.add_parser("status", help="a run's peers, round, loss and throughput")
    p_status.add_argument(
        "--join", action="append", required=True, metavar="MULTIADDR", help="the coordinator"
    )
    p_status.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="MULTIADDR",
        help="address this short-lived peer listens on while it reads the run [/ip4/0.0.0.0/tcp/0]",
    )
    p_status.add_argument("--json", action="store_true", help="print one JSON object")
    p_status.add_argument(
        "--probe",
        action="store_true",
        help="connect to every active peer and show how: direct, punched, relayed, unreachable",
    )
    p_status.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    p_local = sub.add_parser(
        "local", help="a whole swarm on this machine: a coordinator and N volunteer processes"
    )
    p_local.add_argument("--peers", type=int, default=3, help="volunteer processes [3]")
    p_local.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help="run this run.toml (any model and data it names) instead of the default run; "
        "--rounds and --inner-steps, when given, replace its own",
    )
    _add_training(p_local)
    # None: not given, so --config's own values (or the defaults in _add_training's help) hold.
    p_local.set_defaults(rounds=None, inner_steps=None)
    p_local.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the nodes' state directories and logs here [a temporary directory]",
    )
    p_local.add_argument(
        "--timeout", type=float, default=None, help="give up after this many seconds"
    )
    p_local.add_argument("--json", type=Path, default=None, metavar="PATH", help="write a summary")
    p_local.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="K",
        help="each node's inner phase data parallel over K local processes (as swarmtrain node "
        "--nproc-per-node) [1]",
    )
    p_local.add_argument(
        "--verify-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="a verified run: every inner phase under RepOps, a fraction P of them re-executed "
        "by a second peer and disputes refereed by the coordinator [0: off]",
    )
    p_local.add_argument(
        "--delay-node", type=_delay_node, default=None, metavar="I:S", help=argparse.SUPPRESS
    )  # start node I S seconds after the others (a late volunteer; membership tests)
    p_local.add_argument("-v", "--verbose", action="store_true", help="show the nodes' logs")
    add_dashboard_arguments(p_local, host=False)
    pipeline_local.add_arguments(p_local)
    verify_cmd.add_parser(sub)
    describe(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (pyproject's), or "unknown" from a bare checkout."""
    try:
        return importlib.metadata.version("swarmtrain")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _default_state_dir() -> Path:
    # Next to the default identity (XDG data directory), without importing swarmtrain.commands.node.
    return default_identity_path().parent / "node"


def _add_training(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds of the run [5]")
    parser.add_argument(
        "--inner-steps", type=int, default=20, help="inner steps per round (DiLoCo's H) [20]"
    )
    parser.add_argument("--run-id", default=None, help="run name; peers of a run share it")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # py-libp2p logs every failed negotiation by a stranger as an ERROR with a traceback; our own
    # layer reports what matters in plain words.
    logging.getLogger("libp2p").setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    logging.getLogger("multiaddr").setLevel(logging.WARNING)


def _cheat(text: str) -> tuple[int, int, int]:
    try:
        return parse_task_fault(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _main_node(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    state_dir = args.state_dir or _default_state_dir()
    metrics = None
    trackers: list[Tracker] = []
    # One try from the first line on: Ctrl+C while torch loads or the node dials is a clean
    # stop (130), not a KeyboardInterrupt traceback.
    try:
        # Before torch and the model allocate: a round's freed transients leave the RSS.
        release_large_blocks()
        log.info("starting: loading torch")  # seconds of silence otherwise
        # Imported here: torch takes seconds to import, and id/relay/doctor/local do not need it.
        from swarmtrain.commands.node import NodeOptions, run_node
        from swarmtrain.pipeline.node import PipelineHooks

        metrics = _start_metrics(args, "node")
        trackers = open_trackers(args.log_to, name=state_dir.name)
        options = NodeOptions(
            join=tuple(args.join),
            state_dir=state_dir,
            identity=args.identity,
            listen=tuple(args.listen or ["/ip4/0.0.0.0/tcp/0"]),
            threads=args.threads,
            device=args.device,
            json_path=args.json,
            role=args.role,
            allow_models=tuple(args.allow_model),
            nproc_per_node=args.nproc_per_node,
            fsdp=args.fsdp,
            faults=Faults(
                task=args.cheat,
                reduce_round=args.cheat_reduce,
                slow_start_s=args.slow_start,
                ignore_admission=args.ignore_admission,
                send_round=args.cheat_send,
            ),
            pipeline_hooks=PipelineHooks.parse(args.pipeline_hook),
            token=args.token,
            metrics=metrics,
            trackers=tuple(trackers),
            data_dir=args.data_dir,
        )
        summary = run_node(options, lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        # DiLoCo checkpoints at every round boundary; only the inner phase in progress is lost.
        # (A pipeline node keeps none: it printed its summary, a stage lives on its servers.)
        if any(state_dir.glob("diloco-*.ckpt")):
            log.info("stopped; checkpoints of finished rounds are in %s", state_dir)
        else:
            log.info("stopped")
        return 130
    except SpecRefused as exc:
        print(f"swarmtrain node: run spec refused: {exc}", file=sys.stderr)
        return 1
    except (P2PError, ValueError, OSError, RuntimeError, ExceptionGroup) as exc:
        print(f"swarmtrain node: {_one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if metrics is not None:
            metrics.close()
        for tracker in trackers:
            tracker.close()
    print(summary.done_line(), flush=True)
    return 3 if getattr(summary, "banned", "") else 0


def _main_init(args: argparse.Namespace) -> int:
    path: Path = args.path
    if path.exists() and not args.force:
        print(f"swarmtrain init: {path} exists (--force overwrites it)", file=sys.stderr)
        return 1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(default_toml())
    except OSError as exc:
        why = plain_os_error(exc, making=True)
        print(f"swarmtrain init: cannot write {path}: {why}", file=sys.stderr)
        return 1
    print(f"wrote {path}; start the run with: swarmtrain coordinator --config {path}")
    return 0


def _main_export(args: argparse.Namespace) -> int:
    from swarmtrain.commands.export import ExportError, export

    try:
        report = export(args.state_dir, args.out, args.data_dir)
        if args.json is not None:
            args.json.write_text(json.dumps(report.to_json()) + "\n")
    except (ExportError, SpecRefused, OSError, ValueError) as exc:
        print(f"swarmtrain export: {exc}", file=sys.stderr)
        return 1
    print(report.line())
    return 0


def _coordinator_config(args: argparse.Namespace) -> RunConfig:
    config = load_config(args.config) if args.config is not None else RunConfig()
    if args.rounds is not None:
        try:
            config = config.replace(run={"rounds": args.rounds})  # re-validated
        except ConfigError as exc:
            raise ConfigError(f"--rounds {args.rounds}: {exc}") from None
    return config


def _duration_s(text: str) -> float:
    """``30m``, ``24h``, ``7d``, ``90s`` or plain seconds. Raises ValueError."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    seconds = float(number) * units[unit]
    if not 0 < seconds < 10 * 365 * 86400:
        raise ValueError(f"--expires {text}: give a positive duration such as 30m, 24h or 7d")
    return seconds


def _main_token(args: argparse.Namespace, key_pair: KeyPair) -> int:
    from swarmtrain.admission import make_token

    try:
        config = _coordinator_config(args)
        if config.run.admission != "token":
            raise ValueError(
                f'run.admission is "{config.run.admission}": join tokens are for runs with '
                'run.admission = "token"'
            )
        if not args.peer:
            raise ValueError("--peer is required: the peer id the token admits (swarmtrain id)")
        peer = PeerID.from_base58(args.peer)
        expires = time.time() + _duration_s(args.expires)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"swarmtrain coordinator token: {_one_line(exc)}", file=sys.stderr)
        return 1
    ends = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
    print(f"token for {peer} in run {config.run.id}, valid until {ends}:", file=sys.stderr)
    print(make_token(key_pair, config.run.id, peer, expires), flush=True)
    return 0


def _main_coordinator(args: argparse.Namespace, key_pair: KeyPair) -> int:
    from swarmtrain.commands.coordinator import CoordinatorOptions, pick_run_id, run_coordinator
    from swarmtrain.training.workload import with_local_hashes

    if args.action == "token":
        return _main_token(args, key_pair)
    try:
        config = _coordinator_config(args)
        # The spec carries the data's fingerprint and the pretrained weights' hash, from the
        # coordinator's copies unless run.toml sets them: nodes whose copies differ refuse
        # before training (training.workload). Relative paths are read from run.toml's folder.
        config = with_local_hashes(
            config,
            args.config.parent if args.config is not None else Path("."),
            warn=lambda line: print(f"swarmtrain coordinator: warning: {line}", file=sys.stderr),
        )
        if config.verify.rate > 0:
            # Spec time: a model whose step uses an operator RepOps cannot run is refused
            # here, naming it, before any node trains (one traced step of the model).
            from swarmtrain.verified.task import check_verifiable

            check_verifiable(config)
        identity = args.identity or default_identity_path()
        config, warning = pick_run_id(
            config, args.config, identity.with_name(identity.name + ".runs.json")
        )
        if warning:
            print(warning, file=sys.stderr, flush=True)
        dashboard_options = dashboard_options_from(args)
        dashboard = dashboard_options.listen() if dashboard_options is not None else None
        metrics = _start_metrics(args, "coordinator")
    except (ConfigError, ValueError, OSError) as exc:
        print(f"swarmtrain coordinator: {_one_line(exc)}", file=sys.stderr)
        return 1
    options = CoordinatorOptions(
        config,
        RelayOptions(
            listen=tuple(args.listen or ["/ip4/0.0.0.0/tcp/4001"]),
            announce=tuple(args.announce),
            upnp=args.upnp,
            read_timeout_s=args.read_timeout,
            metrics=metrics,
        ),
        dashboard,
    )
    try:
        trio.run(run_coordinator, key_pair, options, lambda line: print(line, flush=True))
    finally:
        if metrics is not None:
            metrics.close()
    return 0


def _start_metrics(args: argparse.Namespace, role: str) -> Metrics | None:
    """The process's metrics, served (``--metrics-port``); None when off. ValueError naming
    the flag for a bad or busy port."""
    options = options_from(args)
    if options is None:
        return None
    metrics = Metrics(role)
    metrics.serve(options)
    return metrics


def _main_status(args: argparse.Namespace) -> int:
    from swarmtrain.commands.status import run_status

    _setup_logging(args.verbose)
    # Quiet by default: the report is the output.
    logging.getLogger("p2p").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        report = trio.run(
            partial(run_status, probe=args.probe),
            tuple(args.join),
            tuple(args.listen or ["/ip4/0.0.0.0/tcp/0"]),
        )
    except KeyboardInterrupt:
        return 130
    except SpecRefused as exc:
        print(f"swarmtrain status: run spec refused: {exc}", file=sys.stderr)
        return 1
    except (P2PError, OSError, ExceptionGroup) as exc:
        print(f"swarmtrain status: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json()) if args.json else report.format(), flush=True)
    return 0


def _delay_node(text: str) -> tuple[int, float]:
    index, _, seconds = text.partition(":")
    try:
        return int(index), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INDEX:SECONDS, got {text!r}") from None


def _main_local(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    try:
        config = load_config(args.config) if args.config is not None else None
        if config is not None:
            # The coordinator reads the copy written to the work folder: the paths go there
            # made absolute from this run.toml's folder, and every child here reads them so.
            config = with_base(
                config,
                args.config.parent.resolve(),
                warn=lambda line: print(f"swarmtrain local: warning: {line}", file=sys.stderr),
            )
        default = config or RunConfig()  # rounds 5, H 20: the defaults --help names
        options = LocalOptions(
            peers=args.peers,
            rounds=args.rounds if args.rounds is not None else default.run.rounds,
            inner_steps=(
                args.inner_steps if args.inner_steps is not None else default.training.inner_steps
            ),
            config=config,
            run_id=args.run_id,
            workdir=args.workdir,
            timeout_s=args.timeout,
            json_path=args.json,
            verbose=args.verbose,
            verify_rate=args.verify_rate,
            delay_node=args.delay_node,
            nproc_per_node=args.nproc_per_node,
            dashboard_port=args.dashboard_port,
        )
        # A bar per node on a terminal above the lines; the lines alone through a pipe.
        with LocalProgress(options.peers, options.rounds) as progress:
            summary = run_local(options, progress.emit)
    except KeyboardInterrupt:
        log.info("stopped")
        return 130
    except (LocalFailed, ValueError, OSError) as exc:
        print(f"swarmtrain local: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(summary.format(), flush=True)
    return 0


def _one_line(exc: BaseException) -> str:
    """The cause in one line; an exception group (a failed trio nursery) names its first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, OSError) and exc.strerror:  # not "[Errno 2] ...": the file, in words
        return f"{exc.filename}: {plain_os_error(exc)}" if exc.filename else plain_os_error(exc)
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _stop_on_sigterm() -> Callable[[], bool]:
    """SIGTERM raises SIGINT, so it stops every command exactly as Ctrl+C does (trio's own
    SIGINT handling included); returns whether a SIGTERM came."""
    received: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        received.append(signum)
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: bool(received)


def _main_id(path: Path, work_bits: int) -> int:
    """Print the identity's peer id; ``work_bits``: make it with that much proof of work when
    absent, and refuse (exit 1) an existing one that has less."""
    if not 0 <= work_bits <= MAX_WORK_BITS:
        print(f"swarmtrain id: --work must be 0..{MAX_WORK_BITS}, not {work_bits}", file=sys.stderr)
        return 1
    try:
        if work_bits and not path.exists():
            print(f"making an identity with {work_bits} bits of work...", file=sys.stderr)
            key_pair = create_identity(path, work_bits)
        else:
            key_pair = load_or_create_identity(path)
    except (IdentityError, OSError) as exc:
        print(f"swarmtrain id: --identity: {exc}", file=sys.stderr)
        return 1
    peer = peer_id_of(key_pair)
    have = identity_work(peer.to_bytes())
    if have < work_bits:
        print(
            f"swarmtrain id: --work {work_bits}: identity {path} has {have} bits of work; move "
            "it away to make a new one",
            file=sys.stderr,
        )
        return 1
    print(peer)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # A shell starts background jobs (``swarmtrain coordinator &`` in a script) with SIGINT
    # ignored, and Python then never raises KeyboardInterrupt: restore it so Ctrl+C, or the
    # SIGINT ``swarmtrain local`` sends its children, always means a clean stop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    terminated = _stop_on_sigterm()
    try:
        status = _run(argv)
    except KeyboardInterrupt:  # a command with nothing to clean up (id, init, export, verify)
        status = 130
    return 143 if status == 130 and terminated() else status


# What to give instead of a folder a command reads that is not one (Use.EXISTING_FOLDER).
FOLDER_FIXES = {
    ("node", "--data-dir"): "give the folder the run's data and weights lie under (as they "
    "lie beside the coordinator's run.toml)",
    ("export", "--data-dir"): "give the node's --data-dir",
    ("export", "--state-dir"): "give the node's --state-dir",
}


def _path_options(args: argparse.Namespace) -> list[tuple[str, Path, Use, str]]:
    """The command's paths (defaults included), each as its flag shows it, how it is used and,
    for a folder it reads, what to give instead: checked before the command writes, imports or
    dials anything."""
    command = args.command
    found: list[tuple[str, Path | None, Use]] = []
    if command in ("id", "relay", "doctor", "coordinator"):
        found.append(("--identity", args.identity or default_identity_path(), Use.FILE))
    if command in ("coordinator", "local"):
        found.append(("--config", args.config, Use.CONFIG))
    if command == "node":
        found += [("--identity", args.identity, Use.FILE),
                  ("--state-dir", args.state_dir or _default_state_dir(), Use.FOLDER),
                  ("--data-dir", args.data_dir, Use.EXISTING_FOLDER)]  # fmt: skip
        found += [
            (f"--log-to {spec}", Path(spec.partition(":")[2]), Use.FOLDER)
            for spec in args.log_to
            if spec.startswith("tensorboard:") and spec.partition(":")[2]
        ]
    if command == "export":
        found += [("--state-dir", args.state_dir, Use.EXISTING_FOLDER),
                  ("--data-dir", args.data_dir, Use.EXISTING_FOLDER),
                  ("--out", args.out, Use.NEW_FOLDER)]  # fmt: skip
    if command == "local":
        found.append(("--workdir", args.workdir, Use.FOLDER))
    if command in ("node", "export", "local"):
        found.append(("--json", args.json, Use.FILE))
    if command == "init":
        found.append(("", args.path, Use.FILE))
    return [
        (
            f"{flag} {path}".strip() if not flag.startswith("--log-to") else flag,
            path,
            use,
            FOLDER_FIXES.get((command, flag), ""),
        )
        for flag, path, use in found
        if path is not None
    ]


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    checks = {"listen": listen_address_problem, "announce": listen_address_problem,
              "join": join_address_problem, "ping": peer_id_problem}  # fmt: skip
    for flag, check in checks.items():
        for text in getattr(args, flag, None) or []:
            problem = check(text)
            if problem is not None:
                print(f"swarmtrain {args.command}: --{flag} {text}: {problem}", file=sys.stderr)
                return 1
    for shown, path, use, fix in _path_options(args):
        problem = path_problem(path, use, fix)
        if problem is not None:
            print(f"swarmtrain {args.command}: {shown}: {problem}", file=sys.stderr)
            return 1
    # node keeps its identity in its state directory (several nodes on one machine must differ);
    # local starts processes that each have their own.
    if args.command == "node":
        return _main_node(args)
    if args.command == "local" and args.pipeline_stages is not None:
        if args.verify_rate:
            print(
                "swarmtrain local: --verify-rate needs a DiLoCo run (no --pipeline-stages)",
                file=sys.stderr,
            )
            return 2
        if args.nproc_per_node != 1:
            print(
                "swarmtrain local: --nproc-per-node needs a DiLoCo run (no --pipeline-stages): "
                "a pipeline's roles run in one process",
                file=sys.stderr,
            )
            return 1
        args.rounds = 5 if args.rounds is None else args.rounds  # local's default
        return pipeline_local.run(args)
    if args.command == "local":
        return _main_local(args)
    if args.command == "verify":
        return verify_cmd.run(args)
    if args.command == "init":
        return _main_init(args)
    if args.command == "export":
        return _main_export(args)
    if args.command == "status":
        return _main_status(args)
    identity_path = args.identity or default_identity_path()
    if args.command == "id":
        return _main_id(identity_path, args.work)
    try:
        key_pair = load_or_create_identity(identity_path)
    except (IdentityError, OSError) as exc:
        print(f"swarmtrain {args.command}: --identity: {exc}", file=sys.stderr)
        return 1
    _setup_logging(args.verbose)
    try:
        if args.command == "coordinator":
            return _main_coordinator(args, key_pair)
        if args.command == "relay":
            try:
                metrics = _start_metrics(args, "relay")
            except ValueError as exc:
                print(f"swarmtrain relay: {exc}", file=sys.stderr)
                return 1
            options = RelayOptions(
                listen=tuple(args.listen or ["/ip4/0.0.0.0/tcp/4002"]),
                announce=tuple(args.announce),
                upnp=args.upnp,
                read_timeout_s=args.read_timeout,
                metrics=metrics,
            )
            try:
                trio.run(run_relay, key_pair, options)
            finally:
                if metrics is not None:
                    metrics.close()
        elif args.command == "doctor":
            doctor = DoctorOptions(
                # Without --join everything happens on loopback; don't open a public port for it.
                listen=tuple(
                    args.listen or ["/ip4/0.0.0.0/tcp/0" if args.join else "/ip4/127.0.0.1/tcp/0"]
                ),
                join=tuple(args.join),
                ping=tuple(args.ping),
                linger_s=args.linger,
                bulk_bytes=int(args.bulk_mib * (1 << 20)),
                upnp=args.upnp,
            )

            def emit(report: DoctorReport) -> None:
                text = json.dumps(report.to_json()) if args.json else format_report(report)
                print(text, flush=True)

            report = trio.run(run_doctor, key_pair, doctor, emit)
            return 0 if report.ok else 1
    except KeyboardInterrupt:
        log.info("stopped")
        return 130
    except P2PError as exc:
        print(f"swarmtrain {args.command}: {exc}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"peer_id": str(peer_id_of(key_pair)), "error": str(exc)}))
        return 1
    return 0


def run_and_exit() -> NoReturn:
    """The console script: ``main``, then the process exits without the interpreter's teardown
    of its modules. Tearing down torch's and libp2p's took 2-3 s after a coordinator or node was
    done (measured: every atexit handler had run within 10 ms), which Ctrl+C, a service manager
    and every test waiting for an exit paid. The atexit handlers (logging's flush,
    multiprocessing's) still run; an exception that escapes ``main`` exits the usual way."""
    status = main()
    gc.collect()  # file objects held only in cycles close (and flush) as at a normal exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    run_and_exit()
