"""Run a compiled RepOps kernel over torch's thread count, split by output rows or elements.

Why this is reproducible: every kernel of ``verify/repops/native.c`` computes each output row
(or element) from that row's inputs alone, in a fixed order, so cutting the rows into ranges
changes no bit; nothing is reduced across a cut.

Where the ranges run: on OpenMP's threads, through ``run_ranges`` in native.c. The library links
libgomp.so.1, which torch has already loaded, so they are torch's own worker threads. A pool of
Python threads was tried first: its thread waited for the core that one of OpenMP's workers held
while it spun after torch's last parallel region, and split steps came out slower than whole
ones. A library built without OpenMP (a compiler without it) runs every call whole.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence

import torch

# Below this many elements a range is not worth a thread: handing one over costs a few
# microseconds, what a kernel spends on some thousands of elements.
MIN_ELEMENTS_PER_THREAD = 1 << 15

# run_ranges' kernel numbers (native.c's call_kernel) and its argument slots per range.
KERNELS = (
    "grid_rows", "to_f32", "exp_vec", "gelu_cdf", "gelu_backward", "gelu_vec", "gelu_backward_x",
    "softmax_rows", "scores_grad_rows", "adamw", "sum_tree_axis", "layernorm_stats",
    "layernorm_apply", "layernorm_backward", "layernorm_xhat_dy",
)  # fmt: skip
SLOTS = 12

# A kernel's arguments for one range: ints (pointers, sizes), floats, ctypes arrays (passed by
# address) and tensors (passed by their data pointer, kept alive until the range ran).
Args = Sequence[object]


class _Slot(ctypes.Union):
    _fields_ = (("i", ctypes.c_int64), ("d", ctypes.c_double))


def threads_for(count: int, elements_each: int) -> int:
    """How many ranges to cut ``count`` rows of ``elements_each`` elements into: torch's
    intra-op thread count, fewer when the ranges would be small; 1 with
    ``SWARMTRAIN_REPOPS_SPLIT=0``."""
    if os.environ.get("SWARMTRAIN_REPOPS_SPLIT") == "0":
        return 1
    by_size = (count * max(1, elements_each)) // MIN_ELEMENTS_PER_THREAD
    return max(1, min(torch.get_num_threads(), count, by_size))


def _value(arg: object) -> object:
    """What a ctypes call takes for ``arg``: a tensor's data pointer, else ``arg`` itself."""
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def _slot(arg: object) -> int:
    """``arg`` in an int64 slot: a ctypes array by its address."""
    value = ctypes.addressof(arg) if isinstance(arg, ctypes.Array) else _value(arg)
    return 0 if value is None else int(value)  # type: ignore[call-overload]


def split(
    lib: ctypes.CDLL,
    kernel: str,
    count: int,
    elements_each: int,
    args_of: Callable[[int, int], Args],
) -> list[tuple[int, int, int]]:
    """``kernel(*args_of(lo, hi))`` over ranges covering ``[0, count)`` in order, in parallel
    when the library has ``run_ranges`` (None: built without OpenMP); each range's
    ``(lo, hi, return value)``."""
    function = getattr(lib, kernel)
    ranges = threads_for(count, elements_each) if lib.run_ranges is not None else 1
    if ranges == 1:
        args = args_of(0, count)  # held: a scratch tensor among them must outlive the call
        return [(0, count, function(*map(_value, args)))]
    bounds = [count * r // ranges for r in range(ranges + 1)]
    held = [args_of(bounds[r], bounds[r + 1]) for r in range(ranges)]
    floats = [t is ctypes.c_float for t in function.argtypes]
    slots = (_Slot * (SLOTS * ranges))()
    for r, args in enumerate(held):
        for j, arg in enumerate(args):
            if floats[j]:
                slots[r * SLOTS + j].d = float(arg)  # type: ignore[arg-type]
            else:
                slots[r * SLOTS + j].i = _slot(arg)
    codes = (ctypes.c_int64 * ranges)()
    lib.run_ranges(KERNELS.index(kernel), ranges, ctypes.addressof(slots), codes)
    return [(bounds[r], bounds[r + 1], codes[r]) for r in range(ranges)]


def all_done(results: list[tuple[int, int, int]]) -> bool:
    """Whether every range returned 0 (a kernel's 1 means: leave this call to the eager code)."""
    return not any(code for _, _, code in results)
