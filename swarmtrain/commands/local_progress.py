"""What ``swarmtrain local`` shows while its swarm trains.

Off a terminal (a pipe, a log file, CI) exactly the lines ``run_local`` emits: the coordinator's,
then each node's prefixed by its index (``[0] round 2 loss 3.101 ...``); tests and scripts read
them, so their shape does not change. On a terminal the same lines scroll above a ``rich``
display of the run: one bar per node (rounds done of R, its latest loss and how many peers
averaged with it) and the elapsed time, read from those very lines, so the display can never
disagree with the log.

A round is done for a node when its round line ends the round: averaged (``peers N``) or
``FAILED``. The line an overlapped round prints when only its inner phase is done ("averaging
while round r+1 trains") does not count: that round's averaging is still to come.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# "[3] round 7 loss 2.914 1234 tok/s peers 3 ..." / "... tok/s FAILED (why); ..."
ROUND_LINE = re.compile(
    r"^\[(?P<node>\d+)\] round (?P<round>\d+) loss (?P<loss>[-\d.naif]+) \d+ tok/s"
    r"(?: peers (?P<peers>\d+)| (?P<failed>FAILED))"
)


@dataclass(frozen=True)
class RoundDone:
    """A node's round line that ends a round: the fields the display shows."""

    node: int
    round: int
    loss: str
    peers: int | None  # None: the round failed


def read_round_line(line: str) -> RoundDone | None:
    """The round a node's prefixed line ends, or None for every other line."""
    match = ROUND_LINE.match(line)
    if match is None:
        return None
    peers = None if match["failed"] else int(match["peers"])
    return RoundDone(int(match["node"]), int(match["round"]), match["loss"], peers)


class LocalProgress:
    """``emit`` is ``run_local``'s line sink (called from its reader threads); use as a context
    manager so the display stops, and the terminal is whole again, however the run ends."""

    def __init__(self, peers: int, rounds: int, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._rounds = rounds
        self._lock = threading.Lock()
        self._bar: Progress | None = None
        self._tasks: dict[int, int] = {}
        if self._stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]node {task.fields[node]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rounds  loss {task.fields[loss]}  peers {task.fields[peers]}"),
                TimeElapsedColumn(),
                console=Console(file=self._stream),
            )
            for node in range(peers):
                self._tasks[node] = self._bar.add_task(
                    f"node {node}", total=rounds, node=node, loss="-", peers="-"
                )
            self._bar.start()

    @property
    def terminal(self) -> bool:
        return self._bar is not None

    def __enter__(self) -> LocalProgress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def emit(self, line: str) -> None:
        with self._lock:
            if self._bar is None:
                print(line, file=self._stream, flush=True)
                return
            self._bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            done = read_round_line(line)
            if done is None or done.node not in self._tasks:
                return
            self._bar.update(
                self._tasks[done.node],
                completed=min(done.round + 1, self._rounds),
                loss=done.loss,
                peers="failed" if done.peers is None else str(done.peers),
            )

    def close(self) -> None:
        """Stop the display (its last state stays on the screen). Safe to call twice."""
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
