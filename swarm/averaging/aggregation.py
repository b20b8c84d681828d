"""Aggregation rules of one part: the weighted mean, and two Byzantine-robust rules.

Pure numpy, no IO. ``aggregate(rule, contributions, out)`` is what a part's reducer computes
(``allreduce.AllReduce``) and what ``diloco.LocalAverage`` computes in one process, so a bench in
one process runs the swarm's own code. Every rule is a pure function of the contributions (peer id
-> (float32 slice, weight)): peers are taken in sorted id order, sums are float64 in a fixed order
(numpy's own pairwise sum for a norm, sequential over peers or ranks otherwise; never BLAS, whose
order depends on the CPU), iteration counts and thresholds are constants or computed from the
inputs alone, and the result is cast to float32 once. So any peer reducing a part over one
contributor set produces the same bytes, which the all-reduce's rules (a forwarded part, a lost
reducer's part re-reduced by another peer) need.

Rules (``AGGREGATIONS``):

- ``mean``: ``reduce_part``, the weighted mean (the all-reduce's rule before robust ones existed,
  bit for bit; declared weights count as given).
- ``trimmed_mean``: per coordinate, drop the ``trim_count(n)`` largest and smallest of the n values
  (n // 4, and at least one in groups of 3 or more: a quarter of the group may lie) and average the
  rest, each kept value with its peer's capped weight. Ties are ranked in peer order.
- ``centered_clip`` (Karimireddy, He and Jaggi 2021, as hivemind's BTARD runs it per part): start
  at the coordinate-wise median v; ``CLIP_ITERATIONS`` times, v <- v + sum_i w_i c_i (x_i - v) /
  sum_i w_i with c_i = min(1, tau / |x_i - v|) (the L2 norm over the part); tau is
  ``CLIP_TAU_FACTOR`` times the median of |x_i - v| at the start. An honest group whose slices lie
  within tau of the median gets the weighted mean in one iteration; an outlier moves v by at most
  its weight share of tau per iteration.

Weights in the robust rules: each peer's declared weight counts at most the group's median weight
(the lower middle one), so a peer cannot buy influence by declaring more samples. With equal
weights (a DiLoCo run's fixed samples per round) this changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from p2p import LocalProtocolError

__all__ = [
    "AGGREGATIONS",
    "CLIP_ITERATIONS",
    "CLIP_TAU_FACTOR",
    "aggregate",
    "capped_weights",
    "centered_clip",
    "reduce_part",
    "trim_count",
    "trimmed_mean",
]

AGGREGATIONS = ("mean", "centered_clip", "trimmed_mean")
CLIP_ITERATIONS = 5
CLIP_TAU_FACTOR = 2.0
# Coordinates per block: a few peers' float64 block copies stay in cache, and a rule over a large
# part needs memory for one float64 center, not n float64 copies of the part.
_BLOCK = 1 << 14
_REDUCE_BLOCK = 1 << 15

Contributions = Mapping[bytes, tuple[np.ndarray, float]]


def aggregate(rule: str, contributions: Contributions, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 result of ``rule`` over ``contributions``, into ``out`` when given (a float32
    array of the slices' length), else a new array. Raises ``LocalProtocolError`` for an unknown
    rule, no contributions or slices of different lengths."""
    if rule == "mean":
        return reduce_part(contributions, out)
    if rule == "trimmed_mean":
        return trimmed_mean(contributions, out)
    if rule == "centered_clip":
        return centered_clip(contributions, out)
    raise LocalProtocolError(f"unknown aggregation {rule!r}; expected one of {AGGREGATIONS}")


def trim_count(n: int) -> int:
    """Values dropped at each end of a coordinate among ``n``: n // 4, at least 1 from n = 3 on
    (so that a group of three still outvotes one liar), never so many that nothing is left."""
    if n < 3:
        return 0
    return min(max(1, n // 4), (n - 1) // 2)


def capped_weights(weights: Sequence[float]) -> np.ndarray:
    """``weights`` (in peer order) each capped at their lower median, as float64."""
    array = np.asarray(weights, dtype=np.float64)
    cap = np.sort(array)[(len(array) - 1) // 2]
    return np.minimum(array, cap)


def trimmed_mean(contributions: Contributions, out: np.ndarray | None = None) -> np.ndarray:
    """Coordinate-wise trimmed mean (module docstring), float32 into ``out`` or a new array."""
    slices, weights, out = _inputs(contributions, out)
    n, trim = len(slices), trim_count(len(slices))
    for start, stop in _blocks(len(out)):
        stack = np.stack([s[start:stop] for s in slices])
        order = np.argsort(stack, axis=0, kind="stable")  # ties in peer order
        ranked = np.take_along_axis(stack, order, axis=0)
        ranked_weights = weights[order]
        acc = np.zeros(stop - start, np.float64)
        total = np.zeros(stop - start, np.float64)
        for k in range(trim, n - trim):  # kept ranks, smallest first
            acc += ranked[k].astype(np.float64) * ranked_weights[k]
            total += ranked_weights[k]
        out[start:stop] = acc / total
    return out


def centered_clip(contributions: Contributions, out: np.ndarray | None = None) -> np.ndarray:
    """Centered clipping from the coordinate-wise median (module docstring), float32 into
    ``out`` or a new array."""
    slices, weights, out = _inputs(contributions, out)
    length, n = len(out), len(slices)
    center = np.empty(length, np.float64)
    for start, stop in _blocks(length):
        ranked = np.sort(np.stack([s[start:stop] for s in slices]), axis=0).astype(np.float64)
        if n % 2:
            center[start:stop] = ranked[n // 2]
        else:
            center[start:stop] = (ranked[n // 2 - 1] + ranked[n // 2]) / 2
    squared = _squared_distances(slices, center, 0, length)
    norms = np.sqrt(squared)
    tau = CLIP_TAU_FACTOR * np.sort(norms)[(n - 1) // 2]
    total = 0.0
    for w in weights:  # in peer order, like reduce_part's total
        total += float(w)
    for iteration in range(CLIP_ITERATIONS):
        # A slice within tau of the center counts in full; one beyond it is pulled back to tau.
        # (tau = 0: most slices equal the center, which then stays put.)
        scale = np.ones(n, np.float64)
        far = norms > tau
        scale[far] = tau / norms[far]
        factors = weights * scale / total
        last = iteration == CLIP_ITERATIONS - 1
        squared = np.zeros(n, np.float64)
        for start, stop in _blocks(length):
            v = center[start:stop]
            step = np.zeros(stop - start, np.float64)
            for i, s in enumerate(slices):
                step += (s[start:stop] - v) * factors[i]
            v += step
            if not last:  # the next iteration's distances, from this block's new center
                squared += _squared_distances(slices, center, start, stop)
        norms = np.sqrt(squared)
    out[:] = center
    return out


def reduce_part(
    contributions: Mapping[bytes, tuple[np.ndarray, float]], out: np.ndarray | None = None
) -> np.ndarray:
    """Weighted mean of float32 slices, bit-identical whatever order they arrived in.

    Sums ``weight * data`` in sorted peer-id order in float64, divides by the summed weight (also in
    sorted order), casts to float32, into ``out`` when given (else a new array). Raises
    ``LocalProtocolError`` if empty or lengths differ. Works in blocks that fit in cache: the
    same operations per element, seven times faster than whole-array temporaries on a 25 MB part.
    """
    if not contributions:
        raise LocalProtocolError("reduce_part needs at least one contribution")
    peers = sorted(contributions)
    length = len(contributions[peers[0]][0])
    if any(len(contributions[peer][0]) != length for peer in peers):
        raise LocalProtocolError("contributions differ in length")
    total_weight = 0.0
    for peer in peers:
        total_weight += float(contributions[peer][1])
    if out is None:
        out = np.empty(length, dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != (length,):
        raise LocalProtocolError("out must be a float32 array of the parts' length")
    block = min(length, _REDUCE_BLOCK) or 1
    accumulator = np.empty(block, dtype=np.float64)
    product = np.empty(block, dtype=np.float64)
    for start in range(0, length, block):
        stop = min(length, start + block)
        acc, tmp = accumulator[: stop - start], product[: stop - start]
        acc.fill(0.0)
        for peer in peers:
            data, weight = contributions[peer]
            np.multiply(data[start:stop], float(weight), out=tmp, dtype=np.float64)
            acc += tmp
        np.divide(acc, total_weight, out=acc)
        out[start:stop] = acc
    return out


def _squared_distances(
    slices: list[np.ndarray], center: np.ndarray, start: int, stop: int
) -> np.ndarray:
    """Each slice's squared L2 distance to ``center`` over ``[start, stop)``, summed block by
    block in order (numpy's pairwise sum within a block: the same on every CPU)."""
    squared = np.zeros(len(slices), np.float64)
    for a, b in _blocks(stop - start):
        v = center[start + a : start + b]
        for i, s in enumerate(slices):
            d = s[start + a : start + b] - v
            squared[i] += np.sum(d * d)
    return squared


def _inputs(
    contributions: Contributions, out: np.ndarray | None
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Slices and capped weights in sorted peer order, and the output array; checks them."""
    if not contributions:
        raise LocalProtocolError("aggregation needs at least one contribution")
    peers = sorted(contributions)
    slices = [contributions[p][0] for p in peers]
    length = len(slices[0])
    if any(len(s) != length for s in slices):
        raise LocalProtocolError("contributions differ in length")
    if out is None:
        out = np.empty(length, dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != (length,):
        raise LocalProtocolError("out must be a float32 array of the parts' length")
    return slices, capped_weights([float(contributions[p][1]) for p in peers]), out


def _blocks(length: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + _BLOCK)) for a in range(0, length, _BLOCK)]
