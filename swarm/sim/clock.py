"""Virtual time: one heap of timed callbacks, run in time order (ties in scheduling order).

Nothing here reads a wall clock or sleeps: ``now`` only moves when the next event is taken off
the heap, so a simulated hour of a thousand peers costs what its events cost, and two runs that
schedule the same events run them in the same order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class Clock:
    """``at(t, fn, *args)`` schedules ``fn(*args)`` at virtual time ``t``; ``run`` takes events
    off the heap in (time, scheduling order) until none is left or the next is past ``until``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        if not t >= self.now:  # also refuses NaN
            raise ValueError(f"cannot schedule at {t!r}, before now ({self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to ``until`` (inclusive), or until ``stop()`` is true after one."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events_run += 1
            fn(*args)
            if stop is not None and stop():
                return
        if until != math.inf and until > self.now:
            self.now = until

    @property
    def pending(self) -> int:
        return len(self._heap)
