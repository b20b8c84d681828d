"""A progress bar of a round's inner phase when a person watches a terminal; plain round lines
otherwise (a log file, ``swarmtrain local``'s pipes, CI).

The bar (``rich``) shows the round, the inner step out of H, the running mean loss and tokens/s;
it is transient: when the round ends it disappears and the round's line is printed as before, so
the lines of a run look the same with or without a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class InnerProgress:
    """``start`` a round, ``step`` after each inner step, ``stop`` before its line is printed.
    Does nothing unless ``stream`` is a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        stream = stream if stream is not None else sys.stdout
        self.enabled = stream.isatty()
        self._progress: Progress | None = None
        self._task = 0
        self._started = 0.0
        self._tokens = 0
        self._losses: list[float] = []
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps  loss {task.fields[loss]}  {task.fields[speed]} tok/s"),
                TimeElapsedColumn(),
                console=Console(file=stream),
                transient=True,
            )

    def start(self, round_number: int, steps: int) -> None:
        if self._progress is None:
            return
        self._started = time.perf_counter()
        self._tokens = 0
        self._losses = []
        self._progress.start()
        self._task = self._progress.add_task(
            f"round {round_number}", total=steps, loss="-", speed="-"
        )

    def step(self, loss: float, tokens: int) -> None:
        if self._progress is None:
            return
        self._losses.append(loss)
        self._tokens += tokens
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._progress.update(
            self._task,
            advance=1,
            loss=f"{sum(self._losses) / len(self._losses):.3f}",
            speed=f"{self._tokens / elapsed:.0f}",
        )

    def stop(self) -> None:
        """End the bar (again: nothing)."""
        if self._progress is None or not self._progress.live.is_started:
            return
        self._progress.remove_task(self._task)
        self._progress.stop()
