"""Elementwise aten operators under RepOps: IEEE ``+ - * /`` with their scalars and scale factors
fixed, compound operators (``lerp``, ``addcmul``, ``addcdiv``) split into single IEEE operations,
and the functions a library computes differently (``exp``, ``log``, ``log1p``, ``tanh``,
``sin``, ``cos``, ``atan``, ``sigmoid``, ``silu``, ``gelu``, ``sqrt``, ``rsqrt``, ``pow``; the
zeros of ``relu``, ``sign`` and ``clamp``) defined over RepOps' own kernels (``verify.repops.ops``).
Importing it registers them in ``HANDLERS``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from verify.dispatch.registry import (
    F32,
    HANDLERS,
    Handler,
    UnmappedOperator,
    as_f32,
    inplace,
    maps,
    one,
    operand,
    scaled,
)
from verify.repops import native as repops_native
from verify.repops import ops

aten = torch.ops.aten


# ---- elementwise arithmetic: IEEE, one rounding per operation ---------------------------------


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str) -> Handler:
    def run(self: Any, other: Any, alpha: Any = 1) -> torch.Tensor:
        like = self if isinstance(self, torch.Tensor) else other
        a, b = operand(self, like, name), operand(other, like, name)
        return fn(a, scaled(b, alpha))

    return run


_add = maps(aten.add.Tensor, aten.add.Scalar)(_binary(torch.add, "aten.add"))
_sub = maps(aten.sub.Tensor, aten.sub.Scalar)(_binary(torch.sub, "aten.sub"))
maps(aten.add_.Tensor, aten.add_.Scalar)(inplace(_add))
maps(aten.sub_.Tensor, aten.sub_.Scalar)(inplace(_sub))


@maps(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(self: torch.Tensor, other: Any, alpha: Any = 1) -> torch.Tensor:
    return _sub(operand(other, self, "aten.rsub"), self, alpha)  # other - alpha self


def _mul(self: Any, other: Any) -> torch.Tensor:
    like = self if isinstance(self, torch.Tensor) else other
    return torch.mul(operand(self, like, "aten.mul"), operand(other, like, "aten.mul"))


def _div(self: Any, other: Any, rounding_mode: str | None = None) -> torch.Tensor:
    if rounding_mode is not None and (self.is_floating_point() or isinstance(other, float)):
        raise UnmappedOperator("aten.div", f"rounding_mode={rounding_mode!r} on floats")
    return torch.div(operand(self, self, "aten.div"), operand(other, self, "aten.div"))


maps(aten.mul.Tensor, aten.mul.Scalar)(_mul)
maps(aten.mul_.Tensor, aten.mul_.Scalar)(inplace(_mul))
maps(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)(_div)
maps(aten.div_.Tensor, aten.div_.Scalar)(inplace(_div))


@maps(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(self: torch.Tensor, end: torch.Tensor, weight: Any) -> torch.Tensor:
    """self + w (end - self) for |w| < 0.5, else end - (end - self)(1 - w): torch's formula,
    each operation rounded on its own (torch's vector body fuses them)."""
    start, end = as_f32(self, "aten.lerp"), as_f32(end, "aten.lerp")
    w = operand(weight, start, "aten.lerp")
    diff = torch.sub(end, start)
    low = torch.add(start, torch.mul(w, diff))
    high = torch.sub(end, torch.mul(diff, torch.sub(torch.ones_like(w), w)))
    return torch.where(w.abs() < 0.5, low, high)


@maps(aten.addcmul.default)
def _addcmul(
    self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any = 1
) -> torch.Tensor:
    """self + value (t1 t2): the product, then the scale, then the sum, each rounded."""
    product = torch.mul(as_f32(t1, "aten.addcmul"), as_f32(t2, "aten.addcmul"))
    return torch.add(as_f32(self, "aten.addcmul"), scaled(product, value))


@maps(aten.addcdiv.default)
def _addcdiv(
    self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any = 1
) -> torch.Tensor:
    """self + value (t1 / t2): the quotient, then the scale, then the sum, each rounded."""
    quotient = torch.div(as_f32(t1, "aten.addcdiv"), as_f32(t2, "aten.addcdiv"))
    return torch.add(as_f32(self, "aten.addcdiv"), scaled(quotient, value))


maps(aten.lerp_.Scalar, aten.lerp_.Tensor)(inplace(_lerp))
maps(aten.addcmul_.default)(inplace(_addcmul))
maps(aten.addcdiv_.default)(inplace(_addcdiv))


# ---- elementwise functions: RepOps' own polynomials --------------------------------------------


def _unary(fn: Callable[[torch.Tensor], torch.Tensor], name: str) -> Handler:
    # An integer tensor is converted as torch would (to float32, each value correctly rounded).
    return lambda x: fn(as_f32(x, name) if x.is_floating_point() else x.to(F32))


def _rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.div(one(x), ops.sqrt(x))  # two roundings: the correctly rounded sqrt, 1 / it


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.div(one(x), ops.exp(torch.neg(x)).add_(1.0))  # 1 / (1 + exp(-x))


HANDLERS.update(
    {
        aten.sqrt.default: _unary(ops.sqrt, "aten.sqrt"),
        aten.rsqrt.default: _unary(_rsqrt, "aten.rsqrt"),
        aten.exp.default: _unary(ops.exp, "aten.exp"),
        aten.tanh.default: _unary(ops.tanh, "aten.tanh"),
        aten.sin.default: _unary(lambda x: ops.sin_cos(x)[0], "aten.sin"),
        aten.cos.default: _unary(lambda x: ops.sin_cos(x)[1], "aten.cos"),
        aten.sigmoid.default: _unary(_sigmoid, "aten.sigmoid"),
        aten.log.default: _unary(ops.log, "aten.log"),
        aten.log1p.default: _unary(ops.log1p, "aten.log1p"),
        aten.atan.default: _unary(ops.atan, "aten.atan"),
        aten.reciprocal.default: _unary(lambda x: torch.div(one(x), x), "aten.reciprocal"),
    }
)


@maps(aten.sgn.default, aten.sign.default)
def _sign(x: torch.Tensor) -> torch.Tensor:
    """1 above 0, -1 below, and x itself otherwise (a zero keeps its sign, a NaN stays NaN):
    selections, so no library's vector body and scalar tail can disagree on a zero's sign."""
    x = as_f32(x, "aten.sign")
    unit = torch.ones((), dtype=x.dtype, device=x.device)
    return torch.where(x > 0, unit, torch.where(x < 0, -unit, x))


def _clamp(x: torch.Tensor, low: Any = None, high: Any = None) -> torch.Tensor:
    """x below ``low`` becomes low, then above ``high`` becomes high (bounds rounded to float32
    first): selections, so a zero keeps its sign and a NaN stays NaN; low > high gives high,
    as torch."""
    x = as_f32(x, "aten.clamp")
    out = x
    if low is not None:
        low = operand(low, x, "aten.clamp")
        out = torch.where(out < low, low, out)
    if high is not None:
        high = operand(high, x, "aten.clamp")
        out = torch.where(out > high, high, out)
    return out.clone() if out is x else out


maps(aten.clamp.default, aten.clamp.Tensor)(_clamp)
maps(aten.clamp_.default, aten.clamp_.Tensor)(inplace(_clamp))
maps(aten.clamp_min.default)(lambda x, low: _clamp(x, low, None))
maps(aten.clamp_max.default)(lambda x, high: _clamp(x, None, high))


@maps(aten.relu.default)
def _relu(x: torch.Tensor) -> torch.Tensor:
    """x where x > 0, else +0: a selection (torch's max(x, 0) may keep a -0 in its vector body
    and not in its scalar tail)."""
    x = as_f32(x, "aten.relu")
    return torch.where(x > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


@maps(aten.tanh_backward.default)
def _tanh_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mul(grad, torch.sub(one(y), torch.mul(y, y)))  # dy (1 - y^2)


@maps(aten.sigmoid_backward.default)
def _sigmoid_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mul(grad, torch.sub(one(y), y).mul_(y))  # dy ((1 - y) y)


@maps(aten.silu.default)
def _silu(x: torch.Tensor) -> torch.Tensor:
    x = as_f32(x, "aten.silu")
    return torch.div(x, ops.exp(torch.neg(x)).add_(1.0))  # x / (1 + exp(-x))


@maps(aten.silu_backward.default)
def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy s (1 + x (1 - s)), s = sigmoid(x)."""
    s = _sigmoid(as_f32(x, "aten.silu_backward"))
    inner = torch.sub(one(s), s).mul_(x).add_(1.0)
    return torch.mul(grad, s.mul_(inner))


GELU_BETA, GELU_KAPPA = math.sqrt(2.0 / math.pi), 0.044715  # tanh GELU: tanh(beta (x + k x^3))


def _gelu_kind(name: str, approximate: str) -> bool:
    """True for the tanh approximation, False for the exact GELU; refuses anything else."""
    if approximate not in ("none", "tanh"):
        raise UnmappedOperator(name, f"approximate={approximate!r}")
    return approximate == "tanh"


def _gelu_tanh_inner(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^2, tanh(beta (x + kappa x^3))) in torch's operation order, each op rounded."""
    x2 = torch.mul(x, x)
    inner = torch.mul(x2, x).mul_(GELU_KAPPA).add_(x).mul_(GELU_BETA)
    return x2, ops.tanh(inner)


@maps(aten.gelu.default)
def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x Phi(x) with RepOps' erf; or (x / 2)(1 + tanh(beta (x + kappa x^3)))."""
    x = as_f32(x, "aten.gelu")
    if _gelu_kind("aten.gelu.default", approximate):
        return torch.mul(x, 0.5).mul_(_gelu_tanh_inner(x)[1].add_(1.0))
    fused = repops_native.gelu(x.contiguous(), ops.NATIVE_CONSTANTS)  # the same ops, one pass
    return torch.mul(x, ops.OPS["gelu_cdf"]([x.contiguous()], {})) if fused is None else fused


@maps(aten.gelu_backward.default)
def _gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """dy (Phi(x) + x phi(x)); for tanh, torch's formula: dy ((1 + t) / 2
    + (x / 2)(1 - t^2) beta (1 + 3 kappa x^2)), t the forward's tanh."""
    x = as_f32(x, "aten.gelu_backward").contiguous()
    if _gelu_kind("aten.gelu_backward.default", approximate):
        x2, t = _gelu_tanh_inner(x)
        left = torch.add(t, 1.0).mul_(0.5)
        slope = x2.mul_(3.0 * GELU_KAPPA).add_(1.0)
        right = torch.mul(x, 0.5).mul_(torch.sub(one(t), torch.mul(t, t))).mul_(GELU_BETA)
        return torch.mul(grad, left.add_(right.mul_(slope)))
    fused = repops_native.gelu_backward_of_x(x, grad.contiguous(), ops.NATIVE_CONSTANTS)
    if fused is not None:  # the same ops, one pass
        return fused
    cdf = ops.OPS["gelu_cdf"]([x], {})
    return ops.OPS["gelu_backward"]([x, cdf, grad.contiguous()], {})


@maps(aten.pow.Tensor_Scalar)
def _pow(x: torch.Tensor, exponent: Any) -> torch.Tensor:
    """Small integer powers as left-to-right products; 0.5 and -0.5 through the correctly
    rounded sqrt. Other exponents need a library pow (not reproducible) and are refused."""
    x = as_f32(x, "aten.pow")
    e = float(exponent)
    if e == 0.5:
        return ops.sqrt(x)
    if e == -0.5:
        return _rsqrt(x)
    if e != int(e) or not -8 <= e <= 8:
        raise UnmappedOperator("aten.pow.Tensor_Scalar", f"exponent {exponent}")
    n = abs(int(e))
    out = torch.ones_like(x) if n == 0 else x.clone()
    for _ in range(n - 1):
        out = torch.mul(out, x)
    return torch.div(one(x), out) if e < 0 else out
