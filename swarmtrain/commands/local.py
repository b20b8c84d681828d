"""``swarmtrain local``: a whole swarm on this machine, the README's first command.

Writes a run config (``run.toml`` in the work directory: the embedded default run, or the spec
given with ``--config`` with its rounds and H as given), starts a ``swarmtrain coordinator`` on
it (signed run spec, bootstrap, DHT server, relay) and N ``swarmtrain node`` processes on
127.0.0.1 that join with the exact command the coordinator prints, each with its own state
directory, shows their progress lines prefixed by node index,
waits for all of them (bounded), and sums up their ``--json`` summaries. Real processes rather
than threads: each node is exactly what a volunteer runs, with its own trio loop and torch, so
this command exercises the same code paths as a real swarm, only over loopback.

Children run in their own sessions so a terminal Ctrl+C reaches only us; we then pass it on
(SIGINT: each node leaves cleanly and keeps its checkpoint), and SIGKILL whatever is still running
after a grace period.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from swarmtrain.config import (
    RunConfig,
    RunSection,
    SwarmSection,
    TrainingSection,
    VerifySection,
    default_toml,
)
from swarmtrain.paths import make_folder

log = logging.getLogger(__name__)

# A verified run of a transformers or factory model runs one traced step of it before the
# coordinator signs the spec (seconds, more on a loaded machine); a coordinator that exits is
# seen at once, so this only bounds one that hangs.
RELAY_START_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
SWARMTRAIN = (sys.executable, "-m", "swarmtrain.cli")
JOIN_COMMAND = "swarmtrain node --join "


class LocalFailed(Exception):
    """The local swarm did not finish: a process failed or the run timed out."""


@dataclass(frozen=True)
class LocalOptions:
    peers: int = 3
    rounds: int = 5
    inner_steps: int = 20
    run_id: str | None = None  # default: a fresh random one
    workdir: Path | None = None  # default: a temporary directory, removed afterwards
    timeout_s: float | None = None  # default: scaled with rounds and steps
    json_path: Path | None = None
    verbose: bool = False
    verify_rate: float = 0.0  # the spec's verify.rate: a verified run (RepOps, re-executions)
    # (node index, seconds): start that node this long after the others (``--delay-node I:S``),
    # a late volunteer as on a busy box; the membership tests use it.
    delay_node: tuple[int, float] | None = None
    # A run config to run (``--config run.toml``) instead of the embedded default one; its
    # run id, rounds and H are replaced by ``run_id`` (when given), ``rounds``, ``inner_steps``.
    config: RunConfig | None = None
    # Each node's local data-parallel ranks (``swarmtrain node --nproc-per-node``).
    nproc_per_node: int = 1
    # The coordinator's --dashboard-port (on loopback); None: no dashboard.
    dashboard_port: int | None = None

    def __post_init__(self) -> None:
        for name in ("peers", "rounds", "inner_steps", "nproc_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.delay_node is not None:
            index, delay_s = self.delay_node
            if not 0 <= index < self.peers or not 0 <= delay_s <= 600:
                raise ValueError("--delay-node I:S needs 0 <= I < peers and 0 <= S <= 600")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port <= 65535:
            raise ValueError(f"--dashboard-port must be 0-65535, got {self.dashboard_port}")
        if not 0 <= self.verify_rate <= 1:
            raise ValueError(f"--verify-rate must be in [0, 1], got {self.verify_rate}")
        if self.verify_rate > 0 and self.nproc_per_node > 1:
            raise ValueError(
                "--nproc-per-node: a verified run's inner phases are RepOps tasks of one "
                "process; drop --verify-rate or --nproc-per-node"
            )

    def run_config(self, run_id: str) -> RunConfig:
        """The config the coordinator signs. Raises ConfigError (a ValueError) when the
        changed keys make it invalid."""
        # Round 0 waits for the nodes started together (a delayed one joins mid-run).
        together = self.peers - (self.delay_node is not None)
        if self.config is None:
            return RunConfig(
                run=RunSection(id=run_id, rounds=self.rounds),
                training=TrainingSection(inner_steps=self.inner_steps),
                swarm=SwarmSection(min_peers=together),
                verify=VerifySection(rate=self.verify_rate),
            )
        changes: dict[str, dict[str, object]] = {
            "run": {"id": run_id, "rounds": self.rounds},
            "training": {"inner_steps": self.inner_steps},
            "swarm": {"min_peers": together},
        }
        if self.verify_rate:
            changes["verify"] = {"rate": self.verify_rate}
        return self.config.replace(**changes)  # type: ignore[arg-type]

    def deadline_s(self) -> float:
        # Generous: a 2-core machine runs a default-model step in about 0.2 s per process.
        cpus = os.cpu_count() or 1
        step_s = 0.3 * max(1.0, self.peers * self.nproc_per_node / cpus)
        if self.verify_rate > 0:  # RepOps steps (about 4.5x), traced, some run twice
            step_s *= 6 * (1 + self.verify_rate)
        delay_s = self.delay_node[1] if self.delay_node is not None else 0.0
        return self.timeout_s or delay_s + 60.0 + self.rounds * (self.inner_steps * step_s + 20.0)


@dataclass
class LocalSummary:
    rounds: int
    peers: int
    loss_first: float
    loss_last: float
    eval_loss: float | None
    state_hashes_agree: bool
    bytes_sent: int
    seconds: float
    nodes: list[dict[str, object]] = field(default_factory=list)
    # Each node's state directory (checkpoints): kept only with a --workdir.
    state_dirs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "rounds": self.rounds,
            "peers": self.peers,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "eval_loss": self.eval_loss,
            "state_hashes_agree": self.state_hashes_agree,
            "bytes_sent": self.bytes_sent,
            "seconds": round(self.seconds, 2),
            "nodes": self.nodes,
            "state_dirs": self.state_dirs,
        }

    def format(self) -> str:
        held = f"{self.eval_loss:.3f}" if self.eval_loss is not None else "n/a"
        return (
            f"{self.peers} peers, {self.rounds} rounds in {self.seconds:.1f} s: train loss "
            f"{self.loss_first:.3f} -> {self.loss_last:.3f} nats/token, held-out {held}, "
            f"state hashes {'agree' if self.state_hashes_agree else 'DIFFER'}, "
            f"{self.bytes_sent / 2**20:.2f} MiB sent in all"
        )


class Child:
    """A child process; a thread hands its stdout lines to ``on_line``, stderr goes to a file.
    ``swarmtrain.pipeline.local`` extends it to read a pipeline node's lines as events."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, on_line: Callable[[str], None]
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._interrupted = False
        self._log: IO[bytes] = log_path.open("wb")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, args=(on_line,), daemon=True)
        self._reader.start()

    def _pump(self, on_line: Callable[[str], None]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            on_line(raw.decode(errors="replace").rstrip("\n"))
        self._stdout_ended()

    def _stdout_ended(self) -> None:
        """Called on the reader thread once the child's stdout closed."""

    def last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def interrupt(self) -> None:
        """SIGINT, once: a second one would cut the node's clean stop short (a pipeline server
        writes its summary at the end of it)."""
        if self.proc.poll() is None and not self._interrupted:
            self._interrupted = True
            self.proc.send_signal(signal.SIGINT)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGINT (the node's Ctrl+C path: checkpoint kept), SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", self.name, grace_s)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=5)
        self._log.close()


def work_directory(stack: ExitStack, given: Path | None, prefix: str) -> Path:
    """``given`` (created if absent), or a temporary folder removed when ``stack`` closes."""
    if given is None:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    make_folder(given, "--workdir")
    return given


def start_coordinator(
    workdir: Path,
    config: RunConfig,
    children: list[Child],
    emit: Callable[[str], None],
    extra: Sequence[str] = (),
) -> str:
    """Start the coordinator on ``config`` (written to ``workdir/run.toml``, as ``swarmtrain
    init`` writes it) with ``extra`` flags, and return the join address it prints (its lines
    until then, the dashboard's URL among them, go to ``emit``). Raises LocalFailed."""
    config_path = workdir / "run.toml"
    config_path.write_text(default_toml(config))
    lines: queue.Queue[str] = queue.Queue()
    coordinator = Child(
        "coordinator",
        [
            *SWARMTRAIN,
            "coordinator",
            "--config",
            str(config_path),
            "--identity",
            str(workdir / "coordinator.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            *extra,
        ],
        workdir / "coordinator.log",
        lines.put,
    )
    children.append(coordinator)
    deadline = time.monotonic() + RELAY_START_TIMEOUT_S
    while True:
        try:
            # In slices, so a coordinator that exits (a bad flag, a busy port) is seen at once.
            line = lines.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            status = coordinator.proc.poll()
            if status is None and time.monotonic() < deadline:
                continue
            if status is not None:
                raise LocalFailed(
                    f"the coordinator exited with status {status}: "
                    f"{coordinator.last_log_line() or 'no log'}"
                ) from None
            raise LocalFailed(
                f"the coordinator printed no join command within {RELAY_START_TIMEOUT_S:.0f} s: "
                f"{coordinator.last_log_line() or 'no log'}"
            ) from None
        emit(f"[c] {line}")
        if line.startswith(JOIN_COMMAND):
            return line[len(JOIN_COMMAND) :].split()[0]


def run_local(options: LocalOptions, emit: Callable[[str], None]) -> LocalSummary:
    """Run the local swarm to the end. Returns the summary (also written to ``json_path``).
    Raises LocalFailed (a process failed, or the deadline passed), KeyboardInterrupt after every
    child was stopped."""
    started = time.monotonic()
    run_id = (
        options.run_id
        or (options.config.run.id if options.config is not None else "")
        or f"local-{os.urandom(4).hex()}"
    )
    config = options.run_config(run_id)
    threads = max(1, (os.cpu_count() or 1) // options.peers)
    emit_lock = threading.Lock()

    def emit_from(prefix: str) -> Callable[[str], None]:
        def on_line(line: str) -> None:
            with emit_lock:
                emit(f"{prefix} {line}")

        return on_line

    children: list[Child] = []
    with ExitStack() as stack:
        workdir = work_directory(stack, options.workdir, "swarmtrain-")
        # Registered after the temporary directory, so children stop before it is removed.
        stack.callback(lambda: [child.stop() for child in reversed(children)])
        join = start_coordinator(
            workdir, config, children, emit, dashboard_flags(options.dashboard_port)
        )
        emit(f"run {run_id}: {options.peers} peers join {join}")
        nodes: list[Child] = []
        delayed, delay_s = options.delay_node or (-1, 0.0)
        order = [i for i in range(options.peers) if i != delayed] + ([delayed] * (delayed >= 0))
        for index in order:
            if index == delayed:
                emit(f"starting node {index} {delay_s:.0f} s after the others (--delay-node)")
                time.sleep(delay_s)  # the delay is the point: a late volunteer
            # Each node shares its threads among its ranks.
            ranks = ("--nproc-per-node", str(options.nproc_per_node))
            argv = node_argv(
                join, workdir / f"node{index}", threads, verbose=options.verbose,
                extra=ranks if options.nproc_per_node > 1 else (),
            )  # fmt: skip
            child = Child(
                f"node {index}", argv, workdir / f"node{index}.log", emit_from(f"[{index}]")
            )
            children.append(child)
            nodes.append(child)
        deadline = started + options.deadline_s()
        for child in nodes:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise LocalFailed(
                    f"{child.name} still running after {options.deadline_s():.0f} s "
                    f"(--timeout); last log line: {child.last_log_line() or 'none'}"
                ) from None
        for child in nodes:
            if child.proc.returncode != 0:
                raise LocalFailed(
                    f"{child.name} exited with status {child.proc.returncode}: "
                    f"{child.last_log_line() or 'no log'}"
                )
        summaries = [
            read_summary(workdir / f"node{i}" / "summary.json") for i in range(options.peers)
        ]
    summary = _combine(options, summaries, time.monotonic() - started)
    if options.workdir is not None:
        summary.state_dirs = [str(workdir / f"node{i}") for i in range(options.peers)]
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(summary.to_json()) + "\n")
    return summary


def dashboard_flags(port: int | None) -> tuple[str, ...]:
    """The coordinator's flags for ``swarmtrain local --dashboard-port`` (loopback only)."""
    return () if port is None else ("--dashboard-port", str(port))


def node_argv(
    join: str,
    node_dir: Path,
    threads: int,
    *,
    verbose: bool = False,
    extra: Sequence[str] = (),
    program: Sequence[str] = SWARMTRAIN,
) -> list[str]:
    """``swarmtrain node`` on loopback with its state in ``node_dir`` and its ``--json`` summary
    at ``node_dir / "summary.json"``; ``extra`` options appended."""
    argv = [
        *program, "node", "--join", join, "--listen", "/ip4/127.0.0.1/tcp/0",
        "--state-dir", str(node_dir), "--threads", str(threads),
        "--json", str(node_dir / "summary.json"), *extra,
    ]  # fmt: skip
    return [*argv, "-v"] if verbose else argv


def read_summary(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LocalFailed(f"no summary from a node at {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise LocalFailed(f"malformed node summary at {path}")
    return data


def _mean(values: list[object]) -> float:
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    if not numbers:
        raise LocalFailed("the nodes reported no losses (no round finished)")
    return sum(numbers) / len(numbers)


def _combine(options: LocalOptions, nodes: list[dict[str, object]], seconds: float) -> LocalSummary:
    hashes = {node.get("state_hash") for node in nodes}
    eval_loss = nodes[0].get("eval_loss")
    return LocalSummary(
        rounds=options.rounds,
        peers=options.peers,
        loss_first=_mean([n.get("loss_first") for n in nodes]),
        loss_last=_mean([n.get("loss_last") for n in nodes]),
        # Node 0's held-out loss of the final global parameters: the same parameters on every
        # node when the hashes agree.
        eval_loss=float(eval_loss) if isinstance(eval_loss, int | float) else None,
        state_hashes_agree=len(hashes) == 1 and "" not in hashes,
        bytes_sent=sum(int(n.get("bytes_sent") or 0) for n in nodes),  # type: ignore[call-overload]
        seconds=seconds,
        nodes=nodes,
    )
