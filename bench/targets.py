"""Real swarmtrain processes for the service benches (``bench.soak``, ``bench.fuzz``): started,
watched through /proc, and stopped."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import multiaddr
from libp2p.peer.id import ID

from bench.common import REPO


@dataclass
class Target:
    name: str
    proc: subprocess.Popen[bytes]
    addr: str
    protocols: list[str] = field(default_factory=list)

    @property
    def peer_id(self) -> ID:
        return ID.from_base58(multiaddr.Multiaddr(self.addr).value_for_protocol("p2p"))

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def start(
    name: str,
    argv: list[str],
    workdir: Path,
    ready: Callable[[str], bool],
    *,
    names_it: Callable[[str], bool] | None = None,
    peer_word: int = 1,
) -> Target:
    """Run ``swarmtrain ARGV`` (stderr to ``workdir/NAME.log``) until it prints a line that
    ``ready`` accepts. The target's address is the ``/p2p/`` word, else word number
    ``peer_word`` (a node's line names its peer id), of the last line ``names_it`` accepted
    before (default: the ready line). Raises RuntimeError if it exits or is not ready in 120 s."""
    with open(workdir / f"{name}.log", "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarmtrain.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
            stderr=log_file, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # also keeps reading afterwards: a full pipe would stall the target
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.put(raw.decode(errors="replace"))
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 120
    named = ""
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:
            break
        if (names_it or ready)(line):
            named = line
        if ready(line):
            words = named.split()
            addr = next((w for w in words if "/p2p/" in w), None)
            return Target(name, proc, addr or (words[peer_word] if len(words) > peer_word else ""))
    proc.kill()
    raise RuntimeError(f"{name} did not start: see {workdir / f'{name}.log'}")


def stop(targets: Iterable[Target]) -> None:
    for target in targets:
        target.proc.terminate()
        try:
            target.proc.wait(10)
        except subprocess.TimeoutExpired:
            target.proc.kill()


def write_run_config(path: Path, settings: dict[str, str]) -> Path:
    """``swarmtrain init PATH``, then each ``key = value`` line of ``settings`` replaced (TOML
    values; each key must occur once in the file). Returns ``path``."""
    subprocess.run(
        [sys.executable, "-m", "swarmtrain.cli", "init", str(path)],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    text = path.read_text()
    for key, value in settings.items():
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        if count != 1:
            raise ValueError(f"run.toml has {count} lines for {key!r}")
    path.write_text(text)
    return path
