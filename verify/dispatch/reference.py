"""A numpy twin of every aten mapping in ``verify.dispatch.aten``, for the tests.

Written from the definitions in ``aten``'s docstrings with numpy ufuncs on float32 arrays and the
numpy kernels of ``verify.repops.reference`` (itself tested bit for bit against the torch
kernels), so a torch handler that strays from its definition, or a library that rounds
differently, shows up as a mismatch. Keyed by the overload's name (``aten.mm.default``); an
in-place overload shares its functional twin (the test compares ``self`` after the call); an
operator that returns nothing and writes its list arguments gives the written tensors' values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from verify.repops import reference as kernels

F32 = np.float32
ONE = F32(1.0)


def _c(x: Any) -> Any:
    """An array as is; a Python number or a 0-d float array as a float32 scalar (a scalar
    operand is rounded to float32 first; numpy then keeps float32 arithmetic)."""
    if isinstance(x, np.ndarray) and (x.ndim or x.dtype.kind != "f"):
        return x
    return F32(x)


def _scale(x: np.ndarray, factor: Any) -> np.ndarray:
    return x if factor == 1 else x * F32(factor)


def add(a: Any, b: Any, alpha: Any = 1) -> np.ndarray:
    return _c(a) + _scale(_c(b), alpha)


def sub(a: Any, b: Any, alpha: Any = 1) -> np.ndarray:
    return _c(a) - _scale(_c(b), alpha)


def lerp(start: np.ndarray, end: np.ndarray, weight: Any) -> np.ndarray:
    w = _c(weight)
    diff = end - start
    return np.where(np.abs(w) < F32(0.5), start + w * diff, end - diff * (ONE - w))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return ONE / (kernels.exp(-x) + ONE)


def silu_backward(g: np.ndarray, x: np.ndarray) -> np.ndarray:
    s = sigmoid(x)
    return g * (s * (((ONE - s) * x) + ONE))


def gelu_cdf(x: np.ndarray) -> np.ndarray:
    return kernels.OPS["gelu_cdf"]([x], {})


BETA, KAPPA = F32(math.sqrt(2.0 / math.pi)), F32(0.044715)


def _tanh_inner(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x2 = x * x
    return x2, kernels.tanh((((x2 * x) * KAPPA) + x) * BETA)


def gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return (x * F32(0.5)) * (_tanh_inner(x)[1] + ONE)
    return x * gelu_cdf(x)


def gelu_backward(g: np.ndarray, x: np.ndarray, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        x2, t = _tanh_inner(x)
        left = (t + ONE) * F32(0.5)
        slope = (x2 * F32(3.0 * 0.044715)) + ONE
        right = ((x * F32(0.5)) * (ONE - t * t)) * BETA
        return g * (left + right * slope)
    return kernels.OPS["gelu_backward"]([x, gelu_cdf(x), g], {})


def power(x: np.ndarray, exponent: float) -> np.ndarray:
    if exponent == 0.5:
        return np.sqrt(x)
    if exponent == -0.5:
        return ONE / np.sqrt(x)
    out = np.ones_like(x) if exponent == 0 else x.copy()
    for _ in range(abs(int(exponent)) - 1):
        out = out * x
    return ONE / out if exponent < 0 else out


def addmm(bias: np.ndarray, a: np.ndarray, b: np.ndarray, beta: Any = 1, alpha: Any = 1) -> Any:
    return _scale(kernels.matmul(a, b), alpha) + _scale(bias, beta)


def _reduced(x: np.ndarray, dim: Any) -> list[int]:
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(x.ndim))
    return sorted({d % max(1, x.ndim) for d in ([dim] if isinstance(dim, int) else dim)})


def total(x: np.ndarray, dim: Any = None, keepdim: bool = False) -> np.ndarray:
    """Row-major flattening of the reduced dims, then the pairwise tree."""
    dims = _reduced(x, dim)
    kept = [d for d in range(x.ndim) if d not in dims]
    moved = np.transpose(x, kept + dims)
    flat = moved.reshape(*moved.shape[: len(kept)], -1)
    out = kernels.sum_tree(flat, -1) if flat.shape[-1] else np.zeros(flat.shape[:-1], F32)
    return np.expand_dims(out, dims) if keepdim else out


def mean(x: np.ndarray, dim: Any = None, keepdim: bool = False) -> np.ndarray:
    count = math.prod(x.shape[d] for d in _reduced(x, dim))
    return total(x, dim, keepdim) / F32(count)


def _along(fn: Callable[..., np.ndarray], dim: int, *arrays: np.ndarray) -> np.ndarray:
    moved = [np.moveaxis(a, dim, -1) for a in arrays]
    return np.moveaxis(fn(*moved), -1, dim)


def safe_softmax(x: np.ndarray, dim: int) -> np.ndarray:
    def rows(v: np.ndarray) -> np.ndarray:
        masked = np.all(v == -np.inf, axis=-1, keepdims=True)
        return np.where(masked, F32(0.0), kernels.softmax_rows(v))

    return _along(rows, dim, x)


def softmax_backward(dy: np.ndarray, y: np.ndarray, dim: int) -> np.ndarray:
    return _along(lambda d, p: (d - kernels.sum_tree(d * p, -1)[..., None]) * p, dim, dy, y)


def log_softmax(x: np.ndarray, dim: int) -> np.ndarray:
    def rows(v: np.ndarray) -> np.ndarray:
        shifted = v - (np.max(v, axis=-1, keepdims=True) + F32(0.0))
        return shifted - kernels.log_pos(kernels.sum_tree(kernels.exp(shifted), -1))[..., None]

    return _along(rows, dim, x)


def log_softmax_backward(dy: np.ndarray, y: np.ndarray, dim: int) -> np.ndarray:
    return _along(lambda d, v: d - kernels.exp(v) * kernels.sum_tree(d, -1)[..., None], dim, dy, y)


def nll_loss(
    x: np.ndarray, target: np.ndarray, weight: Any, reduction: int, ignore_index: int
) -> tuple[np.ndarray, np.ndarray]:
    rows, tgt = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    kept = tgt != ignore_index
    picked = np.where(kept, -rows[np.arange(len(rows)), np.where(kept, tgt, 0)], F32(0.0))
    count = F32(np.sum(kept))
    if reduction == 0:
        return picked.reshape(target.shape), F32(0.0)
    summed = kernels.sum_tree(picked, 0)
    return (summed / count if reduction == 1 else summed), count


def nll_loss_backward(
    grad: np.ndarray,
    x: np.ndarray,
    target: np.ndarray,
    weight: Any,
    reduction: int,
    ignore_index: int,
    total_weight: np.ndarray,
) -> np.ndarray:
    rows, tgt = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    kept = tgt != ignore_index
    g = -np.asarray(grad, F32)
    if reduction == 1:
        g = g / total_weight
    g = np.broadcast_to(g.reshape(-1), (len(rows),))
    out = np.zeros_like(rows)
    out[np.arange(len(rows))[kept], tgt[kept]] = g[kept]
    return out.reshape(x.shape)


def layer_norm(
    x: np.ndarray, normalized: list[int], weight: Any, bias: Any, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = math.prod(normalized)
    rows = x.reshape(-1, width)
    stats = kernels.OPS["layernorm_stats"]([rows], {"eps": eps})
    g = np.ones(width, F32) if weight is None else weight.reshape(width)
    b = np.zeros(width, F32) if bias is None else bias.reshape(width)
    y = kernels.OPS["layernorm"]([rows, stats, g, b], {}).reshape(x.shape)
    stat_shape = [*x.shape[: x.ndim - len(normalized)], *([1] * len(normalized))]
    return y, stats[:, 0].reshape(stat_shape), stats[:, 1].reshape(stat_shape)


def layer_norm_backward(
    grad: np.ndarray,
    x: np.ndarray,
    normalized: list[int],
    mean_: np.ndarray,
    rstd: np.ndarray,
    weight: Any,
    bias: Any,
    mask: list[bool],
) -> tuple[Any, Any, Any]:
    width = math.prod(normalized)
    rows, dy = x.reshape(-1, width), grad.reshape(-1, width)
    stats = np.stack((mean_.reshape(-1), rstd.reshape(-1)), axis=-1)
    g = np.ones(width, F32) if weight is None else weight.reshape(width)
    dx = kernels.OPS["layernorm_backward"]([rows, stats, g, dy], {}).reshape(x.shape)
    dw = kernels.OPS["layernorm_grad_weight"]([rows, stats, dy], {}).reshape(normalized)
    db = kernels.sum_tree(dy, 0).reshape(normalized)
    return (
        dx if mask[0] else None,
        dw if mask[1] and weight is not None else None,
        db if mask[2] and bias is not None else None,
    )


def embedding_backward(
    grad: np.ndarray, indices: np.ndarray, num_weights: int, padding_idx: int, scale: bool
) -> np.ndarray:
    dy = grad.reshape(-1, grad.shape[-1])
    out = kernels.OPS["embedding_backward"]([indices.reshape(1, -1), dy], {"vocab": num_weights})
    if padding_idx >= 0:
        out[padding_idx] = 0.0
    return out


def _both(a: Any, b: Any, *rest: Any) -> np.ndarray:
    return _c(a) * _c(b)


def foreach_add(tensors: list[np.ndarray], scalar: Any) -> list[np.ndarray]:
    return [t + _c(scalar) if t.dtype.kind == "f" else t + scalar for t in tensors]


def fused_adamw(
    params: list[np.ndarray],
    grads: list[np.ndarray],
    exp_avgs: list[np.ndarray],
    exp_avg_sqs: list[np.ndarray],
    max_exp_avg_sqs: list[np.ndarray],
    state_steps: list[np.ndarray],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: Any = None,
    found_inf: Any = None,
) -> list[np.ndarray]:
    """The written tensors after the call, in schema order: parameters, gradients (unchanged),
    first and second moments. Per parameter the graph's AdamW kernels: the moments, then the
    parameter from the new moments and the step tensor's count."""
    attrs = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    new_p, new_m, new_v = [], [], []
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True):
        g = -g if maximize else g
        m2 = kernels.OPS["adamw_m"]([m, g], attrs)
        v2 = kernels.OPS["adamw_v"]([v, g], attrs)
        new_p.append(kernels.OPS["adamw_param"]([p, m2, v2, step], attrs))
        new_m.append(m2)
        new_v.append(v2)
    return [*new_p, *grads, *new_m, *new_v]


def extreme(x: np.ndarray, dim: Any = (), keepdim: bool = False, largest: bool = True) -> Any:
    """numpy's max (or min) over the dims, which propagates NaN; a zero result is +0 in a
    maximum when any +0 is there (else -0), and -0 in a minimum when any -0 is."""
    axes = tuple(_reduced(x, dim))
    best = (np.max if largest else np.min)(x, axis=axes, keepdims=keepdim)
    zeros = (x == 0) & (np.signbit(x) != largest)
    won = np.any(zeros, axis=axes, keepdims=keepdim)
    signed = np.where(won, F32(0.0) if largest else F32(-0.0), F32(-0.0) if largest else F32(0.0))
    return np.where(best == 0, signed, best).astype(F32)


def extreme_dim(x: np.ndarray, dim: int, keepdim: bool = False, largest: bool = True) -> Any:
    """(values, the first index holding the value's bits, or the first NaN)."""
    value = extreme(x, [dim], True, largest)
    same = (x.view(np.int32) == value.view(np.int32)) | (np.isnan(x) & np.isnan(value))
    index = np.argmax(same, axis=dim, keepdims=True).astype(np.int64)
    return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))


def var_mean(x: np.ndarray, dim: Any = None, correction: Any = None, keepdim: bool = False) -> Any:
    dims = _reduced(x, dim)
    n = math.prod(x.shape[d] for d in dims)
    centre = total(x, dims, True) / F32(n)
    c = 1 if correction is None else correction
    var = total((x - centre) * (x - centre), dims, keepdim) / F32(max(0, n - c))
    return var, (centre if keepdim else centre.reshape(var.shape))


def vector_norm(x: np.ndarray, order: Any = 2, dim: Any = None, keepdim: bool = False) -> Any:
    if float(order) == 2:
        return np.sqrt(total(x * x, dim, keepdim))
    if float(order) == 1:
        return total(np.abs(x), dim, keepdim)
    return np.max(np.abs(x), axis=tuple(_reduced(x, dim)), keepdims=keepdim).astype(F32)


def mse_loss(x: np.ndarray, target: np.ndarray, reduction: int = 1) -> np.ndarray:
    squares = (x - target) * (x - target)
    if reduction == 0:
        return squares
    summed = total(squares)
    return summed / F32(squares.size) if reduction == 1 else summed


def mse_loss_backward(g: Any, x: np.ndarray, target: np.ndarray, reduction: int) -> np.ndarray:
    norm = F32(2.0 / x.size if reduction == 1 else 2.0)
    return ((x - target) * norm) * _c(g)


def cumsum(x: np.ndarray, dim: int, dtype: Any = None) -> np.ndarray:
    """A Python loop along the dim: out[i] = out[i - 1] + x[i] in float32."""
    moved = np.moveaxis(x.astype(F32), dim, 0) if x.ndim else x.astype(F32)
    out = moved.copy()
    for i in range(1, len(out) if x.ndim else 0):
        out[i] = out[i - 1] + moved[i]
    return np.moveaxis(out, 0, dim) if x.ndim else out


def maximum_minimum(a: np.ndarray, b: np.ndarray, largest: bool) -> np.ndarray:
    """numpy's maximum (minimum), which propagates NaN; where the pair are zeros of either sign,
    +0 wins a maximum and -0 a minimum."""
    a, b = np.broadcast_arrays(_f32_array(a), _f32_array(b))
    out = np.maximum(a, b) if largest else np.minimum(a, b)
    zeros = (a == 0) & (b == 0)
    signed = (np.signbit(a) & np.signbit(b)) if largest else (np.signbit(a) | np.signbit(b))
    return np.where(zeros, np.where(signed, F32(-0.0), F32(0.0)), out).astype(F32)


def _f32_array(x: Any) -> np.ndarray:
    return np.asarray(x).astype(F32)


def cumprod(x: np.ndarray, dim: int, dtype: Any = None) -> np.ndarray:
    """A Python loop along the dim: out[i] = out[i - 1] * x[i] in float32."""
    moved = np.moveaxis(x.astype(F32), dim, 0) if x.ndim else x.astype(F32)
    out = moved.copy()
    for i in range(1, len(out) if x.ndim else 0):
        out[i] = out[i - 1] * moved[i]
    return np.moveaxis(out, 0, dim) if x.ndim else out


def _tree_product(values: list[np.float32]) -> np.float32:
    """The pairwise tree, one level at a time: neighbours multiplied, an odd last one carried."""
    while len(values) > 1:
        level = [values[i] * values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = level + values[-1:] if len(values) % 2 else level
    return values[0] if values else F32(1.0)


def product(x: np.ndarray, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    """Each slice's elements over the dims in row-major order, multiplied by ``_tree_product``."""
    x = x.astype(F32)
    if x.ndim == 0:
        return x.copy()
    dims = _reduced(x, dim)
    kept = [d for d in range(x.ndim) if d not in dims]
    moved = np.transpose(x, kept + dims)
    flat = moved.reshape(*moved.shape[: len(kept)], -1)
    out = np.empty(flat.shape[:-1], F32)
    for index in np.ndindex(*out.shape):
        out[index] = _tree_product(list(flat[index]))
    if keepdim:
        out = out.reshape([1 if d in dims else x.shape[d] for d in range(x.ndim)])
    return out


def clamp(x: np.ndarray, low: Any = None, high: Any = None) -> np.ndarray:
    out = x if low is None else np.where(x < _c(low), _c(low), x)
    return (out if high is None else np.where(out > _c(high), _c(high), out)).astype(F32)


def scatter(x: np.ndarray, dim: int, index: np.ndarray, src: Any) -> np.ndarray:
    out = x.copy()
    values = np.broadcast_to(_c(src), index.shape) if np.ndim(src) == 0 else src
    for position in np.ndindex(*index.shape):
        target = list(position)
        target[dim] = index[position]
        out[tuple(target)] = values[position]
    return out


def foreach_mul(tensors: list[np.ndarray], scalar: Any) -> list[np.ndarray]:
    return [t * _c(scalar) for t in tensors]


def baddbmm(bias: np.ndarray, a: np.ndarray, b: np.ndarray, beta: Any = 1, alpha: Any = 1) -> Any:
    product = _scale(kernels.matmul(a, b), alpha)
    return product if beta == 0 else product + _scale(bias, beta)


REFERENCE: dict[str, Callable[..., Any]] = {
    "aten.add.Tensor": add,
    "aten.add.Scalar": add,
    "aten.add_.Tensor": add,
    "aten.add_.Scalar": add,
    "aten.sub.Tensor": sub,
    "aten.sub.Scalar": sub,
    "aten.sub_.Tensor": sub,
    "aten.sub_.Scalar": sub,
    "aten.rsub.Tensor": lambda a, b, alpha=1: sub(b, a, alpha),
    "aten.rsub.Scalar": lambda a, b, alpha=1: sub(b, a, alpha),
    "aten.mul.Tensor": _both,
    "aten.mul.Scalar": _both,
    "aten.mul_.Tensor": _both,
    "aten.mul_.Scalar": _both,
    "aten.div.Tensor": lambda a, b, rounding_mode=None: _c(a) / _c(b),
    "aten.div.Scalar": lambda a, b, rounding_mode=None: _c(a) / _c(b),
    "aten.div.Tensor_mode": lambda a, b, rounding_mode=None: _c(a) / _c(b),
    "aten.div.Scalar_mode": lambda a, b, rounding_mode=None: _c(a) / _c(b),
    "aten.div_.Tensor": lambda a, b: _c(a) / _c(b),
    "aten.div_.Scalar": lambda a, b: _c(a) / _c(b),
    "aten.lerp.Scalar": lerp,
    "aten.lerp.Tensor": lerp,
    "aten.lerp_.Scalar": lerp,
    "aten.lerp_.Tensor": lerp,
    "aten.addcmul.default": lambda s, a, b, value=1: s + _scale(a * b, value),
    "aten.addcmul_.default": lambda s, a, b, value=1: s + _scale(a * b, value),
    "aten.addcdiv.default": lambda s, a, b, value=1: s + _scale(a / b, value),
    "aten.addcdiv_.default": lambda s, a, b, value=1: s + _scale(a / b, value),
    "aten.sqrt.default": np.sqrt,
    "aten.rsqrt.default": lambda x: ONE / np.sqrt(x),
    "aten.exp.default": kernels.exp,
    "aten.tanh.default": kernels.tanh,
    "aten.sin.default": lambda x: kernels.sin_cos(x)[0],
    "aten.cos.default": lambda x: kernels.sin_cos(x)[1],
    "aten.sigmoid.default": sigmoid,
    "aten.relu.default": lambda x: np.where(x > 0, x, F32(0.0)),
    "aten.tanh_backward.default": lambda g, y: g * (ONE - y * y),
    "aten.sigmoid_backward.default": lambda g, y: g * ((ONE - y) * y),
    "aten.silu.default": lambda x: x / (kernels.exp(-x) + ONE),
    "aten.silu_backward.default": silu_backward,
    "aten.gelu.default": gelu,
    "aten.gelu_backward.default": gelu_backward,
    "aten.pow.Tensor_Scalar": power,
    "aten.mm.default": kernels.matmul,
    "aten.bmm.default": kernels.matmul,
    "aten.addmm.default": addmm,
    "aten.sum.dim_IntList": total,
    "aten.sum.default": lambda x, dtype=None: total(x),
    "aten.mean.dim": mean,
    "aten.mean.default": lambda x, dtype=None: mean(x),
    "aten._softmax.default": lambda x, dim, half=False: _along(kernels.softmax_rows, dim, x),
    "aten._safe_softmax.default": lambda x, dim, dtype=None: safe_softmax(x, dim),
    "aten._softmax_backward_data.default": lambda g, y, dim, t=None: softmax_backward(g, y, dim),
    "aten._log_softmax.default": lambda x, dim, half=False: log_softmax(x, dim),
    "aten._log_softmax_backward_data.default": lambda g, y, dim, t=None: log_softmax_backward(
        g, y, dim
    ),
    "aten.nll_loss_forward.default": nll_loss,
    "aten.nll_loss_backward.default": nll_loss_backward,
    "aten.native_layer_norm.default": layer_norm,
    "aten.native_layer_norm_backward.default": layer_norm_backward,
    "aten.embedding_dense_backward.default": embedding_backward,
    "aten._foreach_add_.Scalar": foreach_add,
    "aten._foreach_mul_.Tensor": foreach_mul,
    "aten._foreach_mul_.Scalar": foreach_mul,
    "aten._foreach_norm.Scalar": lambda ts, order=2, dtype=None: [
        vector_norm(t, order) for t in ts
    ],
    "aten.linalg_vector_norm.default": lambda x, order=2, dim=None, keepdim=False, dtype=None: (
        vector_norm(x, order, dim, keepdim)
    ),
    "aten.reciprocal.default": lambda x: ONE / x,
    "aten.clamp.default": clamp,
    "aten.clamp.Tensor": clamp,
    "aten.clamp_.default": clamp,
    "aten.clamp_.Tensor": clamp,
    "aten.clamp_min.default": lambda x, low: clamp(x, low),
    "aten.clamp_max.default": lambda x, high: clamp(x, None, high),
    "aten.mse_loss.default": mse_loss,
    "aten.mse_loss_backward.default": mse_loss_backward,
    "aten.amax.default": lambda x, dim=(), keepdim=False: extreme(x, dim, keepdim, True),
    "aten.amin.default": lambda x, dim=(), keepdim=False: extreme(x, dim, keepdim, False),
    "aten.max.default": lambda x: extreme(x, (), False, True),
    "aten.min.default": lambda x: extreme(x, (), False, False),
    "aten.max.dim": lambda x, dim, keepdim=False: extreme_dim(x, dim, keepdim, True),
    "aten.min.dim": lambda x, dim, keepdim=False: extreme_dim(x, dim, keepdim, False),
    "aten.scatter.src": scatter,
    "aten.scatter.value": scatter,
    "aten.var.correction": lambda x, dim=None, correction=None, keepdim=False: var_mean(
        x, dim, correction, keepdim
    )[0],
    "aten.std.correction": lambda x, dim=None, correction=None, keepdim=False: np.sqrt(
        var_mean(x, dim, correction, keepdim)[0]
    ),
    "aten.var_mean.correction": var_mean,
    "aten.std_mean.correction": lambda x, dim=None, correction=None, keepdim=False: (
        lambda v, m: (np.sqrt(v), m)
    )(*var_mean(x, dim, correction, keepdim)),
    "aten.log.default": kernels.log,
    "aten.log1p.default": kernels.log1p,
    "aten.sgn.default": lambda x: np.where(x > 0, ONE, np.where(x < 0, -ONE, x)),
    "aten.sign.default": lambda x: np.where(x > 0, ONE, np.where(x < 0, -ONE, x)),
    "aten.baddbmm.default": baddbmm,
    "aten.cumsum.default": cumsum,
    "aten.cumprod.default": cumprod,
    "aten.prod.default": lambda x, dtype=None: product(x),
    "aten.prod.dim_int": lambda x, dim, keepdim=False, dtype=None: product(x, dim, keepdim),
    "aten.maximum.default": lambda a, b: maximum_minimum(a, b, True),
    "aten.minimum.default": lambda a, b: maximum_minimum(a, b, False),
    "aten.atan.default": kernels.atan,
    "aten._fused_adamw_.default": fused_adamw,
    "aten.arange.default": lambda *a, **k: np.arange(*a).astype(F32),
    "aten.arange.start": lambda *a, **k: np.arange(*a).astype(F32),
    "aten.arange.start_step": lambda *a, **k: np.arange(*a).astype(F32),
}
