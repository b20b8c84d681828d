"""Reusable float32 buffers for the all-reduce's large temporaries.

Why: a fresh 25-100 MB numpy array is fresh anonymous memory, and the kernel zeroes every page
of it on first touch. Measured with ``perf`` on ``bench.allreduce`` (4 peers, 25M floats,
loopback): a quarter of the workers' CPU went to ``clear_page_erms`` under the page faults of
the result vector and of the slices being received, each allocated anew every round.

A buffer is handed out again only when nothing else refers to it any more: the pool checks the
array's reference count, so a result the caller still holds (or any view of it, which refers
to its base) is never overwritten. Buffers are kept by size; a pool holds at most ``limit``
bytes and drops the oldest beyond that.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np

# References to a free buffer seen by ``sys.getrefcount`` inside ``take``: the pool's list,
# the loop variable and getrefcount's own argument.
_FREE_REFS = 3


class BufferPool:
    """float32 arrays by length, lent out again once nothing else refers to them."""

    def __init__(self, limit_bytes: int = 1 << 30) -> None:
        self.limit_bytes = limit_bytes
        self._buffers: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self.reused = 0
        self.allocated = 0
        self._lock = threading.Lock()  # the all-reduce reduces in a worker thread

    def take(self, length: int) -> np.ndarray:
        """A float32 array of ``length`` (contents undefined): a free one kept here, else new."""
        with self._lock:
            return self._take(length)

    def _take(self, length: int) -> np.ndarray:
        kept = self._buffers.get(length, [])
        for buffer in kept:
            if sys.getrefcount(buffer) <= _FREE_REFS:
                self.reused += 1
                return buffer
        buffer = np.empty(length, np.float32)
        self.allocated += 1
        if buffer.nbytes <= self.limit_bytes:
            self._buffers.setdefault(length, []).append(buffer)
            self._buffers.move_to_end(length)
            self._trim()
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for kept in self._buffers.values() for b in kept)

    def _trim(self) -> None:
        while self.nbytes > self.limit_bytes:
            length, kept = next(iter(self._buffers.items()))
            kept.pop(0)
            if not kept:
                del self._buffers[length]
