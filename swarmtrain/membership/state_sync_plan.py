"""Which byte ranges of a state to fetch from which source: the sans-IO core of a state download.

Theory of operation
-------------------
A joiner knows the exact size of the state it wants (it builds the same model from the run spec,
so the encoding's length follows from the parameter layout) and the hash the round's majority
published. It cuts ``[0, total_bytes)`` into pieces and lets its sources pull work: a source that
is idle asks ``next_range(source)`` and gets the first piece nobody holds or fetches, so a fast
source ends up carrying more pieces than a slow one (work stealing; no bandwidth estimate needed).

* A piece is in flight at one source at a time; ``completed`` marks it held.
* ``failed(source, piece)`` drops that source for the rest of the download (a source that broke
  a transfer is dead or misbehaving, and retrying it would only cost another deadline) and puts
  its piece back at the front of the queue, so the next idle source resumes exactly the missing
  range. Pieces the dropped source completed earlier are kept: their bytes are verified as a
  whole at the end, against the published hash.
* The download is ``complete`` when every piece is held, ``stuck`` when pieces are missing and no
  live source is left; the driver then gives up (the caller retries with fresh sources).

The plan never sees bytes, sockets or clocks: the driver (``swarmtrain.membership.state_sync``)
moves bytes and checks the assembled state's hash; this class only decides. All transition logic is
here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

MIN_PIECE_BYTES = 256 * 1024
MAX_PIECE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True, order=True)
class Piece:
    """``length`` bytes at ``offset`` of the state encoding."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def piece_size(total_bytes: int, sources: int) -> int:
    """About four pieces per source, so work can move between sources when one is slow or dies,
    within ``[MIN_PIECE_BYTES, MAX_PIECE_BYTES]`` (each piece is one bulk transfer, which costs a
    handshake and a fresh data connection)."""
    wanted = -(-total_bytes // max(1, 4 * sources))
    return max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, wanted))


class RangePlan:
    """The download plan for one state of ``total_bytes`` from ``sources`` (any hashable ids).

    Raises ValueError for a negative size, a non-positive piece size or duplicate sources.
    """

    def __init__(
        self, total_bytes: int, sources: Iterable[Hashable], *, piece_bytes: int | None = None
    ) -> None:
        self.sources = list(sources)
        if total_bytes < 0:
            raise ValueError("total_bytes must be >= 0")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError("sources must be distinct")
        piece_bytes = piece_bytes or piece_size(total_bytes, len(self.sources))
        if piece_bytes <= 0:
            raise ValueError("piece_bytes must be positive")
        self.total_bytes = total_bytes
        self.pieces = [
            Piece(start, min(piece_bytes, total_bytes - start))
            for start in range(0, total_bytes, piece_bytes)
        ]
        self._queue: deque[Piece] = deque(self.pieces)
        self._in_flight: dict[Piece, Hashable] = {}
        self._held: dict[Piece, Hashable] = {}  # piece -> the source whose bytes we hold
        self._live: set[Hashable] = set(self.sources)
        self.failures: dict[Hashable, str] = {}

    # -- queries -----------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return len(self._held) == len(self.pieces)

    @property
    def stuck(self) -> bool:
        """Pieces are missing and no live source is left to fetch them."""
        return not self.complete and not self._live

    def is_live(self, source: Hashable) -> bool:
        return source in self._live

    def in_flight(self) -> dict[Piece, Hashable]:
        return dict(self._in_flight)

    def held_from(self) -> dict[Piece, Hashable]:
        """Which source's bytes we hold for each completed piece."""
        return dict(self._held)

    def missing_bytes(self) -> int:
        return self.total_bytes - sum(p.length for p in self._held)

    # -- events ------------------------------------------------------------------------------

    def next_range(self, source: Hashable) -> Piece | None:
        """The next piece for an idle ``source``, now in flight there; None when nothing is left
        to hand out right now (pieces in flight elsewhere may still come back on failure) or the
        source was dropped. Raises ValueError for an unknown source or one already busy."""
        self._known(source)
        if source not in self._live or not self._queue:
            return None
        if source in self._in_flight.values():
            raise ValueError(f"source {source!r} already has a piece in flight")
        piece = self._queue.popleft()
        self._in_flight[piece] = source
        return piece

    def completed(self, source: Hashable, piece: Piece) -> None:
        """``source`` delivered ``piece``. Raises ValueError unless it was in flight there."""
        self._take(source, piece)
        self._held[piece] = source

    def failed(self, source: Hashable, piece: Piece | None, reason: str = "") -> None:
        """``source`` failed (``piece``: the one in flight there, if any): drop the source and
        queue its piece first, so the next idle source resumes it."""
        self._known(source)
        if piece is not None:
            self._take(source, piece)
            self._queue.appendleft(piece)
        self._live.discard(source)
        self.failures.setdefault(source, reason or "failed")

    # -- internals ---------------------------------------------------------------------------

    def _known(self, source: Hashable) -> None:
        if source not in self.sources:
            raise ValueError(f"unknown source {source!r}")

    def _take(self, source: Hashable, piece: Piece) -> None:
        self._known(source)
        if self._in_flight.get(piece) != source:
            raise ValueError(f"{piece} is not in flight at {source!r}")
        del self._in_flight[piece]
