"""RepOps kernels in torch: every operator of the default model's training step, reproducible.

How each result is made independent of thread count, BLAS library and device:

* **Matmuls are exact.** A matmul (or ``sum_exact``) first rounds each row (or column) of its
  operands to a grid of ``2**(e - bits)``, where ``2**e`` bounds the row's largest magnitude (a
  power of two, so scaling is exact). The scaled values are integers; their products and any
  partial sums stay below ``2**53``, so float64 holds every partial sum exactly, and any summation
  order, blocking, FMA use or thread split gives the same bits. The result is rounded to float32
  once. This lets native float64 GEMM do the work (the Ozaki-scheme idea; DESIGN.md "verify").
* **Sums follow a fixed pairwise tree** of float32 additions (``sum_tree``): row sums of
  softmax, LayerNorm statistics, bias gradients and the loss mean.
* **Elementwise arithmetic is IEEE.** ``+ - * /`` and ``sqrt`` are correctly rounded in float32
  everywhere; each is a separate kernel, so no compiler can fuse two of them into an FMA.
* **Transcendental functions are ours.** ``exp``, ``erf`` and ``log`` are polynomials evaluated
  with the operations above (a library ``exp`` differs across libm, SLEEF, CUDA, and even between
  torch's vector body and scalar tail), so they are reproducible, accurate to a few float32 ulp.

``verify.repops.reference`` implements the same kernels in numpy; tests compare the two bit for bit.
Kernels never modify their inputs (trace outputs are shared, read-only values). Longer than our
usual 400 lines on purpose: every torch kernel of the registry lives here, so that the numpy
mirror can be read side by side, operator for operator.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from verify.repops import native as repops_native
from verify.repops.graph import OpFn, pow_int

F32, F64 = torch.float32, torch.float64
MAX_CHUNK = 2048  # longest inner dimension one exact float64 GEMM handles
E_MIN = -100  # grid exponents are raised to this (keeps the float32 rounding constant normal)
EXP_LO, EXP_HI = -86.0, 88.0  # keep k = round(x / ln 2) in [-124, 127]
LOG2E = 1.44269504088896341
EXP_C1, EXP_C2 = 0.693359375, -2.12194440e-4  # ln 2 split; C1 has 9 bits so k * C1 is exact
# Cephes expf minimax coefficients on [-ln2/2, ln2/2], highest degree first.
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1)  # fmt: skip
# Eigen's fast float erf: erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4], highest degree first.
ERF_NUM = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
           -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
           -1.60960333262415e-02)  # fmt: skip
ERF_DEN = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
           -7.37332916720468e-03, -1.42647390514189e-02)  # fmt: skip
INV_SQRT2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
SQRT_HALF = 0.7071067811865476
LN2 = 0.6931471805599453
# log(f) = 2 atanh(u), u = (f - 1) / (f + 1): coefficients 1/(2k+1), highest degree first.
LOG_SERIES = tuple(1.0 / (2 * k + 1) for k in range(8, -1, -1))
# Cephes tanhf: tanh(x) ~ x + x^3 P(x^2) for |x| < TANH_SMALL, highest degree first.
TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
             -3.33332819422e-1)  # fmt: skip
TANH_SMALL = 0.625
# sin and cos reduce x by k pi/2 in float64: PIO2_HI holds pi/2's first 33 bits, so k * PIO2_HI
# is exact for |k| < 2**20 (fdlibm's pio2_1 and pio2_1t); beyond that accuracy, not
# reproducibility, degrades.
TWO_OVER_PI = 0.6366197723675814
PIO2_HI, PIO2_LO = 1.57079632673412561417e00, 6.07710050650619224932e-11
# Taylor coefficients of sin(r) / r - 1 and cos(r) - 1 in r^2 (|r| <= pi/4), highest degree first.
SIN_SERIES = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(8, 0, -1))
COS_SERIES = tuple((-1) ** k / math.factorial(2 * k) for k in range(8, 0, -1))
# atan: |x| > 1 inverted (pi/2 - atan(1/|x|)), then t > tan(pi/8) shifted ((t - 1) / (t + 1),
# plus pi/4), then the Taylor series (-1)^k u^(2k+1) / (2k+1) to u^31 on |u| <= tan(pi/8)
# (truncation below 1e-13 relative), highest degree first; all in float64, rounded once.
TAN_PI_8 = 0.41421356237309503
PI_4, PI_2 = 0.7853981633974483, 1.5707963267948966
ATAN_SERIES = tuple((-1) ** k / (2 * k + 1) for k in range(15, 0, -1))
# The constants above as float32, in the order verify/repops/native.c's kernels read them.
NATIVE_CONSTANTS = torch.tensor(
    [EXP_LO, EXP_HI, LOG2E, EXP_C1, EXP_C2, *EXP_POLY, *ERF_NUM, *ERF_DEN, INV_SQRT2,
     INV_SQRT_2PI],
    dtype=torch.float32,
)  # fmt: skip


def ceil_log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def matmul_bits(k: int) -> int:
    """Significant bits per operand so that ``k`` products of two of them sum below 2**53."""
    return min(22, (53 - ceil_log2(min(k, MAX_CHUNK))) // 2)


def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    # A 0-d tensor on the operand's device, for divisions by constants (CUDA turns division by a
    # CPU scalar into multiplication by its reciprocal) and for constant numerators. Python
    # float multipliers and addends are fine: torch rounds them to the tensor's float32 first,
    # as numpy does with np.float32 constants (the tests compare the two).
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e as float64 from integer ``e`` in [-1022, 1023], built from the exponent bits."""
    return torch.bitwise_left_shift(e.to(torch.int64) + 1023, 52).view(F64)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt of ``x``: torch's float64 sqrt, rounded to float32.

    Why not ``torch.sqrt`` in float32: torch's vectorized CPU sqrt (AVX-512 build) is not
    correctly rounded (measured: 0.6% of float32 results off by one ulp) while its scalar tail
    is, so even the thread count changes the bits. Its float64 sqrt is not correctly rounded
    either (measured: within 1 ulp of numpy's), but any float64 value within 4 ulp of sqrt(x)
    rounds to the correctly rounded float32 sqrt: a midpoint m between neighbouring float32
    values has 25 significant bits, so m * m has 50 and never equals a float32 ``x``. Scaled to
    x in [1, 4), x - m * m is then a non-zero multiple of 2**-48, so
    |sqrt(x) - m| = |x - m * m| / (sqrt(x) + m) >= 2**-50, which is 4 ulp of float64 in [1, 2).
    A test checks every float32 in [1, 4) (every significand at both exponent parities).
    """
    return torch.sqrt(x.to(F64)).to(F32)


class _Scratch(threading.local):
    buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor]

    def __init__(self) -> None:
        self.buffers = {}


_SCRATCH = _Scratch()
# Elements; larger temporaries are allocated (and freed) per call. 8M: a float64 temporary of
# llama-tiny's LM head (1024 x 4096, 33.5 MB) was above glibc's largest mmap threshold (32 MB),
# so each call mapped it afresh and page-faulted through it: at 2M such buffers were not kept,
# and keeping them took llama-tiny's RepOps step from 3.00-3.04x native's to 2.91-2.93x at two
# threads. Costs up to 64 MB a slot a thread, only for steps with temporaries that large.
SCRATCH_MAX = 1 << 23


def scratch(
    slot: str, like: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A per-thread buffer shaped as ``like`` (on ``device``, default ``like``'s) for a temporary
    that never leaves its kernel.

    Why: fresh multi-megabyte temporaries come from mmap and page-fault on first touch on every
    call (about 1 us per 4 KiB page here, as much as a pass over the data). Contents are
    undefined; two uses that overlap in time must name different slots. When ``like`` is the
    transpose of a contiguous tensor the buffer is laid out the same way, so that elementwise
    passes between the two read and write memory in order (GEMM takes either layout)."""
    transposed = like.dim() >= 2 and not like.is_contiguous() and like.mT.is_contiguous()
    out = _buffer(
        slot,
        like.mT.shape if transposed else like.shape,
        dtype,
        like.device if device is None else device,
    )
    return out.mT if transposed else out


def _buffer(slot: str, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous per-thread scratch tensor of ``shape`` (see ``scratch``)."""
    numel = math.prod(shape)
    if numel > SCRATCH_MAX:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (slot, dtype, device)
    buffer = _SCRATCH.buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def _grid(x: torch.Tensor, dim: int, bits: int, slot: str | None = None) -> torch.Tensor:
    """float64 ``x`` rounded (half to even) to multiples of 2**(e - bits) along ``dim``.

    2**e bounds the largest magnitude (e at least E_MIN, so rows of tiny values share one coarse
    grid). Adding and subtracting C = 1.5 * 2**(e - bits + p) rounds in two exact passes: x + C
    lies in a binade whose ulp is the grid step (p = 23 in float32 when bits <= 22, else p = 52
    in float64). With ``slot`` the result lives in that scratch buffer (see ``scratch``)."""
    if not 0 < bits <= 51:
        raise ValueError("grid bits must be in [1, 51]")
    out = torch.empty_like(x, dtype=F64) if slot is None else scratch(slot, x, F64)
    if repops_native.grid_into(x, dim, bits, out):
        return out
    # max(amax, -amin) is max |x| without writing an |x| temporary (half the memory traffic).
    bound = torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())
    e = torch.frexp(bound).exponent.clamp_(min=E_MIN)
    # Both branches round to the same grid, so choosing by the data changes no bit; the float32
    # one is cheaper but its constant would overflow for magnitudes near float32's maximum.
    if bits <= 22 and int(e.max()) <= 100:
        # 1.5 * 2**(e + 23 - bits) built from its float32 fields: biased exponent
        # e + 23 - bits + 127 (in [28, 249] here, a normal number) and the top mantissa bit.
        magic = e.add_(150 - bits).bitwise_left_shift_(23).bitwise_or_(1 << 22).view(F32)
        shifted = torch.add(x, magic, out=scratch("grid32", x, F32)).sub_(magic)
        return out.copy_(shifted)
    magic = pow2_f64(e + (52 - bits)).mul_(1.5)
    return out.copy_(x).add_(magic).sub_(magic)


def _to_f32_no_negative_zero(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32(x) + 0.0 (then + ``bias``): + 0.0 turns -0 into +0, because whether a sum of
    signed zeros is -0 differs between BLAS libraries. (Rounding before or after adding 0 is the
    same.)"""
    out = torch.empty(x.shape, dtype=F32, device=x.device)
    if repops_native.to_f32_into(x, out, bias):
        return out
    # Two plain passes beat one add with a float32 output: that mixed-dtype loop is not vectorized.
    out.copy_(x).add_(0.0)
    return out if bias is None else out.add_(bias)


def matmul(
    a: torch.Tensor, b: torch.Tensor, a_bits: int | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` for float32 ``(..., M, K) @ (..., K, N)``, bit-reproducible.

    Rows of ``a`` and columns of ``b`` are rounded to ``matmul_bits(K)`` significant bits relative
    to their own largest power of two. ``a_bits`` gives ``a`` fewer bits (and ``b`` the rest),
    for operands known to be small integers such as a one-hot matrix. Every product is then an
    integer multiple of its (row, column) unit and every partial sum stays below 2**53 units, so
    float64 GEMM computes each chunk exactly in any order. K above ``MAX_CHUNK`` is split into
    chunks whose results are added in chunk order. One rounding to float32 at the end, then
    ``+ bias`` (a float32 addition) when given.
    """
    k = a.shape[-1]
    if a_bits is None:
        bits_a = bits_b = matmul_bits(k)
    else:
        bits_a, bits_b = a_bits, 53 - ceil_log2(min(k, MAX_CHUNK)) - a_bits
    qa = _grid(a, -1, bits_a, "matmul.a")
    qb = _grid(b, -2, bits_b, "matmul.b")
    lead = qa.shape[:-2]
    if lead != qb.shape[:-2]:
        lead = torch.broadcast_shapes(lead, qb.shape[:-2])
    shape = (*lead, qa.shape[-2], qb.shape[-1])
    out = _buffer("mm", shape, F64, a.device)
    if k <= MAX_CHUNK:
        torch.matmul(qa, qb, out=out)
    else:
        torch.matmul(qa[..., :MAX_CHUNK], qb[..., :MAX_CHUNK, :], out=out)
    for start in range(MAX_CHUNK, k, MAX_CHUNK):
        chunk = slice(start, start + MAX_CHUNK)
        part = _buffer("mm.part", shape, F64, a.device)
        out.add_(torch.matmul(qa[..., chunk], qb[..., chunk, :], out=part))
    return _to_f32_no_negative_zero(out, bias)


def sum_tree(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` (removed) by a fixed pairwise tree of float32 additions.

    Level by level, the first half of the remaining terms is added elementwise to the second
    half; an odd last term is carried to the next level. Each addition is one IEEE operation in
    an order we fixed, so every library, thread count and device gives the same bits; error at
    most ceil(log2 K) roundings. Three to four times cheaper than ``sum_exact`` for our shapes.
    """
    n = x.shape[dim]
    if n == 0:
        raise ValueError("sum_tree needs at least one term")
    if n > 1:
        fused = repops_native.sum_tree(x, dim)
        if fused is not None:
            return fused
    while n > 1:
        half = n // 2
        # One split instead of two narrows: these loops are short and run on small tensors,
        # so the number of torch calls is much of their cost.
        parts = x.split_with_sizes([half, half, 1] if n % 2 else [half, half], dim)
        y = torch.add(parts[0], parts[1])
        if n % 2:
            y = torch.cat([y, parts[2]], dim)
        x, n = y, y.shape[dim]
    return x.squeeze(dim)


def sum_bits(k: int) -> int:
    """Grid bits for an exact sum of ``k`` terms: k * 2**bits <= 2**52 (at most 51)."""
    return min(51, 52 - ceil_log2(k))


def sum_exact(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of float32 ``x`` over ``dim`` (removed), each term first rounded to the grid of
    ``sum_bits(K)`` bits below the largest magnitude: every partial sum is exact in float64, so
    the order does not matter; one rounding to float32."""
    return _to_f32_no_negative_zero(_grid(x, dim, sum_bits(x.shape[dim])).sum(dim=dim))


def exp(x: torch.Tensor) -> torch.Tensor:
    """float32 exp (Cephes expf scheme): exactly 0 below EXP_LO, inputs above EXP_HI clamped.

    2**k is applied by adding k to the exponent field: p is in [0.7, 1.42] and k in [-124, 127],
    so the result stays a normal float32 and the addition is an exact multiply. The compiled
    kernel (``repops_native.exp``) computes the same operations in one pass."""
    fused = repops_native.exp(x, NATIVE_CONSTANTS)
    if fused is not None:
        return fused
    xc = x.clamp(EXP_LO, EXP_HI)
    k = torch.mul(xc, LOG2E).round_()
    # k * C1 is exact, so subtracting it through alpha (perhaps one FMA) rounds only once too.
    r = xc.sub_(k, alpha=EXP_C1).sub_(torch.mul(k, EXP_C2))
    z = torch.mul(r, r)
    p = torch.mul(r, EXP_POLY[0]).add_(EXP_POLY[1])
    for c in EXP_POLY[2:]:
        p.mul_(r).add_(c)
    p.mul_(z).add_(r).add_(1.0)
    p.view(torch.int32).add_(k.to(torch.int32), alpha=1 << 23)  # integer: exact
    return p.masked_fill_(x < EXP_LO, 0.0)


def erf(x: torch.Tensor) -> torch.Tensor:
    """float32 erf as a rational function of x on [-4, 4] (Eigen's fast erf; |error| < 5e-7),
    +-1 outside (as in float32). No exp: about 25 elementwise passes."""
    z = x.clamp(-4.0, 4.0)
    z2 = torch.mul(z, z)
    p = torch.mul(z2, ERF_NUM[0]).add_(ERF_NUM[1])
    for c in ERF_NUM[2:]:
        p.mul_(z2).add_(c)
    q = torch.mul(z2, ERF_DEN[0]).add_(ERF_DEN[1])
    for c in ERF_DEN[2:]:
        q.mul_(z2).add_(c)
    return p.mul_(z).div_(q)


def log_pos(s: torch.Tensor) -> torch.Tensor:
    """float32 natural log of positive finite float32 ``s``, in float64, rounded once."""
    mant, e = torch.frexp(s)
    small = mant < SQRT_HALF
    mant = torch.where(small, torch.mul(mant, 2.0), mant).to(F64)
    return _log_series(mant, torch.where(small, e - 1, e).to(F64)).to(F32)


def _log_series(mant: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float64 e ln 2 + log(mant) for mant in [sqrt(1/2), sqrt(2)]: 2 atanh(u), u = (mant - 1) /
    (mant + 1), to u^17 (|u| <= 0.172: truncation below 1e-15 relative). IEEE float64 + - * /
    only, so every library and device gives the same bits."""
    u = torch.div(torch.sub(mant, 1.0), torch.add(mant, 1.0))
    u2 = torch.mul(u, u)
    p = torch.mul(u2, LOG_SERIES[0]).add_(LOG_SERIES[1])
    for c in LOG_SERIES[2:]:
        p.mul_(u2).add_(c)
    p.mul_(u).mul_(2.0)
    return torch.mul(e, LN2).add_(p)


def _log_special(x: torch.Tensor, out: torch.Tensor, zero_at: float) -> torch.Tensor:
    """``out`` with IEEE log's special values where ``x`` (float32) leaves log_pos's domain:
    -inf at ``zero_at``, NaN below it or for NaN, +inf at +inf."""
    out = torch.where(x == zero_at, -math.inf, out)
    out = torch.where(x < zero_at, math.nan, out)
    out = torch.where(x == math.inf, math.inf, out)
    return torch.where(torch.isnan(x), math.nan, out)


def log(x: torch.Tensor) -> torch.Tensor:
    """float32 natural log over its whole domain: ``log_pos`` (float64, rounded once; subnormal
    inputs included), and IEEE's -inf at +-0, NaN below 0, +inf at +inf."""
    inside = (x > 0) & (x < math.inf)
    return _log_special(x, log_pos(torch.where(inside, x, 1.0)), 0.0)


def log1p(x: torch.Tensor) -> torch.Tensor:
    """float32 log(1 + x): u = 1 + x in float64 (rounded only when |x| < 2^-29), then
    log(u) - ((u - 1) - x) / u, which restores what that rounding lost (u - 1 is exact), by the
    same float64 series as ``log_pos``; rounded to float32 once. Specials as IEEE's log1p."""
    x64 = torch.where((x > -1.0) & (x < math.inf), x, 0.0).to(F64)
    u = torch.add(x64, 1.0)
    mant, e = torch.frexp(u)
    small = mant < SQRT_HALF
    mant = torch.where(small, torch.mul(mant, 2.0), mant)
    log_u = _log_series(mant, torch.where(small, e - 1, e).to(F64))
    lost = torch.sub(u, 1.0).sub_(x64).div_(u)
    return _log_special(x, log_u.sub_(lost).to(F32), -1.0)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """float32 tanh (Cephes tanhf scheme): x + x^3 P(x^2) below TANH_SMALL in magnitude, else
    1 - 2 / (exp(2|x|) + 1) with our ``exp`` and x's sign. Within 3 float32 ulp (tested)."""
    a = x.abs()
    big = torch.sub(_c(1.0, x), torch.div(_c(2.0, x), exp(torch.add(a, a)).add_(1.0)))
    big = torch.where(x < 0, big.neg(), big)
    z = torch.mul(x, x)
    p = torch.mul(z, TANH_POLY[0]).add_(TANH_POLY[1])
    for c in TANH_POLY[2:]:
        p.mul_(z).add_(c)
    small = p.mul_(z).mul_(x).add_(x)
    return torch.where(a < TANH_SMALL, small, big)


def atan(x: torch.Tensor) -> torch.Tensor:
    """float32 atan, computed in float64 (``ATAN_SERIES``' reductions) and rounded once; x's
    sign copied onto the result (atan(-0) = -0), NaN for NaN, +-pi/2 at +-inf. Every step is a
    separate IEEE float64 operation."""
    x64 = x.to(F64)
    a = x64.abs()
    big = a > 1.0
    t = torch.where(big, torch.div(_c(1.0, a), a), a)
    mid = t > TAN_PI_8
    u = torch.where(mid, torch.div(torch.sub(t, 1.0), torch.add(t, 1.0)), t)
    u2 = torch.mul(u, u)
    p = torch.mul(u2, ATAN_SERIES[0]).add_(ATAN_SERIES[1])
    for c in ATAN_SERIES[2:]:
        p.mul_(u2).add_(c)
    r = p.mul_(u2).mul_(u).add_(u)
    r = torch.where(mid, torch.add(r, PI_4), r)
    r = torch.where(big, torch.sub(_c(PI_2, r), r), r)
    return torch.copysign(r, x64).to(F32)


def sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (sin x, cos x), each computed in float64 and rounded once.

    x - k pi/2 with k = round(x 2/pi) is reduced in two exact-product steps, then Taylor series
    to r^17 on |r| <= pi/4 (truncation below 1e-16); the quadrant k mod 4, computed in float64
    (no float-to-int conversion, whose overflow differs between vector and scalar code), picks
    the signs. Every step is a separate IEEE float64 operation."""
    x64 = x.to(F64)
    k = torch.mul(x64, TWO_OVER_PI).round_()
    r = torch.sub(x64, torch.mul(k, PIO2_HI)).sub_(torch.mul(k, PIO2_LO))
    r2 = torch.mul(r, r)
    s = torch.mul(r2, SIN_SERIES[0]).add_(SIN_SERIES[1])
    for c in SIN_SERIES[2:]:
        s.mul_(r2).add_(c)
    s.mul_(r2).mul_(r).add_(r)
    co = torch.mul(r2, COS_SERIES[0]).add_(COS_SERIES[1])
    for c in COS_SERIES[2:]:
        co.mul_(r2).add_(c)
    co.mul_(r2).add_(1.0)
    quadrant = torch.sub(k, torch.floor(torch.mul(k, 0.25)).mul_(4.0))
    sin = torch.where(
        quadrant == 0, s, torch.where(quadrant == 1, co, torch.where(quadrant == 2, -s, -co))
    )
    cos = torch.where(
        quadrant == 0, co, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -co, s))
    )
    return sin.to(F32), cos.to(F32)


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; -inf entries give exactly 0."""
    # max(-0, +0) may return either zero; + 0.0 makes it +0 on every library.
    e = exp(torch.sub(x, x.amax(dim=-1, keepdim=True).add_(0.0)))
    return e.div_(sum_tree(e, -1).unsqueeze(-1))


BLOCK = 65536  # elements per block of an elementwise chain: its temporaries stay in L2


def rowwise(fn: Any, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """``fn(x, *rest)`` over blocks of rows of the 2-D ``x`` (and of equally shaped ``rest``).

    Every kernel applied this way works row by row, so blocking changes no bit; it keeps a long
    chain of elementwise passes in cache instead of streaming each pass through memory."""
    rows = max(1, BLOCK // max(1, x.shape[-1]))
    if x.shape[0] <= rows:
        return fn(x, *rest)
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], rows):
        part = slice(start, start + rows)
        out[part] = fn(x[part], *(t[part] for t in rest))
    return out


def flat_blocks(fn: Any, *tensors: torch.Tensor) -> torch.Tensor:
    """Elementwise ``fn`` over equally shaped tensors, BLOCK elements at a time (no bit changes:
    each element's result depends on that element alone)."""
    flat = [t.reshape(-1) for t in tensors]
    n = flat[0].numel()
    if n <= BLOCK:
        return fn(*tensors)
    out = torch.empty_like(flat[0])
    for start in range(0, n, BLOCK):
        part = slice(start, start + BLOCK)
        out[part] = fn(*(t[part] for t in flat))
    return out.view(tensors[0].shape)


# ---- model operators: fn(inputs, attrs) -> one tensor ----------------------------------------


def _heads(qkv: torch.Tensor, heads: int, batch: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v), each (B, H, T, hd), viewed out of qkv (B*T, 3d) laid out as (B, T, 3, H, hd)."""
    n, width3 = qkv.shape
    view = qkv.view(batch, n // batch, 3, heads, width3 // (3 * heads))
    # Strided views, no copies: matmul's rounding pass reads them once and writes the
    # contiguous float64 operand the GEMM runs on.
    return tuple(view[:, :, j].transpose(1, 2) for j in range(3))


def _scale(hd: int) -> float:
    return 1.0 / math.sqrt(hd)  # correctly rounded float64 ops, then one rounding to float32


def _attention_probs(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """softmax(causal(q k^T / sqrt(hd))) as (B, H, T, T)."""
    (qkv,) = inputs
    q, k, _ = _heads(qkv, attrs["heads"], attrs["batch"])
    length, hd = q.shape[-2], q.shape[-1]
    scores = matmul(q, k.transpose(-1, -2))
    fused = repops_native.softmax_rows(scores, NATIVE_CONSTANTS, _scale(hd), causal=length)
    if fused is not None:
        return fused
    causal = torch.ones(length, length, dtype=torch.bool, device=qkv.device).triu_(1)
    scores.mul_(_scale(hd)).masked_fill_(causal, -math.inf)
    return rowwise(softmax_rows, scores.view(-1, length)).view(scores.shape)


def _attention_values(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """probs @ v, heads merged back: (B*T, d)."""
    probs, qkv = inputs
    _, _, v = _heads(qkv, attrs["heads"], probs.shape[0])
    return matmul(probs, v).transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1] // 3)


def _dout_heads(dout: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    batch, heads, length, hd = like.shape
    return dout.view(batch, length, heads, hd).transpose(1, 2)


def _scores_grad_rows(dp: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    row = sum_tree(torch.mul(dp, probs), -1).unsqueeze(-1)
    return torch.sub(dp, row).mul_(probs).mul_(scale)


def _attention_scores_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """Gradient of the pre-softmax scores (scale included): P * (dP - rowsum(dP * P)) / sqrt(hd)."""
    probs, qkv, dout = inputs
    q, _, v = _heads(qkv, attrs["heads"], probs.shape[0])
    dp = matmul(_dout_heads(dout, q), v.transpose(-1, -2))
    length, scale = probs.shape[-1], _scale(q.shape[-1])
    fused = repops_native.scores_grad_rows(dp, probs, scale)
    if fused is not None:
        return fused
    grad = rowwise(
        lambda d, p: _scores_grad_rows(d, p, scale), dp.view(-1, length), probs.view(-1, length)
    )
    return grad.view(probs.shape)


def _attention_qkv_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """(dq, dk, dv) = (dS k, dS^T q, P^T dO), laid out as qkv: (B*T, 3d)."""
    probs, qkv, dout, dscores = inputs
    q, k, _ = _heads(qkv, attrs["heads"], probs.shape[0])
    batch, heads, length, hd = q.shape
    out = torch.empty(batch, length, 3, heads, hd, dtype=F32, device=qkv.device)
    out[:, :, 0] = matmul(dscores, k).transpose(1, 2)
    out[:, :, 1] = matmul(dscores.transpose(-1, -2), q).transpose(1, 2)
    out[:, :, 2] = matmul(probs.transpose(-1, -2), _dout_heads(dout, q)).transpose(1, 2)
    return out.view(qkv.shape)


def _layernorm_stats(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    (x,) = inputs
    fused = repops_native.layernorm_stats(x, attrs["eps"])
    if fused is not None:
        return fused
    d = _c(float(x.shape[-1]), x)
    mean = sum_tree(x, -1).div_(d)
    xc = torch.sub(x, mean.unsqueeze(-1))
    var = sum_tree(xc.mul_(xc), -1).div_(d)
    rstd = torch.div(_c(1.0, x), sqrt(var.add_(_c(attrs["eps"], x))))
    return torch.stack((mean, rstd), dim=-1)


def _xhat(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    return torch.sub(x, stats[:, 0:1]).mul_(stats[:, 1:2])


def _layernorm(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    x, stats, g, b = inputs
    fused = repops_native.layernorm_apply(x, stats, g, b)
    if fused is not None:
        return fused
    return _xhat(x, stats).mul_(g).add_(b)


def _layernorm_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    x, stats, g, dy = inputs
    fused = repops_native.layernorm_backward(x, stats, g, dy)
    if fused is not None:
        return fused
    xhat = _xhat(x, stats)
    dxhat = torch.mul(dy, g)
    d = _c(float(x.shape[-1]), x)
    a = sum_tree(dxhat, -1).div_(d).unsqueeze(-1)
    c = sum_tree(torch.mul(dxhat, xhat), -1).div_(d).unsqueeze(-1)
    return dxhat.sub_(a).sub_(xhat.mul_(c)).mul_(stats[:, 1:2])


def _layernorm_grad_weight(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    x, stats, dy = inputs
    terms = repops_native.layernorm_xhat_dy(x, stats, dy)
    return sum_tree(_xhat(x, stats).mul_(dy) if terms is None else terms, 0)


def _row_losses(flat: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    top = flat.amax(dim=-1, keepdim=True).add_(0.0)  # +0, never -0
    total = sum_tree(exp(torch.sub(flat, top)), -1)
    return log_pos(total).add_(top.squeeze(-1)).sub_(picked).unsqueeze(-1)


def _cross_entropy(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """Mean over rows of logsumexp(logits) - logits[target]: a 0-d float32."""
    logits, targets = inputs
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
    picked = flat.gather(1, tgt)
    losses = torch.cat(
        [_row_losses(flat[i : i + 128], picked[i : i + 128, 0]) for i in range(0, len(flat), 128)]
    )
    return sum_tree(losses[:, 0], 0).div_(_c(float(flat.shape[0]), flat))


def _cross_entropy_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """(softmax(logits) - onehot(target)) / rows."""
    logits, targets = inputs
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
    probs = repops_native.softmax_rows(flat.contiguous(), NATIVE_CONSTANTS)
    if probs is None:
        probs = rowwise(softmax_rows, flat)
    probs.scatter_(1, tgt, probs.gather(1, tgt).sub_(1.0))
    return probs.div_(_c(float(flat.shape[0]), flat)).reshape(logits.shape)


def _gelu_cdf(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, the exact GELU's gate (torch's default GELU)."""
    fused = repops_native.gelu_cdf(inputs[0], NATIVE_CONSTANTS)
    if fused is not None:
        return fused
    return flat_blocks(lambda x: erf(torch.mul(x, INV_SQRT2)).mul_(0.5).add_(0.5), inputs[0])


def _gelu_grad_rows(x: torch.Tensor, cdf: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    pdf = exp(torch.mul(x, x).mul_(-0.5)).mul_(INV_SQRT_2PI)
    return pdf.mul_(x).add_(cdf).mul_(dy)


def _gelu_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """dy * (Phi(x) + x * phi(x)) with phi(x) = exp(-x^2 / 2) / sqrt(2 pi)."""
    fused = repops_native.gelu_backward(*inputs, NATIVE_CONSTANTS)
    if fused is not None:
        return fused
    return flat_blocks(_gelu_grad_rows, *inputs)


def _embed(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    tokens, table, position = inputs
    batch, length = tokens.shape
    out = table[tokens.reshape(-1)].view(batch, length, -1).add_(position[:length])
    return out.reshape(batch * length, -1)


def _embedding_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """One-hot(tokens)^T @ dx through the exact matmul: each row's sum of its tokens' grads."""
    tokens, dx = inputs
    flat = tokens.reshape(1, -1)
    onehot = torch.zeros(attrs["vocab"], flat.shape[1], dtype=F32, device=dx.device)
    onehot.scatter_(0, flat, 1.0)
    return matmul(onehot, dx, a_bits=1)


def _position_backward(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    (dx,) = inputs
    batch = attrs["batch"]
    summed = sum_tree(dx.view(batch, dx.shape[0] // batch, dx.shape[1]), 0)
    out = torch.zeros(attrs["context"], dx.shape[1], dtype=F32, device=dx.device)
    out[: summed.shape[0]] = summed
    return out


def _adamw_m(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    m, g = inputs
    b1 = attrs["beta1"]
    return torch.mul(m, _c(b1, m)).add_(torch.mul(g, _c(1.0 - b1, m)))


def _adamw_v(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    v, g = inputs
    b2 = attrs["beta2"]
    return torch.mul(v, _c(b2, v)).add_(torch.mul(g, g).mul_(_c(1.0 - b2, v)))


def adamw_scalars(attrs: dict[str, Any], step: int) -> tuple[float, float, float, float]:
    """(decay, step_size, sqrt(bias_correction2), eps) as Python floats, the same everywhere."""
    # The counter is at least 1 after the step's increment; a smaller one (only in a tampered
    # trace) counts as 1 so that the operator is defined on every input the referee may see.
    step = max(step, 1)
    bc1 = 1.0 - pow_int(attrs["beta1"], step)
    bc2 = 1.0 - pow_int(attrs["beta2"], step)
    lr = attrs["lr"]
    return 1.0 - lr * attrs["weight_decay"], lr / bc1, math.sqrt(bc2), attrs["eps"]


def _adamw_param(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """p * (1 - lr wd) - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), torch.optim.AdamW's step."""
    p, m, v, step = inputs
    decay, step_size, bc2_sqrt, eps = adamw_scalars(attrs, int(step.item()))
    constants = [_c(value, p) for value in (decay, step_size, bc2_sqrt, eps)]

    def update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        denom = sqrt(v).div_(constants[2]).add_(constants[3])
        return torch.mul(p, constants[0]).sub_(torch.div(m, denom).mul_(constants[1]))

    return flat_blocks(update, p, m, v)


def adamw_constants(attrs: dict[str, Any], step: int) -> torch.Tensor:
    """The float32 constants of one AdamW update after ``step`` steps, in the order the
    compiled kernel reads them: beta1, 1 - beta1, beta2, 1 - beta2, sqrt(bias_correction2),
    eps, 1 - lr wd, lr / bias_correction1 (each a Python float rounded once to float32)."""
    decay, step_size, bc2_sqrt, eps = adamw_scalars(attrs, step)
    b1, b2 = attrs["beta1"], attrs["beta2"]
    return torch.tensor([b1, 1.0 - b1, b2, 1.0 - b2, bc2_sqrt, eps, decay, step_size], dtype=F32)


def adamw_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    attrs: dict[str, Any],
) -> None:
    """One AdamW update of a parameter in place: the moments as ``adamw_m``/``adamw_v``, then
    the parameter as ``adamw_param`` from the new moments (each product and sum one float32
    rounding; bias corrections from ``pow_int``). The compiled kernel does it in one pass; the
    eager ops do what it leaves (a block holding a NaN or an infinity, and the rest of that
    thread's range), with the same bits: every element depends on its own p, g, m, v only."""
    constants = adamw_constants(attrs, step)
    left = repops_native.adamw_(p, g, m, v, constants)
    if left is None:
        _adamw_eager(p, g, m, v, constants)
    for lo, hi in left or ():  # the kernel applied: all four contiguous, so views of the rest
        _adamw_eager(*(t.view(-1)[lo:hi] for t in (p, g, m, v)), constants)


def _adamw_eager(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, constants: torch.Tensor
) -> None:
    b1, nb1, b2, nb2, bc2_sqrt, eps, decay, step_size = constants.to(p.device).unbind()
    m_new = torch.mul(m, b1).add_(torch.mul(g, nb1))
    v_new = torch.mul(v, b2).add_(torch.mul(g, g).mul_(nb2))
    denom = sqrt(v_new).div_(bc2_sqrt).add_(eps)
    p_new = torch.mul(p, decay).sub_(torch.div(m_new, denom).mul_(step_size))
    for target, value in ((p, p_new), (m, m_new), (v, v_new)):
        target.copy_(value)


def _increment(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    (step,) = inputs
    return torch.add(step, 1)


def _nesterov_momentum(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """m' = mu * m + g (diloco.outer.nesterov_update, one float32 op per line)."""
    m, g = inputs
    return torch.add(torch.mul(m, _c(attrs["momentum"], m)), g)


def _nesterov_params(inputs: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    """p' = p - lr * (g + mu * m')."""
    p, g, m_new = inputs
    direction = torch.add(g, torch.mul(m_new, _c(attrs["momentum"], m_new)))
    return torch.sub(p, torch.mul(direction, _c(attrs["lr"], p)))


def _binary(fn: Any) -> OpFn:
    return lambda inputs, attrs: fn(inputs[0], inputs[1])


OPS: dict[str, OpFn] = {
    "add": _binary(torch.add),
    "sub": _binary(torch.sub),
    "mul": _binary(torch.mul),
    "matmul": _binary(matmul),
    "matmul_nt": lambda i, a: matmul(i[0], i[1].transpose(-1, -2)),
    "matmul_tn": lambda i, a: matmul(i[0].transpose(-1, -2), i[1]),
    "linear": lambda i, a: matmul(i[0], i[1].transpose(-1, -2), bias=i[2]),
    "sum_rows": lambda i, a: sum_tree(i[0], 0),
    "embed": _embed,
    "layernorm_stats": _layernorm_stats,
    "layernorm": _layernorm,
    "layernorm_backward": _layernorm_backward,
    "layernorm_grad_weight": _layernorm_grad_weight,
    "attention_probs": _attention_probs,
    "attention_values": _attention_values,
    "attention_scores_backward": _attention_scores_backward,
    "attention_qkv_backward": _attention_qkv_backward,
    "gelu_cdf": _gelu_cdf,
    "gelu_backward": _gelu_backward,
    "cross_entropy": _cross_entropy,
    "cross_entropy_backward": _cross_entropy_backward,
    "embedding_backward": _embedding_backward,
    "position_backward": _position_backward,
    "adamw_m": _adamw_m,
    "adamw_v": _adamw_v,
    "adamw_param": _adamw_param,
    "increment": _increment,
    "nesterov_momentum": _nesterov_momentum,
    "nesterov_params": _nesterov_params,
}
