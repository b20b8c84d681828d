"""Run a compiled RepOps kernel over torch's thread count, split by output rows or elements.

Why this is reproducible: every kernel of ``verify/repops/native.c`` computes each output row
(or element) from that row's inputs alone, in a fixed order, so cutting the rows into ranges
changes no bit; nothing is reduced across a cut. The ranges run on a small pool of Python
threads (ctypes releases the GIL around each foreign call), one range in the calling thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

# Below this many elements a kernel runs whole: handing a range to a pool thread costs tens of
# microseconds, about what a kernel spends on 32K elements.
MIN_ELEMENTS_PER_THREAD = 1 << 15


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._workers = 0

    def get(self, workers: int) -> ThreadPoolExecutor:
        """An executor of at least ``workers`` threads. A smaller one it replaces is not shut
        down: a caller in another thread may still be submitting to it; its threads end once
        the last reference to it is gone (ThreadPoolExecutor's own weakref callback)."""
        with self._lock:
            if self._executor is None or self._workers < workers:
                self._executor = ThreadPoolExecutor(workers, thread_name_prefix="repops")
                self._workers = workers
            return self._executor


_POOL = _Pool()


def threads_for(count: int, elements_each: int) -> int:
    """How many ranges to cut ``count`` rows of ``elements_each`` elements into: 1 unless
    ``SWARMTRAIN_REPOPS_SPLIT=1``; then torch's intra-op thread count, fewer when the ranges
    would be small. Off by default: every measurement so far (a shared 2-core machine at load
    3-22) found split steps slower, a range handed to another thread waiting for a core."""
    if os.environ.get("SWARMTRAIN_REPOPS_SPLIT") != "1":
        return 1
    by_size = (count * max(1, elements_each)) // MIN_ELEMENTS_PER_THREAD
    return max(1, min(torch.get_num_threads(), count, by_size))


def split(count: int, elements_each: int, run: Callable[[int, int], int]) -> int:
    """``run(lo, hi)`` over ranges covering ``[0, count)`` in order, in parallel; returns the
    bitwise OR of their return codes (a kernel's 1 means: leave this call to the eager code)."""
    threads = threads_for(count, elements_each)
    if threads == 1:
        return run(0, count)
    bounds = [count * i // threads for i in range(threads + 1)]
    pool = _POOL.get(threads - 1)
    futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    code = run(bounds[0], bounds[1])
    for future in futures:
        code |= future.result()
    return code
