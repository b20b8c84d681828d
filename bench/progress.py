"""Progress of a long benchmark, so a 25-minute run is not 25 minutes of one header line.

On a terminal each task has a ``rich`` bar (round k of n, elapsed); otherwise (a log file, CI)
one plain line per task each time it passes another tenth of its work, so a log shows where a run
is without flooding it. Thread-safe: the benchmark's methods run side by side in threads.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class BenchProgress:
    """``add`` a task with its total, ``advance`` it as work is done, ``close`` at the end."""

    def __init__(self, stream: TextIO | None = None, unit: str = "rounds") -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._unit = unit
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._done: dict[str, int] = {}
        self._totals: dict[str, int] = {}
        self._tenths: dict[str, int] = {}
        self._bar: Progress | None = None
        self._tasks: dict[str, int] = {}
        if self._stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]{task.description:>13}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit),
                TimeElapsedColumn(),
                console=Console(file=self._stream),
            )
            self._bar.start()

    def add(self, name: str, total: int) -> None:
        with self._lock:
            self._done[name], self._totals[name], self._tenths[name] = 0, max(total, 1), 0
            if self._bar is not None:
                self._tasks[name] = self._bar.add_task(name, total=total)

    def advance(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._done[name] += n
            done, total = self._done[name], self._totals[name]
            if self._bar is not None:
                self._bar.update(self._tasks[name], completed=done)
                return
            tenth = done * 10 // total
            if tenth > self._tenths[name]:
                self._tenths[name] = tenth
                elapsed = time.perf_counter() - self._started
                print(
                    f"{name:>13}: {done}/{total} {self._unit} ({elapsed:.0f} s after the start)",
                    file=self._stream,
                    flush=True,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
