"""Progress of a long benchmark, so a 25-minute run is not 25 minutes of one header line.

Every benchmark that runs longer than a few seconds reports through ``BenchProgress``:

- ``phase(text)``: a step of the run (starting processes, a method begins, a lab is built): one
  line, ``phase: <text> (<s> s after the start)``;
- ``add(name, total)`` then ``advance(name)``: counted work (rounds, steps, inputs). On a
  terminal each task has a ``rich`` bar (k of n, elapsed); otherwise (a log file, CI, a pipe) one
  plain line per task each time it passes another tenth of its work, ``<name>: k/n <unit> (<s> s
  after the start)``, so a log shows where a run is without flooding it. A bench that already
  prints a line per unit of work adds its task with ``plain_lines=False``: its own lines are the
  plain form, the bar the terminal's;
- ``line(text)``: a bench's own line (a round's figures), printed above the bars on a terminal so
  it does not tear them, as is otherwise.

The rule for every bench: progress goes to stdout, the stream the bench's other lines go to, and
ends (``close``, or leaving the ``with`` block) before the final JSON line, which stays the last
line of stdout: whatever parses a bench reads that line only. Thread-safe: benchmarks run their
methods side by side in threads.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class BenchProgress:
    """``add`` a task with its total, ``advance`` it as work is done, ``close`` at the end (or use
    it as a context manager, so a failing bench still gives the terminal back)."""

    def __init__(self, stream: TextIO | None = None, unit: str = "rounds") -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._unit = unit
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._done: dict[str, int] = {}
        self._totals: dict[str, int] = {}
        self._tenths: dict[str, int] = {}
        self._units: dict[str, str] = {}
        self._plain_lines: dict[str, bool] = {}
        self._bar: Progress | None = None
        self._tasks: dict[str, int] = {}
        if self._stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]{task.description:>13}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                TimeElapsedColumn(),
                console=Console(file=self._stream),
            )
            self._bar.start()

    def __enter__(self) -> BenchProgress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def terminal(self) -> bool:
        """Whether the stream is a terminal (bars) rather than a log (plain lines)."""
        return self._bar is not None

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._started

    def add(self, name: str, total: int, unit: str | None = None, plain_lines: bool = True) -> None:
        """A task of ``total`` units (``unit``: the progress's own by default); ``plain_lines``
        False: no tenth lines off a terminal (the bench prints its own line per unit)."""
        with self._lock:
            self._done[name], self._totals[name], self._tenths[name] = 0, max(total, 1), 0
            self._units[name] = unit or self._unit
            self._plain_lines[name] = plain_lines
            if self._bar is not None:
                self._tasks[name] = self._bar.add_task(name, total=total, unit=self._units[name])

    def advance(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._done[name] += n
            done, total = self._done[name], self._totals[name]
            if self._bar is not None:
                self._bar.update(self._tasks[name], completed=done)
                return
            tenth = min(done, total) * 10 // total
            if tenth > self._tenths[name]:
                self._tenths[name] = tenth
                if self._plain_lines[name]:
                    self._print(
                        f"{name:>13}: {done}/{total} {self._units[name]} "
                        f"({self.elapsed_s():.0f} s after the start)"
                    )

    def reach(self, name: str, done: int) -> None:
        """Advance ``name`` to ``done`` units (a timed soak: seconds so far); never backwards."""
        with self._lock:
            step = done - self._done[name]
        if step > 0:
            self.advance(name, step)

    @contextmanager
    def ticking(self, name: str, total_s: float) -> Iterator[None]:
        """A task of ``total_s`` seconds advanced by the clock while the block runs: for work
        that reports only at its end (workers given a wall-clock budget)."""
        self.add(name, round(total_s), unit="s")
        started = time.monotonic()
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(1.0):
                self.reach(name, int(time.monotonic() - started))

        ticker = threading.Thread(target=tick, name=f"progress {name}", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()

    def phase(self, text: str) -> None:
        """One line saying what the bench does now."""
        with self._lock:
            self._print(f"phase: {text} ({self.elapsed_s():.0f} s after the start)")

    def line(self, text: str) -> None:
        """A bench's own line, printed above the bars on a terminal."""
        with self._lock:
            self._print(text)

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        """Stop the bars (their last state stays on the screen). Safe to call twice."""
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
