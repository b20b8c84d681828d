"""The layout of a hierarchical all-reduce: peers on a grid of rows, the vector in columns.

``grid_plan`` is a pure function of the round's members (peer ids and declared weights), the
vector's length and the largest row: every peer that read the same declarations computes the same
plan, byte for byte. Rows are contiguous runs of the peers in sorted id order (so that summing the
rows one after the other, each in sorted order, *is* the flat all-reduce's one summation order),
``ceil(n / row_size)`` of them, sizes differing by at most one. The vector is cut into ``columns``
equal parts (the smallest row's size: every row has a peer for every column), and each part into
``rows`` sub-parts, the pieces the chain of partial sums carries (``hierarchical``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from p2p import LocalProtocolError

__all__ = ["GridPlan", "grid_plan", "uses_grid"]


@dataclass(frozen=True, slots=True)
class GridPlan:
    """Members sorted by id with their weights; row k is ``peers[bounds[k]:bounds[k + 1]]``."""

    peers: tuple[bytes, ...]
    weights: tuple[float, ...]
    bounds: tuple[int, ...]
    columns: int
    numel: int

    @property
    def rows(self) -> int:
        return len(self.bounds) - 1

    def row_of(self, index: int) -> int:
        """The row of ``peers[index]``."""
        return bisect.bisect_right(self.bounds, index) - 1

    def row(self, k: int) -> range:
        """Indices into ``peers`` of row ``k``."""
        return range(self.bounds[k], self.bounds[k + 1])

    def part(self, column: int) -> tuple[int, int]:
        """``[start, stop)`` of column ``column`` in the vector."""
        return self.numel * column // self.columns, self.numel * (column + 1) // self.columns

    def sub(self, column: int, j: int) -> tuple[int, int]:
        """``[start, stop)`` of sub-part ``j`` of column ``column`` in the vector."""
        start, stop = self.part(column)
        size = stop - start
        return start + size * j // self.rows, start + size * (j + 1) // self.rows


def grid_plan(
    peers: Sequence[bytes], weights: Sequence[float], numel: int, row_size: int
) -> GridPlan:
    """The plan for these members (any order; one weight each). Raises ``LocalProtocolError``
    for duplicate peers, no peers, a weight that is not positive and finite, ``numel < 0`` or
    ``row_size < 1``."""
    if not peers or len(peers) != len(weights) or len(set(peers)) != len(peers):
        raise LocalProtocolError("grid_plan needs unique peers, one weight each")
    if numel < 0 or row_size < 1:
        raise LocalProtocolError(f"grid_plan needs numel >= 0 and row_size >= 1: {row_size}")
    if any(not (isinstance(w, int | float) and math.isfinite(w) and w > 0) for w in weights):
        raise LocalProtocolError("weights must be positive and finite")
    order = sorted(range(len(peers)), key=lambda i: peers[i])
    n = len(peers)
    rows = math.ceil(n / row_size)
    bounds = tuple(n * k // rows for k in range(rows + 1))
    return GridPlan(
        peers=tuple(peers[i] for i in order),
        weights=tuple(float(weights[i]) for i in order),
        bounds=bounds,
        columns=n // rows,
        numel=numel,
    )


def uses_grid(group_size: int, row_size: int | None, *, plain_mean: bool) -> bool:
    """Whether a round of ``group_size`` members runs hierarchically (rows of at most
    ``row_size``) rather than as one flat butterfly: a pure function of the group and the run's
    config, so every member of the round drives the same machine. ``row_size`` None: never.
    ``plain_mean``: the round is an unaudited, unchecked weighted mean under a dense codec, the
    only one the hierarchical machine computes (its chain carries float64 sums of the decoded
    slices; a sparse codec, a robust rule, an audit or a slice check needs the flat machine:
    ``averager.hierarchical``)."""
    return row_size is not None and plain_mean and group_size > row_size
