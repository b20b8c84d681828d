"""Fixtures for the network-namespace NAT lab: bring the lab up and down, run real processes in
its namespaces and read their JSON lines with deadlines.

The lab needs root, iproute2 and Debian's nftables. Where they are missing the tests skip with the
reason; under ``CI=true`` a missing lab is a failure instead (CI must never go green by skipping).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NATLAB = HERE / "natlab.sh"
NAT_PEER = HERE / "nat_peer.py"
# Not the natlab.sh default ("st-"), so a developer's hand-started lab survives a test run, and
# one per pytest process, so two test runs on one machine never tear down each other's lab.
PREFIX = os.environ.get("NATLAB_PREFIX", f"stt{os.getpid()}-")


def lab_unavailable_reason() -> str | None:
    if sys.platform != "linux":
        return "the NAT lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces, nftables)"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"the NAT lab needs `{tool}` (apt-get install iproute2 nftables)"
    return None


def require_lab() -> None:
    reason = lab_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"NAT lab unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def natlab(*args: str, timeout_s: float = 30.0) -> str:
    env = {**os.environ, "NATLAB_PREFIX": PREFIX}
    done = subprocess.run(
        ["bash", str(NATLAB), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"natlab.sh {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


class LabProcess:
    """A process in one of the lab's namespaces, speaking JSON lines on stdin/stdout."""

    def __init__(
        self,
        name: str,
        namespace: str,
        argv: list[str],
        log_dir: Path,
        *,
        stop_by_signal: bool = False,
    ) -> None:
        self.name = name
        # nat_peer.py ends at end of stdin; a swarmtrain command ends on SIGINT (Ctrl+C).
        self.stop_by_signal = stop_by_signal
        self._stop_requested = False
        self.stderr_path = log_dir / f"{name}.stderr"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", PREFIX + namespace, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=ROOT,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        # A reader thread turns the blocking pipe into a queue we can wait on with a deadline.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    def read_line(self, timeout_s: float) -> str:
        """The next stdout line; fails with the process's stderr tail on deadline or exit."""
        try:
            line = self._lines.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise AssertionError(
                f"{self.name}: no line within {timeout_s:.1f} s\n{self.tail()}"
            ) from None
        if line is None:
            self._lines.put(None)  # later reads see the end too
            code = self.proc.wait(timeout=5)
            raise AssertionError(f"{self.name} exited ({code}) early\n{self.tail()}")
        return line

    def read_json(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON line (other lines skipped), with the same deadline rules."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.read_line(deadline - time.monotonic())
            if line.startswith("{"):
                return json.loads(line)

    def wait(self, timeout_s: float) -> int:
        """The exit status; fails with the stderr tail if the process outlives ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name}: still running after {timeout_s:.1f} s\n{self.tail()}"
            ) from None

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def tail(self, lines: int = 40) -> str:
        self._stderr.flush()
        text = self.stderr_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} stderr (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def request_stop(self) -> None:
        """Ask the process to exit: close stdin, or SIGINT for ``stop_by_signal`` processes."""
        if self._stop_requested:
            return
        self._stop_requested = True
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        if self.stop_by_signal and self.proc.poll() is None:
            # `ip netns exec` execs the command, so this pid is the command itself.
            self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the process to exit (``request_stop``), then terminate, then kill."""
        self.request_stop()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=3)
        self._stderr.close()


@pytest.fixture
def lab() -> Iterator[Callable[..., None]]:
    """``lab(nat1="prc", nat2="sym")`` brings the lab up; it is torn down after the test."""
    require_lab()

    def up(nat1: str = "prc", nat2: str = "prc") -> None:
        natlab("up", "--nat1", nat1, "--nat2", nat2)

    try:
        yield up
    finally:
        natlab("down")


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., LabProcess]]:
    """``spawn(name, namespace, *args)`` runs ``nat_peer.py *args`` in that namespace."""
    started: list[LabProcess] = []

    def start(name: str, namespace: str, *args: str) -> LabProcess:
        proc = LabProcess(name, namespace, [sys.executable, str(NAT_PEER), *args], tmp_path)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        _stop_all(started)


@pytest.fixture
def run_in(tmp_path: Path) -> Iterator[Callable[..., LabProcess]]:
    """``run_in(name, namespace, *argv)`` runs any command in that namespace (``swarmtrain``'s
    own processes, say); each is stopped with SIGINT, then terminated, after the test."""
    started: list[LabProcess] = []

    def start(name: str, namespace: str, *argv: str) -> LabProcess:
        proc = LabProcess(name, namespace, list(argv), tmp_path, stop_by_signal=True)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        _stop_all(started)


def _stop_all(procs: list[LabProcess]) -> None:
    # Ask all first so they shut down side by side, then reap each with its deadline.
    for proc in reversed(procs):
        proc.request_stop()
    for proc in reversed(procs):
        proc.stop()
