"""What a peer declares as its bandwidth, from what its uploads achieved (sans-IO).

A peer's share of the reduction is proportional to the bandwidth it declares (``partition``), so a
peer with a slow uplink reduces and sends less. Declaring a noisy measurement would reshuffle the
parts every round and let the slowest share set the round's pace; so the estimate is smoothed,
and the declared value moves only when the smoothed measurement is off by more than ``SLACK``
times, to a power of two. ``share_weights`` then turns a group's declarations into partition
weights that only separate peers a factor of 4 or more apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SLACK = 2.0
SMOOTHING = 0.5
MIN_BPS = 1e5  # below a modem: a measurement this low is an artefact (a tiny or stalled round)
MAX_BPS = 1e12


@dataclass
class BandwidthEstimate:
    """``declared`` starts at ``initial_bps``; ``observe`` feeds one round's measured upload rate
    (bits per second, or None when the round moved no bulk data)."""

    initial_bps: float = 1e9
    smoothed: float | None = None
    declared: float = 0.0

    def __post_init__(self) -> None:
        if not MIN_BPS <= self.initial_bps <= MAX_BPS:
            raise ValueError(f"initial_bps {self.initial_bps} outside [{MIN_BPS}, {MAX_BPS}]")
        self.declared = self.declared or self.initial_bps

    def observe(self, measured_bps: float | None) -> float:
        """Fold in one measurement; returns the value to declare next."""
        if measured_bps is None or not math.isfinite(measured_bps) or measured_bps <= 0:
            return self.declared
        measured = min(MAX_BPS, max(MIN_BPS, measured_bps))
        if self.smoothed is None:
            self.smoothed = measured
        else:
            self.smoothed = SMOOTHING * self.smoothed + (1 - SMOOTHING) * measured
        ratio = self.smoothed / self.declared
        if ratio > SLACK or ratio < 1 / SLACK:
            self.declared = 2.0 ** round(math.log2(self.smoothed))
        return self.declared


def share_weights(declared_bps: list[float]) -> list[int]:
    """Each member's weight in ``partition``, from the bandwidths the members declared: members
    within 4x of the fastest share equally, slower ones get a quarter per factor of 4. Measured
    rates wobble by 2-4x between rounds on a loaded machine; proportional parts would follow the
    noise and let the most loaded peer carry the biggest part. A function of the declarations
    only, so every member computes the same parts."""
    fastest = max(declared_bps, default=1.0)
    weights = []
    for bps in declared_bps:
        if bps >= fastest:
            level = 0.0
        elif bps <= 0:
            level = 8.0  # declared nothing: the smallest share
        else:
            level = min(8.0, (math.log(fastest) - math.log(bps)) / math.log(4))
        weights.append(4 ** (8 - math.floor(level)))
    return weights
