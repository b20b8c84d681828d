"""Fused RepOps CPU kernels in C (``repops_native.c``), built on first use with the system compiler.

Why C: rounding a matmul operand onto its grid is five eager-torch passes over memory (two
reductions, add, subtract, widen) and they cost nearly as much as the float64 GEMM itself. The
kernels do the same IEEE operations in the same order in one or two passes, so they give the
same bits as ``verify.repops.ops``'s eager code (tests compare the two on random shapes and
values); they are an accelerator, not a definition. Without a C compiler, with
``SWARMTRAIN_REPOPS_NATIVE=0``, on other devices, or when a kernel meets a non-finite value,
the eager code runs instead, with the same result.

The shared object is cached under ``$XDG_CACHE_HOME/swarmtrain`` (or ``~/.cache/swarmtrain``),
named by a hash of the source, the flags, the compiler and this CPU's feature flags (it is
built with ``-march=native``), and written by rename so that processes starting together
never load a half-written file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from verify.repops.split import Args, all_done, split

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: GCC's C default contracts a * b + c into an FMA (one rounding, not two).
# -fno-math-errno: sqrtf may then vectorize (errno is all it changes, never a result's bits).
# -fopenmp: run_ranges, the kernel split over torch's OpenMP threads (split.py); a compiler
# without OpenMP builds the kernels without it, and every call runs whole.
FLAGS = (
    "-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-shared",
    "-fPIC", "-fopenmp",
)  # fmt: skip
BUILD_TIMEOUT_S = 60.0
ADAMW_BLOCK = 256  # native.c's ADAMW_BLOCK: the kernel checks for non-finite values per block
F32, F64 = torch.float32, torch.float64


class _Loaded:
    """What this process knows of the kernels: switched on, tried to build, the library."""

    enabled = True
    tried = False
    lib: ctypes.CDLL | None = None


_loaded = _Loaded()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarmtrain"


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: RepOps runs its eager torch kernels (same bits, slower)")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"repops_native-{platform.machine()}-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
            os.close(fd)
            try:
                try:
                    _compile(compiler, FLAGS, tmp)
                except subprocess.CalledProcessError:
                    _compile(compiler, FLAGS[:-1], tmp)  # without OpenMP
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning(
                "could not build the RepOps C kernels (%s %s): eager torch kernels run instead",
                exc,
                detail.decode(errors="replace")[-500:],
            )
            return None
    lib = ctypes.CDLL(str(target))
    i64p, int_ = ctypes.POINTER(ctypes.c_int64), ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    f32 = ctypes.c_float
    signatures = {
        "grid_rows": [ptr, i64p, ptr, i64p, i64, i64, i64, i64, int_, ptr, ptr],
        "to_f32": [ptr, ptr, i64, i64, ptr],
        "exp_vec": [ptr, ptr, i64, ptr],
        "gelu_cdf": [ptr, ptr, i64, ptr],
        "gelu_backward": [ptr, ptr, ptr, ptr, i64, ptr],
        "gelu_vec": [ptr, ptr, i64, ptr],
        "gelu_backward_x": [ptr, ptr, ptr, i64, ptr],
        "softmax_rows": [ptr, ptr, i64, i64, f32, i64, i64, int_, ptr, ptr],
        "scores_grad_rows": [ptr, ptr, ptr, i64, i64, f32, ptr],
        "adamw": [ptr, ptr, ptr, ptr, i64, ptr],
        "sum_tree_axis": [ptr, i64, i64, i64, i64, ptr, ptr],
        "layernorm_stats": [ptr, i64, i64, f32, ptr, ptr],
        "layernorm_apply": [ptr, ptr, ptr, ptr, i64, i64, ptr],
        "layernorm_backward": [ptr, ptr, ptr, ptr, i64, i64, ptr, ptr],
        "layernorm_xhat_dy": [ptr, ptr, ptr, i64, i64, ptr],
    }
    for name, argtypes in signatures.items():
        kernel = getattr(lib, name)
        kernel.argtypes, kernel.restype = argtypes, int_
    lib.adamw.restype = i64
    if hasattr(lib, "run_ranges"):
        lib.run_ranges.argtypes, lib.run_ranges.restype = [int_, int_, ptr, i64p], int_
    else:  # built without OpenMP: told once, not by a failed symbol lookup every call
        lib.run_ranges = None
    return lib


def _compile(compiler: str, flags: tuple[str, ...], out: str) -> None:
    subprocess.run(
        [compiler, *flags, "-o", out, str(SOURCE), "-lm"],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they are disabled or cannot be built (logged once)."""
    if not _loaded.enabled or os.environ.get("SWARMTRAIN_REPOPS_NATIVE") == "0":
        return None
    if not _loaded.tried:
        _loaded.lib, _loaded.tried = _build(), True
    return _loaded.lib


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the eager torch kernels inside the block (tests compare the two paths)."""
    previous, _loaded.enabled = _loaded.enabled, False
    try:
        yield
    finally:
        _loaded.enabled = previous


def _strides(t: torch.Tensor) -> ctypes.Array[ctypes.c_int64]:
    return (ctypes.c_int64 * 4)(*([0] * (4 - t.dim()) + list(t.stride())))


def grid_into(x: torch.Tensor, dim: int, bits: int, out: torch.Tensor) -> bool:
    """Write ``repops_ops._grid(x, dim, bits)`` into float64 ``out`` (x's shape); False when the
    kernels do not apply (not built, not a 2-4 dim float32 CPU tensor, a non-finite value) and
    the caller must run the eager code. Split over the first axis of more than one row (a
    batch of matrices, or a matrix's rows: each row has its own grid)."""
    lib = library()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype != F32
        or out.dtype != F64
        or out.shape != x.shape
        or not 2 <= x.dim() <= 4
        or dim not in (-1, -2, x.dim() - 1, x.dim() - 2)
    ):
        return False
    if dim in (-2, x.dim() - 2):
        x, out = x.transpose(-1, -2), out.transpose(-1, -2)
    shape = [1] * (4 - x.dim()) + list(x.shape)
    xs, os_ = _strides(x), _strides(out)
    axis = next((a for a in range(3) if shape[a] > 1), 2)
    each = x.numel() // max(1, shape[axis])

    def args(lo: int, hi: int) -> Args:
        part = list(shape)
        part[axis] = hi - lo
        rows = part[2]
        work = torch.empty(2 * rows, dtype=F32)  # each row's bound, then its rounding constant
        return (
            x.data_ptr() + 4 * lo * xs[axis], xs, out.data_ptr() + 8 * lo * os_[axis], os_,
            part[0], part[1], rows, part[3], bits, work, work.data_ptr() + 4 * rows,
        )  # fmt: skip

    return all_done(split(lib, "grid_rows", shape[axis], each, args))


def to_f32_into(x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """``out = float32(x) + 0.0 (+ bias)`` for contiguous float64 ``x`` and float32 ``out`` of the
    same shape, ``bias`` broadcast over the last dim; False when the kernels do not apply."""
    lib = library()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype != F64
        or out.dtype != F32
        or out.shape != x.shape
        or not x.is_contiguous()
        or not out.is_contiguous()
        or x.dim() == 0
        or (
            bias is not None
            and (bias.dtype != F32 or not bias.is_contiguous() or bias.shape != x.shape[-1:])
        )
    ):
        return False
    rows, cols = _rows(x)
    bias_ptr = None if bias is None else bias.data_ptr()

    def args(lo: int, hi: int) -> Args:
        at = lo * cols
        return x.data_ptr() + 8 * at, out.data_ptr() + 4 * at, hi - lo, cols, bias_ptr

    split(lib, "to_f32", rows, cols, args)
    return True


def _plain(*tensors: torch.Tensor) -> bool:
    """Contiguous float32 CPU tensors of one shape: what the elementwise and row kernels take."""
    first = tensors[0]
    return all(
        t.device.type == "cpu" and t.dtype == F32 and t.is_contiguous() and t.shape == first.shape
        for t in tensors
    )


def _elementwise(kernel: str, inputs: tuple[torch.Tensor, ...], constants: torch.Tensor
                 ) -> torch.Tensor | None:  # fmt: skip
    """The library's ``kernel(*inputs, out, n, constants)`` over ranges of elements; None when
    the kernels do not apply (no library, inputs not ``_plain``) or on the kernel's refusal."""
    lib = library()
    if lib is None or not _plain(*inputs):
        return None
    out = torch.empty_like(inputs[0])

    def args(lo: int, hi: int) -> Args:
        pointers = (t.data_ptr() + 4 * lo for t in (*inputs, out))
        return *pointers, hi - lo, constants.data_ptr()

    return out if all_done(split(lib, kernel, out.numel(), 1, args)) else None


def exp(x: torch.Tensor, constants: torch.Tensor) -> torch.Tensor | None:
    """``repops_ops.exp`` in one pass, or None when the kernels do not apply."""
    return _elementwise("exp_vec", (x,), constants)


def gelu_cdf(x: torch.Tensor, constants: torch.Tensor) -> torch.Tensor | None:
    """``repops_ops._gelu_cdf`` in one pass, or None when the kernels do not apply."""
    return _elementwise("gelu_cdf", (x,), constants)


def gelu_backward(
    x: torch.Tensor, cdf: torch.Tensor, dy: torch.Tensor, constants: torch.Tensor
) -> torch.Tensor | None:
    """``repops_ops._gelu_backward`` in one pass, or None when the kernels do not apply."""
    return _elementwise("gelu_backward", (x, cdf, dy), constants)


def gelu(x: torch.Tensor, constants: torch.Tensor) -> torch.Tensor | None:
    """x * ``repops_ops._gelu_cdf(x)`` in one pass, or None when the kernels do not apply."""
    return _elementwise("gelu_vec", (x,), constants)


def gelu_backward_of_x(
    x: torch.Tensor, dy: torch.Tensor, constants: torch.Tensor
) -> torch.Tensor | None:
    """``gelu_backward`` with the cdf of ``x`` computed in the same pass, or None when the
    kernels do not apply."""
    return _elementwise("gelu_backward_x", (x, dy), constants)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def softmax_rows(
    x: torch.Tensor,
    constants: torch.Tensor,
    scale: float = 0.0,
    causal: int = 0,
    safe: bool = False,
) -> torch.Tensor | None:
    """``repops_ops.softmax_rows`` over the last dim, after ``* scale`` (float32, when not 0) and
    a causal mask (row index modulo ``causal``, when > 0); with ``safe`` a row of -inf only is 0
    (``_safe_softmax``). None when the kernels do not apply."""
    lib = library()
    if lib is None or not _plain(x) or x.numel() == 0:
        return None
    rows, cols = _rows(x)
    out = torch.empty_like(x)

    def args(lo: int, hi: int) -> Args:
        at, scratch = 4 * lo * cols, torch.empty(cols, dtype=F32)
        return (
            x.data_ptr() + at, out.data_ptr() + at, hi - lo, cols, scale, causal, lo, int(safe),
            constants.data_ptr(), scratch,
        )  # fmt: skip

    return out if all_done(split(lib, "softmax_rows", rows, cols, args)) else None


def scores_grad_rows(dp: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor | None:
    """``repops_ops._scores_grad_rows`` row by row, or None when the kernels do not apply."""
    lib = library()
    if lib is None or not _plain(dp, probs) or dp.numel() == 0:
        return None
    rows, cols = _rows(dp)
    out = torch.empty_like(dp)

    def args(lo: int, hi: int) -> Args:
        at, scratch = 4 * lo * cols, torch.empty(cols, dtype=F32)
        pointers = (t.data_ptr() + at for t in (dp, probs, out))
        return *pointers, hi - lo, cols, scale, scratch

    return out if all_done(split(lib, "scores_grad_rows", rows, cols, args)) else None


def adamw_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, constants: torch.Tensor
) -> list[tuple[int, int]] | None:
    """``repops_ops.adamw_`` in place, one pass over ranges of whole blocks; the element ranges
    it left undone (a block holding a non-finite value and the rest of its range), which the
    caller's eager code must do, or None when the kernels do not apply."""
    lib = library()
    if lib is None or not _plain(p, g, m, v):
        return None
    n = p.numel()

    def bounds(lo: int, hi: int) -> tuple[int, int]:
        return lo * ADAMW_BLOCK, min(n, hi * ADAMW_BLOCK)

    def args(lo: int, hi: int) -> Args:
        start, stop = bounds(lo, hi)
        pointers = (t.data_ptr() + 4 * start for t in (p, g, m, v))
        return *pointers, stop - start, constants.data_ptr()

    left = []
    for lo, hi, done in split(lib, "adamw", -(-n // ADAMW_BLOCK), ADAMW_BLOCK, args):
        start, stop = bounds(lo, hi)  # the kernel returns how many elements it did
        if start + done < stop:
            left.append((start + done, stop))
    return left


def sum_tree(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``repops_ops.sum_tree(x, dim)`` (the same tree, one kernel call per range of sums), or
    None when the kernels do not apply (not a float32 CPU tensor whose other dims flatten into
    one stride, a NaN)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != F32 or x.dim() == 0:
        return None
    moved = x.movedim(dim, -1)
    k = moved.shape[-1]
    if k < 2 or moved.numel() == 0:
        return None
    try:
        flat = moved.view(-1, k)
    except RuntimeError:  # the kept dims do not share one stride: a copy would be needed
        return None
    rows = flat.shape[0]
    out = torch.empty(moved.shape[:-1], dtype=F32)
    rs, ks = flat.stride()

    def args(lo: int, hi: int) -> Args:
        buf = torch.empty((hi - lo) * (k // 2 + k % 2), dtype=F32)
        source = flat.data_ptr() + 4 * lo * rs
        return source, rs, ks, hi - lo, k, out.data_ptr() + 4 * lo, buf

    return out if all_done(split(lib, "sum_tree_axis", rows, k, args)) else None


def layernorm_stats(x: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``repops_ops._layernorm_stats`` of contiguous (rows, cols) ``x``: (rows, 2) of (mean,
    rstd); None when the kernels do not apply."""
    lib = library()
    if lib is None or not _plain(x) or x.dim() != 2 or x.numel() == 0:
        return None
    rows, cols = x.shape
    stats = torch.empty(rows, 2, dtype=F32)

    def args(lo: int, hi: int) -> Args:
        buf = torch.empty(cols, dtype=F32)
        return x.data_ptr() + 4 * lo * cols, hi - lo, cols, eps, stats.data_ptr() + 8 * lo, buf

    return stats if all_done(split(lib, "layernorm_stats", rows, cols, args)) else None


def layernorm_apply(
    x: torch.Tensor, stats: torch.Tensor, g: torch.Tensor, b: torch.Tensor
) -> torch.Tensor | None:
    """``repops_ops._layernorm``: (x - mean) * rstd * g + b; None when the kernels do not
    apply."""
    lib = library()
    if lib is None or not _plain(x) or x.dim() != 2 or not _rows_of(x, stats, g, b):
        return None
    rows, cols = x.shape
    y = torch.empty_like(x)

    def args(lo: int, hi: int) -> Args:
        at = 4 * lo * cols
        return (x.data_ptr() + at, stats.data_ptr() + 8 * lo, g.data_ptr(), b.data_ptr(),
                hi - lo, cols, y.data_ptr() + at)  # fmt: skip

    split(lib, "layernorm_apply", rows, cols, args)
    return y


def layernorm_backward(
    x: torch.Tensor, stats: torch.Tensor, g: torch.Tensor, dy: torch.Tensor
) -> torch.Tensor | None:
    """``repops_ops._layernorm_backward``'s dx; None when the kernels do not apply."""
    lib = library()
    if lib is None or not _plain(x, dy) or x.dim() != 2 or not _rows_of(x, stats, g):
        return None
    rows, cols = x.shape
    dx = torch.empty_like(x)

    def args(lo: int, hi: int) -> Args:
        at, buf = 4 * lo * cols, torch.empty(3 * cols, dtype=F32)
        return (
            x.data_ptr() + at, stats.data_ptr() + 8 * lo, g.data_ptr(), dy.data_ptr() + at,
            hi - lo, cols, dx.data_ptr() + at, buf,
        )  # fmt: skip

    return dx if all_done(split(lib, "layernorm_backward", rows, cols, args)) else None


def _rows_of(x: torch.Tensor, stats: torch.Tensor, *per_column: torch.Tensor) -> bool:
    """Contiguous float32 CPU (rows, 2) statistics and (cols,) vectors for ``x``'s rows."""
    return (
        _plain(stats)
        and stats.shape == (x.shape[0], 2)
        and all(_plain(t) and t.shape == (x.shape[1],) for t in per_column)
    )


def layernorm_xhat_dy(
    x: torch.Tensor, stats: torch.Tensor, dy: torch.Tensor
) -> torch.Tensor | None:
    """(x - mean) * rstd * dy per row, one pass; None when the kernels do not apply."""
    lib = library()
    if lib is None or not _plain(x, dy) or x.dim() != 2 or not _rows_of(x, stats):
        return None
    rows, cols = x.shape
    prod = torch.empty_like(x)

    def args(lo: int, hi: int) -> Args:
        at = 4 * lo * cols
        return (x.data_ptr() + at, stats.data_ptr() + 8 * lo, dy.data_ptr() + at, hi - lo, cols,
                prod.data_ptr() + at)  # fmt: skip

    split(lib, "layernorm_xhat_dy", rows, cols, args)
    return prod
