"""Rejected input, counted always and logged at most once per peer and kind per interval.

A service that meets strangers sees garbage all day. One WARNING line per bad input turned 26,000
hostile inputs into 8 MB of log, and decode errors that quoted what they received made one 17 KiB
input a 60,053-character line. So a rejection is *counted* every time (``counts``, exported by the
host's ``statistics()``) but *logged* only when it is the first of its (peer, kind) in an
interval; the next line after the interval says how many were suppressed. A detail is cut to
``MAX_DETAIL_CHARS``, so no line echoes more than a few bytes of what a peer sent. The number of
(peer, kind) pairs remembered is capped (least recently seen forgotten first), so a stream of new
identities cannot grow it either.

Sans-IO: the clock is passed in; the host's drivers call ``record`` and log what it returns.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_DETAIL_CHARS = 160
DEFAULT_INTERVAL_S = 60.0
DEFAULT_MAX_TRACKED = 4096


@dataclass
class _Window:
    started: float
    suppressed: int = 0


class RejectionLog:
    def __init__(
        self, *, interval_s: float = DEFAULT_INTERVAL_S, max_tracked: int = DEFAULT_MAX_TRACKED
    ) -> None:
        self.interval_s = interval_s
        self.max_tracked = max_tracked
        self.counts: dict[str, int] = {}
        self.total = 0
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()

    def record(self, peer: str, kind: str, detail: str, now: float) -> str | None:
        """Count one rejection of ``kind`` from ``peer``; the line to log now, or None."""
        self.total += 1
        self.counts[kind] = self.counts.get(kind, 0) + 1
        key = (peer, kind)
        window = self._windows.get(key)
        if window is not None and now - window.started < self.interval_s:
            window.suppressed += 1
            self._windows.move_to_end(key)
            return None
        suppressed = window.suppressed if window is not None else 0
        self._windows[key] = _Window(now)
        self._windows.move_to_end(key)
        while len(self._windows) > self.max_tracked:
            self._windows.popitem(last=False)
        line = f"rejected {kind} from {peer}: {shorten(detail)}"
        if suppressed:
            line += f" ({suppressed} more from this peer in the previous {self.interval_s:g} s)"
        return line


def shorten(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` on one line and at most ``limit`` characters (a peer's bytes stay out of logs)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
