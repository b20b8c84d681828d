"""Pure-numpy reference of every RepOps operator, in the same order as ``verify.repops.ops``.

Why a second implementation: equal bits from torch (MKL, any thread count, CPU or CUDA) and from
numpy (OpenBLAS, its own loops) are the evidence that the results depend on the order we fixed
and on nothing a library chose. Written independently of the torch kernels (same algorithm, same
constants, numpy calls only), so a mistake in one shows up as a mismatch. The training step wires
these kernels with the shared, backend-free program of ``verify.repops.graph``.

Every float32 operation here is one numpy ufunc on float32 arrays with ``np.float32`` constants
(numpy never fuses two ufuncs into an FMA). Matmuls are exact on float64 grids, formulated here
as integers times a power-of-two scale (torch rounds with an add-and-subtract constant instead:
the same values by a different route); sums follow the same pairwise tree of float32 additions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from verify.repops.graph import (
    AdamWConfig,
    Executor,
    ModelShape,
    OpFn,
    decode_attrs,
    pow_int,
    training_step,
)
from verify.trace import LEAF_PREFIX, tensor_hash

F32 = np.float32
MAX_CHUNK = 2048
EXP_LO, EXP_HI = F32(-86.0), F32(88.0)
LOG2E = F32(1.44269504088896341)
EXP_C1, EXP_C2 = F32(0.693359375), F32(-2.12194440e-4)
EXP_POLY = [F32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                             1.6666665459e-1, 5.0000001201e-1)]  # fmt: skip
ERF_NUM = [F32(c) for c in (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                            -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                            -1.60960333262415e-02)]  # fmt: skip
ERF_DEN = [F32(c) for c in (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                            -7.37332916720468e-03, -1.42647390514189e-02)]  # fmt: skip
ONE, HALF, TWO = F32(1.0), F32(0.5), F32(2.0)
TANH_POLY = [F32(c) for c in (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2,
                              1.33314422036e-1, -3.33332819422e-1)]  # fmt: skip
PIO2_HI, PIO2_LO = 1.57079632673412561417e00, 6.07710050650619224932e-11


def _bits_for(k: int) -> int:
    return 53 - max(0, (min(k, MAX_CHUNK) - 1).bit_length())


def pow2_f64(e: np.ndarray) -> np.ndarray:
    return ((np.asarray(e).astype(np.int64) + 1023) << 52).view(np.float64)


def _grid(x: np.ndarray, axis: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    _, e = np.frexp(np.max(np.abs(x), axis=axis, keepdims=True))
    e = np.maximum(e, -100)
    return np.round(x.astype(np.float64) * pow2_f64(bits - e)), e


def matmul(a: np.ndarray, b: np.ndarray, a_bits: int | None = None) -> np.ndarray:
    """Exact-product matmul on power-of-two grids; see ``verify.repops.ops.matmul``."""
    k = a.shape[-1]
    avail = _bits_for(k)
    half = min(22, avail // 2)
    bits_a, bits_b = (half, half) if a_bits is None else (a_bits, avail - a_bits)
    qa, ea = _grid(a, -1, bits_a)
    qb, eb = _grid(b, -2, bits_b)
    out = np.matmul(qa[..., :MAX_CHUNK], qb[..., :MAX_CHUNK, :])
    for start in range(MAX_CHUNK, k, MAX_CHUNK):
        out = out + np.matmul(
            qa[..., start : start + MAX_CHUNK], qb[..., start : start + MAX_CHUNK, :]
        )
    return (out * pow2_f64(ea - bits_a) * pow2_f64(eb - bits_b)).astype(F32) + F32(0.0)


def sum_exact(x: np.ndarray, axis: int) -> np.ndarray:
    bits = min(51, 52 - max(0, (x.shape[axis] - 1).bit_length()))
    q, e = _grid(x, axis, bits)
    total = (np.sum(q, axis=axis, keepdims=True) * pow2_f64(e - bits)).astype(F32)
    return np.squeeze(total, axis) + F32(0.0)


def sum_tree(x: np.ndarray, axis: int) -> np.ndarray:
    """Fixed pairwise tree of float32 additions; see ``verify.repops.ops.sum_tree``."""
    axis %= x.ndim

    def part(start: int, stop: int) -> np.ndarray:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return x[tuple(index)]

    while x.shape[axis] > 1:
        n = x.shape[axis]
        half = n // 2
        summed = part(0, half) + part(half, 2 * half)
        x = np.concatenate([summed, part(2 * half, n)], axis=axis) if n % 2 else summed
    return np.squeeze(x, axis)


def exp(x: np.ndarray) -> np.ndarray:
    xc = np.clip(x, EXP_LO, EXP_HI)
    k = np.round(xc * LOG2E)
    r = (xc - k * EXP_C1) - k * EXP_C2
    z = r * r
    p = np.full_like(x, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    p = (p * z + r) + ONE
    p = (p.view(np.int32) + (k * F32(2**23)).astype(np.int32)).view(F32)
    return np.where(x < EXP_LO, F32(0.0), p).astype(F32)


def erf(x: np.ndarray) -> np.ndarray:
    z = np.clip(x, F32(-4.0), F32(4.0))
    z2 = z * z
    p = np.full_like(z, ERF_NUM[0]) * z2 + ERF_NUM[1]
    for c in ERF_NUM[2:]:
        p = p * z2 + c
    q = np.full_like(z, ERF_DEN[0]) * z2 + ERF_DEN[1]
    for c in ERF_DEN[2:]:
        q = q * z2 + c
    return (p * z) / q


def log_pos(s: np.ndarray) -> np.ndarray:
    mant, e = np.frexp(s)
    small = mant < F32(0.7071067811865476)
    mant = np.where(small, mant * TWO, mant).astype(np.float64)
    return _log_series(mant, np.where(small, e - 1, e).astype(np.float64)).astype(F32)


def _log_series(mant: np.ndarray, e: np.ndarray) -> np.ndarray:
    u = (mant - 1.0) / (mant + 1.0)
    u2 = u * u
    coefficients = [1.0 / (2 * k + 1) for k in range(8, -1, -1)]
    p = np.full_like(u, coefficients[0])
    for c in coefficients[1:]:
        p = p * u2 + c
    p = p * u * 2.0
    return e * 0.6931471805599453 + p


def _log_special(x: np.ndarray, out: np.ndarray, zero_at: float) -> np.ndarray:
    special = [x == zero_at, x < zero_at, x == np.inf, np.isnan(x)]
    return np.select(special, [F32(-np.inf), F32(np.nan), F32(np.inf), F32(np.nan)], out)


def log(x: np.ndarray) -> np.ndarray:
    """log_pos inside (0, inf), IEEE's special values outside."""
    inside = (x > 0) & (x < np.inf)
    return _log_special(x, log_pos(np.where(inside, x, ONE)), 0.0).astype(F32)


def log1p(x: np.ndarray) -> np.ndarray:
    """log(u) - ((u - 1) - x) / u with u = 1 + x, all in float64, rounded to float32 once."""
    x64 = np.where((x > -1) & (x < np.inf), x, F32(0.0)).astype(np.float64)
    u = x64 + 1.0
    mant, e = np.frexp(u)
    small = mant < 0.7071067811865476
    mant = np.where(small, mant * 2.0, mant)
    log_u = _log_series(mant, np.where(small, e - 1, e).astype(np.float64))
    return _log_special(x, (log_u - ((u - 1.0) - x64) / u).astype(F32), -1.0).astype(F32)


def tanh(x: np.ndarray) -> np.ndarray:
    """Cephes tanhf: polynomial below 0.625 in magnitude, else 1 - 2 / (exp(2|x|) + 1)."""
    a = np.abs(x)
    big = ONE - TWO / (exp(a + a) + ONE)
    big = np.where(x < 0, -big, big)
    z = x * x
    p = np.full_like(x, TANH_POLY[0]) * z + TANH_POLY[1]
    for c in TANH_POLY[2:]:
        p = p * z + c
    small = ((p * z) * x) + x
    return np.where(a < F32(0.625), small, big).astype(F32)


def atan(x: np.ndarray) -> np.ndarray:
    """atan in float64: |x| > 1 inverted, t > tan(pi/8) shifted by pi/4, the Taylor series to
    u^31, x's sign copied; rounded to float32 once."""
    x64 = np.asarray(x).astype(np.float64)
    a = np.abs(x64)
    big = a > 1.0
    t = np.where(big, 1.0 / np.where(big, a, 1.0), a)
    mid = t > 0.41421356237309503
    u = np.where(mid, (t - 1.0) / (t + 1.0), t)
    u2 = u * u
    terms = [(-1) ** k / (2 * k + 1) for k in range(15, 0, -1)]
    p = np.full_like(u, terms[0])
    for c in terms[1:]:
        p = p * u2 + c
    r = ((p * u2) * u) + u
    r = np.where(mid, r + 0.7853981633974483, r)
    r = np.where(big, 1.5707963267948966 - r, r)
    return np.copysign(r, x64).astype(F32)


def sin_cos(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sin x, cos x) in float64 from x - k pi/2 and Taylor series, rounded to float32 once."""
    x64 = x.astype(np.float64)
    k = np.round(x64 * 0.6366197723675814)
    r = (x64 - k * PIO2_HI) - k * PIO2_LO
    r2 = r * r
    sin_terms = [(-1) ** k / math.factorial(2 * k + 1) for k in range(8, 0, -1)]
    cos_terms = [(-1) ** k / math.factorial(2 * k) for k in range(8, 0, -1)]
    s = np.full_like(r, sin_terms[0])
    for c in sin_terms[1:]:
        s = s * r2 + c
    s = ((s * r2) * r) + r
    c2 = np.full_like(r, cos_terms[0])
    for c in cos_terms[1:]:
        c2 = c2 * r2 + c
    c2 = c2 * r2 + 1.0
    quadrant = k - np.floor(k * 0.25) * 4.0
    sin = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [s, c2, -s], -c2)
    cos = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [c2, -s, -c2], s)
    return sin.astype(F32), cos.astype(F32)


def softmax_rows(x: np.ndarray) -> np.ndarray:
    e = exp(x - (np.max(x, axis=-1, keepdims=True) + F32(0.0)))
    return e / sum_tree(e, -1)[..., None]


def _heads(qkv: np.ndarray, heads: int, batch: int) -> tuple[np.ndarray, ...]:
    n, width3 = qkv.shape
    view = qkv.reshape(batch, n // batch, 3, heads, width3 // (3 * heads))
    return tuple(np.swapaxes(view[:, :, j], 1, 2) for j in range(3))


def _dout_heads(dout: np.ndarray, like: np.ndarray) -> np.ndarray:
    b, h, t, hd = like.shape
    return np.swapaxes(dout.reshape(b, t, h, hd), 1, 2)


def _attention_probs(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    q, k, _ = _heads(i[0], a["heads"], a["batch"])
    length, hd = q.shape[-2], q.shape[-1]
    scores = matmul(q, np.swapaxes(k, -1, -2)) * F32(1.0 / math.sqrt(hd))
    causal = np.triu(np.ones((length, length), dtype=bool), 1)
    return softmax_rows(np.where(causal, F32(-np.inf), scores))


def _attention_values(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    probs, qkv = i
    _, _, v = _heads(qkv, a["heads"], probs.shape[0])
    out = matmul(probs, v)
    return np.swapaxes(out, 1, 2).reshape(qkv.shape[0], qkv.shape[1] // 3)


def _attention_scores_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    probs, qkv, dout = i
    q, _, v = _heads(qkv, a["heads"], probs.shape[0])
    dp = matmul(_dout_heads(dout, q), np.swapaxes(v, -1, -2))
    row = sum_tree(dp * probs, -1)[..., None]
    return ((dp - row) * probs) * F32(1.0 / math.sqrt(q.shape[-1]))


def _attention_qkv_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    probs, qkv, dout, dscores = i
    q, k, _ = _heads(qkv, a["heads"], probs.shape[0])
    dq = matmul(dscores, k)
    dk = matmul(np.swapaxes(dscores, -1, -2), q)
    dv = matmul(np.swapaxes(probs, -1, -2), _dout_heads(dout, q))
    return np.stack((dq, dk, dv)).transpose(1, 3, 0, 2, 4).reshape(qkv.shape)


def _layernorm_stats(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    (x,) = i
    d = F32(x.shape[-1])
    mean = sum_tree(x, -1) / d
    xc = x - mean[:, None]
    var = sum_tree(xc * xc, -1) / d
    rstd = ONE / np.sqrt(var + F32(a["eps"]))
    return np.stack((mean, rstd), axis=-1)


def _xhat(x: np.ndarray, stats: np.ndarray) -> np.ndarray:
    return (x - stats[:, 0:1]) * stats[:, 1:2]


def _layernorm_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    x, stats, g, dy = i
    xhat = _xhat(x, stats)
    dxhat = dy * g
    d = F32(x.shape[-1])
    mean_d = (sum_tree(dxhat, -1) / d)[:, None]
    mean_dx = (sum_tree(dxhat * xhat, -1) / d)[:, None]
    return ((dxhat - mean_d) - xhat * mean_dx) * stats[:, 1:2]


def _cross_entropy(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    logits, targets = i
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
    top = np.max(flat, axis=-1, keepdims=True) + F32(0.0)
    lse = log_pos(sum_tree(exp(flat - top), -1)) + top[:, 0]
    losses = lse - np.take_along_axis(flat, tgt, axis=1)[:, 0]
    return np.asarray(sum_tree(losses, 0) / F32(flat.shape[0]), dtype=F32)


def _cross_entropy_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    logits, targets = i
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    probs = softmax_rows(flat)
    rows = np.arange(flat.shape[0])
    probs[rows, tgt] = probs[rows, tgt] - ONE
    return (probs / F32(flat.shape[0])).reshape(logits.shape)


def _gelu_cdf(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    return erf(i[0] * F32(0.7071067811865476)) * HALF + HALF


def _gelu_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    x, cdf, dy = i
    pdf = exp((x * x) * F32(-0.5)) * F32(0.3989422804014327)
    return ((pdf * x) + cdf) * dy


def _embed(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    tokens, table, position = i
    batch, length = tokens.shape
    out = table[tokens.reshape(-1)].reshape(batch, length, -1) + position[:length]
    return out.reshape(batch * length, -1)


def _embedding_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    tokens, dx = i
    flat = tokens.reshape(-1)
    onehot = np.zeros((a["vocab"], flat.shape[0]), dtype=F32)
    onehot[flat, np.arange(flat.shape[0])] = ONE
    return matmul(onehot, dx, a_bits=1)


def _position_backward(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    (dx,) = i
    batch = a["batch"]
    summed = sum_tree(dx.reshape(batch, dx.shape[0] // batch, dx.shape[1]), 0)
    out = np.zeros((a["context"], dx.shape[1]), dtype=F32)
    out[: summed.shape[0]] = summed
    return out


def _adamw_param(i: list[np.ndarray], a: dict[str, Any]) -> np.ndarray:
    p, m, v, step = i
    t = max(int(step), 1)  # as repops_ops.adamw_scalars: defined for a tampered counter too
    lr = a["lr"]
    step_size = lr / (1.0 - pow_int(a["beta1"], t))
    bc2_sqrt = math.sqrt(1.0 - pow_int(a["beta2"], t))
    denom = np.sqrt(v) / F32(bc2_sqrt) + F32(a["eps"])
    return p * F32(1.0 - lr * a["weight_decay"]) - (m / denom) * F32(step_size)


OPS: dict[str, OpFn] = {
    "add": lambda i, a: i[0] + i[1],
    "sub": lambda i, a: i[0] - i[1],
    "mul": lambda i, a: i[0] * i[1],
    "matmul": lambda i, a: matmul(i[0], i[1]),
    "matmul_nt": lambda i, a: matmul(i[0], np.swapaxes(i[1], -1, -2)),
    "matmul_tn": lambda i, a: matmul(np.swapaxes(i[0], -1, -2), i[1]),
    "linear": lambda i, a: matmul(i[0], np.swapaxes(i[1], -1, -2)) + i[2],
    "sum_rows": lambda i, a: sum_tree(i[0], 0),
    "embed": _embed,
    "layernorm_stats": _layernorm_stats,
    "layernorm": lambda i, a: (_xhat(i[0], i[1]) * i[2]) + i[3],
    "layernorm_backward": _layernorm_backward,
    "layernorm_grad_weight": lambda i, a: sum_tree(_xhat(i[0], i[1]) * i[2], 0),
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
    "adamw_m": lambda i, a: i[0] * F32(a["beta1"]) + i[1] * F32(1.0 - a["beta1"]),
    "adamw_v": lambda i, a: i[0] * F32(a["beta2"]) + (i[1] * i[1]) * F32(1.0 - a["beta2"]),
    "adamw_param": _adamw_param,
    "increment": lambda i, a: np.asarray(i[0] + 1, dtype=np.int64),
    "nesterov_momentum": lambda i, a: i[0] * F32(a["momentum"]) + i[1],
    "nesterov_params": lambda i, a: i[0] - (i[1] + i[2] * F32(a["momentum"])) * F32(a["lr"]),
}


def run_op(name: str, inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
    """Recompute one recorded operator with the numpy kernels (a ``verify.trace.Recompute``)."""
    if name.startswith(LEAF_PREFIX) or name not in OPS:
        raise ValueError(f"no RepOps operator named {name!r}")
    decoded = decode_attrs(attrs)
    try:
        return np.asarray(OPS[name]([np.asarray(x) for x in inputs], decoded))
    except (TypeError, IndexError, KeyError, ValueError, OverflowError) as error:
        raise ValueError(f"operator {name} cannot run on these inputs: {error}") from error


def training_step_reference(
    state: Mapping[str, np.ndarray],
    inputs: np.ndarray,
    targets: np.ndarray,
    shape: ModelShape,
    optimizer: AdamWConfig,
    *,
    record: bool = False,
) -> tuple[dict[str, np.ndarray], np.ndarray, Executor[np.ndarray]]:
    """One training step with the numpy kernels: (new state, loss, the executor with its trace)."""
    ex: Executor[np.ndarray] = Executor(OPS, hash_fn=tensor_hash if record else None)
    refs = training_step(ex, shape, optimizer, state, inputs, targets)
    return {k: ex.values[r] for k, r in refs.state.items()}, ex.values[refs.loss], ex
