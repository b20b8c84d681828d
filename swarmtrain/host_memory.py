"""Freed large blocks go back to the kernel at once (glibc's malloc on Linux).

Why: glibc serves an allocation below its mmap threshold from its heaps, and by default that
threshold grows (up to 32 MiB) each time a larger mmapped block is freed. After a node's first
inner steps it sits at tens of MiB, so a round's transients (a part's decoded values, its wire
bytes, a reduction's buffer: 1-32 MiB each at 100M parameters) come from the heaps, one per
worker thread that allocated them (the all-reduce reduces and decodes in worker threads), and
memory freed there mostly stays in the process: each round's transients remain in its RSS
and the next round's pile on top. A fixed threshold (setting it also turns the growth off)
keeps every block of ``THRESHOLD`` or more mmapped, and freeing one unmaps it.

Measured with ``bench.memory --params 25M --peers 2`` (README, "Host memory at real sizes"):
a node's peak RSS 1391 MiB with the default, 1077-1170 MiB with the threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_=1048576``, what ``release_large_blocks`` sets). The cost: a fresh
large block is zero-filled by the kernel on first touch (a few ms per 10 MB), which the
all-reduce's ``BufferPool`` avoids for its largest buffers by reusing them.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 1 << 20


def release_large_blocks() -> bool:
    """Fix glibc's mmap threshold at ``THRESHOLD`` for this process; True when it took effect
    (False elsewhere: another C library or OS, where nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this C library (musl has none)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
