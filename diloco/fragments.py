"""Streaming DiLoCo's fragments: the model's trainable tensors cut into F contiguous groups.

In round r only fragment ``r mod F`` is averaged and outer-stepped (Streaming DiLoCo, DeepMind
2025), so a round sends about 1/F of the model and each fragment syncs every F rounds. Every peer
must cut the model the same way, so the cut is a pure function of the tensors' sizes in model
order (the layout ``layout_digest`` hashes): integer arithmetic only, a tensor never split.

The rule: the k-th cut (k = 1 .. F-1) is at the tensor boundary whose element count before it
is nearest k/F of the total (ties to the earlier boundary), kept strictly after the previous cut
and early enough to leave one tensor to each fragment still to come. Fragments are therefore
about equal in elements, as equal as the tensor sizes allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise


@dataclass(frozen=True)
class Fragment:
    """Fragment ``index``: tensors ``[first, last)`` of the layout, elements ``[start, stop)`` of
    the flat vector; ``sizes`` are its tensors' element counts (the averaging's segments)."""

    index: int
    first: int
    last: int
    start: int
    stop: int
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def fragments_of(sizes: Sequence[int], count: int) -> tuple[Fragment, ...]:
    """``count`` contiguous fragments of the tensors of ``sizes`` (element counts in model
    order), about equal in elements (module docstring). Raises ValueError when ``count`` is not
    a positive int, is more than the tensors, or a size is negative."""
    n = len(sizes)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"fragments must be a positive integer, got {count!r}")
    if count > n:
        raise ValueError(f"fragments = {count} is more than the model's {n} trainable tensors")
    if any(size < 0 for size in sizes):
        raise ValueError("tensor sizes must be non-negative")
    # ends[i]: elements in tensors [0, i); a cut at i means tensor i starts a fragment.
    ends = [0, *accumulate(sizes)]
    total = ends[-1]
    cuts = [0]
    for k in range(1, count):
        low, high = cuts[-1] + 1, n - (count - k)
        # |ends[i] / total - k / count|, scaled by total * count to stay in integers.
        cuts.append(min(range(low, high + 1), key=lambda i: abs(ends[i] * count - k * total)))
    cuts.append(n)
    return tuple(
        Fragment(f, a, b, ends[a], ends[b], tuple(sizes[a:b]))
        for f, (a, b) in enumerate(pairwise(cuts))
    )


def fragment_at(fragments: Sequence[Fragment], round: int) -> Fragment:
    """The fragment round ``round`` averages: ``round mod F``."""
    return fragments[round % len(fragments)]
