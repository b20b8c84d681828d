"""Several memory-mapped token files read as one stream, without concatenating them in memory.

Why: ``[data] kind = "tokens"`` is for datasets larger than RAM (nanoGPT's ``.bin`` shards). A
``TokenStream`` keeps each file mapped and answers what a ``Corpus`` part is asked for (its
length, windows and sampled positions, a copy of a slice) by reading only those tokens, across
file boundaries where a window spans two files. It reads exactly the tokens the concatenation
would hold at the same positions, so batches, the held-out split and the fingerprint are those
of the concatenated stream: a pure function of (run seed, round, peer id) as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Tokens a scan reads at a time (``max_token``): 16M uint32 at most 64 MiB, whatever the file.
SCAN_TOKENS = 1 << 24


class TokenStream:
    """The 1-d concatenation of ``arrays`` (same dtype), or its ``[start, stop)`` part; read
    only. Slicing gives another view; indexing by positions, or ``np.asarray``, copies just the
    tokens asked for."""

    ndim = 1

    def __init__(self, arrays: Sequence[np.ndarray], start: int = 0, stop: int | None = None):
        self._arrays = tuple(arrays)
        self._ends = np.cumsum([len(a) for a in self._arrays], dtype=np.int64)
        self._starts = self._ends - [len(a) for a in self._arrays]
        self._start = start
        self._stop = int(self._ends[-1]) if stop is None else stop
        self.dtype = self._arrays[0].dtype

    def __len__(self) -> int:
        return self._stop - self._start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("a TokenStream slice takes no step")
            return TokenStream(self._arrays, self._start + start, self._start + max(start, stop))
        positions = np.asarray(key, dtype=np.int64)
        if positions.size and (positions.min() < -len(self) or positions.max() >= len(self)):
            raise IndexError(f"position out of range for a stream of {len(self)} tokens")
        absolute = np.where(positions < 0, positions + len(self), positions) + self._start
        which = np.searchsorted(self._ends, absolute, side="right")
        out = np.empty(positions.shape, dtype=self.dtype)
        for index in np.unique(which):
            here = which == index
            out[here] = self._arrays[index][absolute[here] - self._starts[index]]
        return out[()] if out.ndim == 0 else out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = np.empty(len(self), dtype=self.dtype)
        for array, begin, end in zip(self._arrays, self._starts, self._ends, strict=True):
            lo, hi = max(self._start, int(begin)), min(self._stop, int(end))
            if lo < hi:
                out[lo - self._start : hi - self._start] = array[lo - begin : hi - begin]
        return out if dtype is None else out.astype(dtype)


def max_token(array: np.ndarray) -> int:
    """The largest id in a (memory-mapped) token array, read ``SCAN_TOKENS`` at a time so a
    file larger than memory is never loaded whole."""
    return max(int(array[i : i + SCAN_TOKENS].max()) for i in range(0, len(array), SCAN_TOKENS))
