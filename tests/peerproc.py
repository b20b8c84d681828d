"""Start real peer processes and wait for their ready line: no sleeps, every wait bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]


class PeerProcess:
    """A child process whose stdout lines and stderr text are collected by reader threads."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.stderr_chunks: list[str] = []
        self._new_line = threading.Condition()
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()

    def _pump_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._new_line:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr_chunks.append(raw.decode(errors="replace"))

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_chunks)

    def wait_stderr(self, *texts: str, timeout_s: float) -> str:
        """The stderr text once it holds every one of ``texts`` (or after ``timeout_s``): a child
        logs what it did after doing it, and the reader thread lags on a loaded machine."""
        deadline = time.monotonic() + timeout_s
        while not all(t in self.stderr for t in texts) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.stderr

    def wait_line(self, predicate: object = None, *, index: int = 0, timeout_s: float) -> str:
        """Block until stdout line number ``index`` (or one matching ``predicate``) exists."""
        with self._new_line:
            ok = self._new_line.wait_for(
                lambda: self._find(predicate, index) is not None or self.proc.poll() is not None,
                timeout=timeout_s,
            )
            found = self._find(predicate, index)
        if found is None:
            code = self.proc.poll()
            state = "running" if code is None else f"exited {code}"
            raise TimeoutError(
                f"{self.argv[2:5]}: no line after {timeout_s}s (ok={ok}, {state}); "
                f"stdout={self.lines[-5:]}; stderr tail={self.stderr[-2000:]}"
            )
        return found

    def _find(self, predicate: object, index: int) -> str | None:
        if predicate is None:
            return self.lines[index] if len(self.lines) > index else None
        return next((line for line in self.lines if predicate(line)), None)  # type: ignore[operator]

    async def wait_line_async(self, predicate: object = None, *, timeout_s: float) -> str:
        return await trio.to_thread.run_sync(lambda: self.wait_line(predicate, timeout_s=timeout_s))

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGINT (Ctrl+C), then SIGKILL if it has not exited in ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


@contextmanager
def running(*argvs: Sequence[str]) -> Iterator[list[PeerProcess]]:
    procs: list[PeerProcess] = []
    try:
        for argv in argvs:
            procs.append(PeerProcess(argv))
        yield procs
    finally:
        for p in procs:
            p.stop()


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


SWARMTRAIN = [sys.executable, "-m", "swarmtrain.cli"]


def start_relay(identity: Path) -> tuple[PeerProcess, str]:
    """A `swarmtrain relay` on loopback and its join address (its first stdout line)."""
    relay = PeerProcess(
        [*SWARMTRAIN, "relay", "--identity", str(identity), "--listen", "/ip4/127.0.0.1/tcp/0"]
    )
    try:
        return relay, relay.wait_line(timeout_s=30)
    except BaseException:
        relay.stop()
        raise
