"""Real swarmtrain processes for the service benches (``bench.soak``, ``bench.fuzz``): started,
watched through /proc, and stopped."""

from __future__ import annotations

import os
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


def start(name: str, argv: list[str], workdir: Path, ready: Callable[[str], bool]) -> Target:
    """Run ``swarmtrain ARGV`` (stderr to ``workdir/NAME.log``) until it prints a line that
    ``ready`` accepts; the target's address is that line's ``/p2p/`` word, else its second word
    (a node's line names its peer id). Raises RuntimeError if no such line comes in 120 s."""
    with open(workdir / f"{name}.log", "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarmtrain.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
            stderr=log_file, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line:
            break
        if ready(line):
            words = line.split()
            addr = next((w for w in words if "/p2p/" in w), None)
            # Keep reading what it prints, or a full pipe would stall it.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return Target(name, proc, addr or (words[1] if len(words) > 1 else ""))
    proc.kill()
    raise RuntimeError(f"{name} did not start: see {workdir / f'{name}.log'}")


def stop(targets: Iterable[Target]) -> None:
    for target in targets:
        target.proc.terminate()
        try:
            target.proc.wait(10)
        except subprocess.TimeoutExpired:
            target.proc.kill()
