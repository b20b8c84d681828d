"""RepOps by dispatch, operator by operator: every mapped aten operator under ``RepOpsMode``
equals its numpy twin bit for bit on random shapes and values, on one and two threads and with
the compiled kernels switched off; unmapped operators are refused by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verify.dispatch import HANDLERS, RepOpsMode, UnmappedOperator, survey
from verify.dispatch.calls import results
from verify.dispatch.reference import REFERENCE
from verify.repops import native as repops_native
from verify.repops import ops, reference

FEW = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Rng = np.random.Generator
Case = tuple[tuple[Any, ...], dict[str, Any]]


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    # The tests switch torch's thread count; whatever they leave, the next test starts as before.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _x(rng: Rng, shape: tuple[int, ...], positive: bool = False) -> np.ndarray:
    """float32 values over several binades (and some zeros of either sign)."""
    x = np.asarray(rng.standard_normal(shape) * rng.choice([0.01, 1.0, 12.0], shape))
    x[rng.random(shape) < 0.05] = 0.0
    x[rng.random(shape) < 0.03] = -0.0
    return np.asarray(np.abs(x) + 1e-3 if positive else x, dtype=np.float32)


def _shape(rng: Rng, low: int = 1, high: int = 3) -> tuple[int, ...]:
    return tuple(int(n) for n in rng.integers(1, 9, size=rng.integers(low, high + 1)))


def _unary(positive: bool = False) -> Callable[[Rng], Case]:
    return lambda rng: ((_x(rng, _shape(rng), positive),), {})


def _pair(rng: Rng) -> tuple[np.ndarray, np.ndarray]:
    shape = _shape(rng)
    return _x(rng, shape), _x(rng, shape)


def _binary(kind: str) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        a, b = _pair(rng)
        if kind == "positive":
            b = np.abs(b) + np.float32(0.5)
        if kind == "scalar":
            return (a, float(rng.choice([0.1, -1.7, 3.0]))), {}
        if kind == "mode":
            return (a, np.abs(b) + np.float32(0.5)), {"rounding_mode": None}
        if kind == "scalar_mode":
            return (a, float(rng.choice([0.1, -1.7, 3.0]))), {"rounding_mode": None}
        if kind == "alpha":
            return (a, b), {"alpha": float(rng.choice([1, 0.3, -2.5]))}
        if kind == "tensor0d":  # a float64 0-d tensor is a scalar, rounded to float32 first
            return (a, np.array(rng.standard_normal(), np.float64)), {}
        return (a, b), {}

    return build


def _ternary(value: bool, positive_last: bool = False) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        shape = _shape(rng)
        s, a, b = (_x(rng, shape) for _ in range(3))
        if positive_last:
            b = np.abs(b) + np.float32(0.5)
        return (s, a, b), ({"value": float(rng.choice([1, 1e-3, -0.02]))} if value else {})

    return build


def _lerp(tensor_weight: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        a, b = _pair(rng)
        w = rng.uniform(-0.2, 1.2, a.shape).astype(np.float32) if tensor_weight else 0.1
        return (a, b, w if tensor_weight else float(rng.choice([0.1, 0.5, 0.9]))), {}

    return build


def _matmul(batched: bool, bias: bool = False) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        m, k, n = (int(v) for v in rng.integers(1, 40, size=3))
        lead = (int(rng.integers(1, 4)),) if batched else ()
        a, b = _x(rng, (*lead, m, k)), _x(rng, (*lead, k, n))
        if not bias:
            return (a, b), {}
        scales = {"alpha": 0.5, "beta": 2.0} if rng.random() < 0.5 else {}
        return (_x(rng, (n,)), a, b), scales

    return build


def _reduce(with_dim: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        x = _x(rng, _shape(rng, 1, 4))
        if not with_dim:
            return (x,), {}
        dims = sorted(rng.choice(x.ndim, size=rng.integers(1, x.ndim + 1), replace=False))
        return (x, [int(d) for d in dims], bool(rng.random() < 0.5)), {}

    return build


def _softmax(backward: bool, safe: bool = False) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        x = _x(rng, _shape(rng, 1, 3))
        dim = int(rng.integers(-x.ndim, x.ndim))
        if safe:
            x[x < -5] = -np.inf  # some entries masked, sometimes whole rows
            return (x, dim), {}
        if backward:
            return (x, _x(rng, x.shape), dim, torch.float32), {}
        return (x, dim, False), {}

    return build


def _nll(backward: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        rows, classes = int(rng.integers(1, 40)), int(rng.integers(1, 30))
        x = _x(rng, (rows, classes))
        target = rng.integers(0, classes, rows)
        target[rng.random(rows) < 0.2] = -100
        reduction = int(rng.integers(0, 3))
        if not backward:
            return (x, target, None, reduction, -100), {}
        grad = _x(rng, (rows,) if reduction == 0 else ())
        count = np.array(np.sum(target != -100), np.float32)
        return (grad, x, target, None, reduction, -100, count), {}

    return build


def _layer_norm(backward: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        rows, width = int(rng.integers(1, 12)), int(rng.integers(1, 70))
        x = _x(rng, (rows, width))
        affine = rng.random() < 0.7
        w, b = (_x(rng, (width,)), _x(rng, (width,))) if affine else (None, None)
        if not backward:
            return (x, [width], w, b, 1e-5), {}
        mean = _x(rng, (rows, 1))
        rstd = _x(rng, (rows, 1), positive=True)
        return (_x(rng, x.shape), x, [width], mean, rstd, w, b, [True, True, True]), {}

    return build


def _embedding_backward(rng: Rng) -> Case:
    vocab, tokens, width = (int(v) for v in rng.integers(1, 50, size=3))
    tokens = 1 if rng.random() < 0.25 else tokens  # one token: the exact sum is the gradient
    indices = rng.integers(0, vocab, (tokens,))
    padding = int(rng.integers(0, vocab)) if rng.random() < 0.3 else -1
    return (_x(rng, (tokens, width)), indices, vocab, padding, False), {}


def _pow(rng: Rng) -> Case:
    exponent = float(rng.choice([0.0, 1.0, 2.0, 3.0, -1.0, 0.5, -0.5]))
    return (_x(rng, _shape(rng), positive=exponent in (0.5, -0.5, -1.0)), exponent), {}


def _arange(rng: Rng) -> Case:
    return (int(rng.integers(-5, 5)), int(rng.integers(5, 40))), {"dtype": torch.float32}


def _foreach_add(rng: Rng) -> Case:
    tensors = [_x(rng, _shape(rng, 0, 2)) for _ in range(int(rng.integers(1, 4)))]
    return (tensors, float(rng.choice([1.0, 0.1, -3.0]))), {}


def _fused_adamw(rng: Rng) -> Case:
    """A few parameters (some longer than the compiled kernel's 256-element blocks, some with an
    infinite gradient entry: the kernel leaves that block and the rest to the eager ops)."""
    lists: list[list[np.ndarray]] = [[], [], [], [], [], []]
    for _ in range(int(rng.integers(1, 4))):
        shape = (int(rng.integers(1, 1100)),) if rng.random() < 0.5 else _shape(rng, 1, 2)
        grad = _x(rng, shape)
        if rng.random() < 0.3:
            grad.reshape(-1)[int(rng.integers(0, grad.size))] = np.inf
        step = np.asarray(float(rng.integers(0, 3000)), dtype=np.float32)
        values = (_x(rng, shape), grad, _x(rng, shape), np.abs(_x(rng, shape)))
        for kept, value in zip(lists, (*values, None, step), strict=True):
            if value is not None:
                kept.append(value)
    settings = {
        "lr": float(rng.choice([1e-3, 2e-3, 0.1])),
        "beta1": float(rng.choice([0.9, 0.8])),
        "beta2": float(rng.choice([0.999, 0.95])),
        "weight_decay": float(rng.choice([0.0, 0.01, 0.1])),
        "eps": float(rng.choice([1e-8, 1e-6])),
        "amsgrad": False,
        "maximize": bool(rng.random() < 0.3),
    }
    return tuple(lists), settings


def _backward_pair(rng: Rng) -> Case:
    return _pair(rng), {}


def _gelu(backward: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        args = _pair(rng) if backward else (_x(rng, _shape(rng)),)
        return args, {"approximate": str(rng.choice(["none", "tanh"]))}

    return build


def _signed(rng: Rng, shape: tuple[int, ...]) -> np.ndarray:
    """Values with ties and zeros of both signs; all of one sign half the time, so that maxima
    and minima are often zeros."""
    x = np.round(_x(rng, shape))
    if rng.random() < 0.5:
        x = np.abs(x) if rng.random() < 0.5 else -np.abs(x)
    return x.astype(np.float32)


def _extreme(with_dim: str) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        x = _signed(rng, _shape(rng, 1, 3))
        if with_dim == "none":
            return (x,), {}
        if with_dim == "one":
            return (x, int(rng.integers(-x.ndim, x.ndim)), bool(rng.random() < 0.5)), {}
        dims = sorted(rng.choice(x.ndim, size=rng.integers(0, x.ndim + 1), replace=False))
        return (x, [int(d) for d in dims], bool(rng.random() < 0.5)), {}

    return build


def _variance(rng: Rng) -> Case:
    x = _x(rng, _shape(rng, 1, 3))
    dims = sorted(rng.choice(x.ndim, size=rng.integers(1, x.ndim + 1), replace=False))
    dim = None if rng.random() < 0.25 else [int(d) for d in dims]
    correction = [None, 0, 1, 2][int(rng.integers(0, 4))]
    return (x, dim), {"correction": correction, "keepdim": bool(rng.random() < 0.5)}


def _norm(rng: Rng) -> Case:
    x = _x(rng, _shape(rng, 1, 3))
    order = [2, 2.0, 1, float("inf")][int(rng.integers(0, 4))]
    dims = sorted(rng.choice(x.ndim, size=rng.integers(0, x.ndim + 1), replace=False))
    return (x, order, [int(d) for d in dims] or None, bool(rng.random() < 0.5)), {}


def _foreach_norm(rng: Rng) -> Case:
    tensors = [_x(rng, _shape(rng, 1, 2)) for _ in range(int(rng.integers(1, 4)))]
    return (tensors, [2, 1, float("inf")][int(rng.integers(0, 3))]), {}


def _foreach_mul(tensor: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        tensors = [_x(rng, _shape(rng, 1, 2)) for _ in range(int(rng.integers(1, 4)))]
        scale = rng.uniform(0.0, 1.5)
        return (tensors, np.array(scale, np.float32) if tensor else float(scale)), {}

    return build


def _clamp(kind: str) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        x = _x(rng, _shape(rng))
        low, high = sorted(float(v) for v in rng.choice([-1.0, -0.0, 0.0, 0.3, 2.5], 2))
        if rng.random() < 0.1:
            low, high = high + 1.0, low  # low above high: high everywhere
        if kind == "min":
            return (x, low), {}
        if kind == "max":
            return (x, high), {}
        if kind == "tensor":
            return (x, _x(rng, x.shape), _x(rng, x.shape)), {}
        bounds = [(low, high), (low, None), (None, high)][int(rng.integers(0, 3))]
        return (x, *bounds), {}

    return build


def _mse(backward: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        x, target = _pair(rng)
        reduction = int(rng.integers(0, 3))
        if not backward:
            return (x, target, reduction), {}
        grad = _x(rng, x.shape if reduction == 0 else ())
        return (grad, x, target, reduction), {}

    return build


def _scatter(value: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        rows, cols = (int(v) for v in rng.integers(1, 9, size=2))
        x = _x(rng, (rows, cols))
        dim = int(rng.integers(0, 2))
        taken = int(rng.integers(1, x.shape[dim] + 1))  # distinct indices along dim: a permutation
        order = np.argsort(rng.random(x.shape), axis=dim)
        index = order[:taken] if dim == 0 else order[:, :taken]
        src = 2.5 if value else _x(rng, index.shape)
        return (x, dim, index, src), {}

    return build


def _log1p(rng: Rng) -> Case:
    x = _x(rng, _shape(rng))
    x[rng.random(x.shape) < 0.2] = -1.0
    return (np.where(rng.random(x.shape) < 0.3, x * np.float32(1e-6), x),), {}


def _baddbmm(rng: Rng) -> Case:
    batch, m, k, n = (int(v) for v in rng.integers(1, 30, size=4))
    a, b = _x(rng, (batch, m, k)), _x(rng, (batch, k, n))
    bias = _x(rng, (batch, m, n) if rng.random() < 0.5 else (n,))
    scales = [{}, {"alpha": 0.5, "beta": 2.0}, {"beta": 0.0}][int(rng.integers(0, 3))]
    return (bias, a, b), scales


def _cumsum(rng: Rng) -> Case:
    x = _x(rng, _shape(rng))
    return (x, int(rng.integers(-x.ndim, x.ndim))), {}


def _cumprod(rng: Rng) -> Case:
    x = _x(rng, _shape(rng))
    x = np.where(rng.random(x.shape) < 0.5, x, np.float32(1.0) + x * np.float32(0.01))
    return (x.astype(np.float32), int(rng.integers(-x.ndim, x.ndim))), {}


def _prod(with_dim: bool) -> Callable[[Rng], Case]:
    def build(rng: Rng) -> Case:
        # Values near 1 (products that neither vanish nor overflow) and some of any size.
        x = _x(rng, _shape(rng, 1, 4))
        x = np.where(rng.random(x.shape) < 0.7, np.float32(1.0) + x * np.float32(0.05), x)
        x = x.astype(np.float32)
        if not with_dim:
            return (x,), {}
        return (x, int(rng.integers(-x.ndim, x.ndim)), bool(rng.random() < 0.5)), {}

    return build


def _maximum_minimum(rng: Rng) -> Case:
    """Pairs with ties, zeros of either sign, NaNs, and sometimes broadcast or 0-d."""
    a, b = _pair(rng)
    tie = rng.random(a.shape) < 0.2
    b = np.where(tie, a, b)
    b = np.where(rng.random(a.shape) < 0.1, -a * np.float32(0.0), b)  # +-0 against +-0
    a = np.where(rng.random(a.shape) < 0.05, np.float32(np.nan), a)
    b = np.where(rng.random(a.shape) < 0.05, np.float32(np.nan), b).astype(np.float32)
    shape = rng.integers(0, 3)
    if shape == 1:
        b = b[(0,) * (b.ndim - 1)][None].copy() if b.ndim > 1 else b  # broadcast a row
    elif shape == 2:
        b = np.asarray(b.reshape(-1)[0], np.float32)  # 0-d: a scalar operand
    return (a.astype(np.float32), b), {}


def _atan(rng: Rng) -> Case:
    x = _x(rng, _shape(rng))
    scaled = x * rng.choice([1e-20, 1.0, 1e6, 1e30], x.shape).astype(np.float32)
    x = np.where(rng.random(x.shape) < 0.5, scaled, x)
    specials = np.array([np.inf, -np.inf, np.nan, 1.0, -1.0, 0.41421357], np.float32)
    x = np.where(rng.random(x.shape) < 0.05, rng.choice(specials, x.shape), x)
    return (x.astype(np.float32),), {}


CASES: dict[str, Callable[[Rng], Case]] = {
    "aten.add.Tensor": _binary("alpha"),
    "aten.add.Scalar": _binary("scalar"),
    "aten.add_.Tensor": _binary("tensor0d"),
    "aten.add_.Scalar": _binary("scalar"),
    "aten.sub.Tensor": _binary("alpha"),
    "aten.sub.Scalar": _binary("scalar"),
    "aten.sub_.Tensor": _binary("alpha"),
    "aten.sub_.Scalar": _binary("scalar"),
    "aten.rsub.Tensor": _binary("alpha"),
    "aten.rsub.Scalar": _binary("scalar"),
    "aten.mul.Tensor": _binary("tensor0d"),
    "aten.mul.Scalar": _binary("scalar"),
    "aten.mul_.Tensor": _binary("plain"),
    "aten.mul_.Scalar": _binary("scalar"),
    "aten.div.Tensor": _binary("positive"),
    "aten.div.Scalar": _binary("scalar"),
    "aten.div.Tensor_mode": _binary("mode"),
    "aten.div.Scalar_mode": _binary("scalar_mode"),
    "aten.div_.Tensor": _binary("tensor0d"),
    "aten.div_.Scalar": _binary("scalar"),
    "aten.lerp.Scalar": _lerp(False),
    "aten.lerp.Tensor": _lerp(True),
    "aten.lerp_.Scalar": _lerp(False),
    "aten.lerp_.Tensor": _lerp(True),
    "aten.addcmul.default": _ternary(True),
    "aten.addcmul_.default": _ternary(True),
    "aten.addcdiv.default": _ternary(True, positive_last=True),
    "aten.addcdiv_.default": _ternary(True, positive_last=True),
    "aten.sqrt.default": _unary(positive=True),
    "aten.rsqrt.default": _unary(positive=True),
    "aten.exp.default": _unary(),
    "aten.tanh.default": _unary(),
    "aten.sin.default": _unary(),
    "aten.cos.default": _unary(),
    "aten.sigmoid.default": _unary(),
    "aten.relu.default": _unary(),
    "aten.tanh_backward.default": _backward_pair,
    "aten.sigmoid_backward.default": _backward_pair,
    "aten.silu.default": _unary(),
    "aten.silu_backward.default": _backward_pair,
    "aten.gelu.default": _gelu(False),
    "aten.gelu_backward.default": _gelu(True),
    "aten.pow.Tensor_Scalar": _pow,
    "aten.mm.default": _matmul(False),
    "aten.bmm.default": _matmul(True),
    "aten.addmm.default": _matmul(False, bias=True),
    "aten.sum.dim_IntList": _reduce(True),
    "aten.sum.default": _reduce(False),
    "aten.mean.dim": _reduce(True),
    "aten.mean.default": _reduce(False),
    "aten._softmax.default": _softmax(False),
    "aten._safe_softmax.default": _softmax(False, safe=True),
    "aten._softmax_backward_data.default": _softmax(True),
    "aten._log_softmax.default": _softmax(False),
    "aten._log_softmax_backward_data.default": _softmax(True),
    "aten.nll_loss_forward.default": _nll(False),
    "aten.nll_loss_backward.default": _nll(True),
    "aten.native_layer_norm.default": _layer_norm(False),
    "aten.native_layer_norm_backward.default": _layer_norm(True),
    "aten.embedding_dense_backward.default": _embedding_backward,
    "aten.arange.start": _arange,
    "aten._foreach_add_.Scalar": _foreach_add,
    "aten._fused_adamw_.default": _fused_adamw,
    "aten._foreach_norm.Scalar": _foreach_norm,
    "aten._foreach_mul_.Tensor": _foreach_mul(True),
    "aten._foreach_mul_.Scalar": _foreach_mul(False),
    "aten.linalg_vector_norm.default": _norm,
    "aten.reciprocal.default": _unary(),
    "aten.clamp.default": _clamp("both"),
    "aten.clamp.Tensor": _clamp("tensor"),
    "aten.clamp_.default": _clamp("both"),
    "aten.clamp_.Tensor": _clamp("tensor"),
    "aten.clamp_min.default": _clamp("min"),
    "aten.clamp_max.default": _clamp("max"),
    "aten.mse_loss.default": _mse(False),
    "aten.mse_loss_backward.default": _mse(True),
    "aten.amax.default": _extreme("list"),
    "aten.amin.default": _extreme("list"),
    "aten.max.default": _extreme("none"),
    "aten.min.default": _extreme("none"),
    "aten.max.dim": _extreme("one"),
    "aten.min.dim": _extreme("one"),
    "aten.scatter.src": _scatter(False),
    "aten.scatter.value": _scatter(True),
    "aten.var.correction": _variance,
    "aten.std.correction": _variance,
    "aten.var_mean.correction": _variance,
    "aten.std_mean.correction": _variance,
    "aten.log.default": _unary(),
    "aten.log1p.default": _log1p,
    "aten.sgn.default": _unary(),
    "aten.sign.default": _unary(),
    "aten.baddbmm.default": _baddbmm,
    "aten.cumsum.default": _cumsum,
    "aten.cumprod.default": _cumprod,
    "aten.prod.default": _prod(False),
    "aten.prod.dim_int": _prod(True),
    "aten.maximum.default": _maximum_minimum,
    "aten.minimum.default": _maximum_minimum,
    "aten.atan.default": _atan,
}


def _overload(name: str) -> torch._ops.OpOverload:
    _, packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _torch(value: Any) -> Any:
    if isinstance(value, list):
        return [_torch(v) for v in value]
    return torch.from_numpy(value.copy()) if isinstance(value, np.ndarray) else value


def _numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, (tuple, list)):
        return [_numpy(v) for v in value]
    return value


def _same(got: Any, want: Any, name: str) -> None:
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w, name)
        return
    if want is None:
        assert got is None, name
        return
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    differ = np.sum(got.view(np.uint8) != want.view(np.uint8))
    assert got.tobytes() == want.tobytes(), f"{name}: {differ} bytes differ"


def test_every_mapped_operator_has_a_reference_and_a_case() -> None:
    names = {str(op) for op in HANDLERS}
    assert names <= set(REFERENCE), names - set(REFERENCE)
    untested = names - set(CASES) - {"aten.arange.default", "aten.arange.start_step"}
    assert not untested, untested


@pytest.mark.parametrize("name", sorted(CASES))
@FEW
@given(seed=st.integers(0, 2**32 - 1))
def test_mapped_operator_equals_numpy_reference(name: str, seed: int) -> None:
    args, kwargs = CASES[name](np.random.default_rng(seed))
    with np.errstate(all="ignore"):
        want = REFERENCE[name](*args, **kwargs)
    op = _overload(name)
    inplace = name.split(".")[1].endswith("_")
    for threads, compiled in ((1, True), (2, True), (1, False)):
        torch.set_num_threads(threads)
        torch_args = [_torch(a) for a in args]
        eager = contextlib.nullcontext() if compiled else repops_native.disabled()
        with RepOpsMode() as mode, eager:
            got = op(*torch_args, **kwargs)
        assert mode.ops[name] == 1
        if not op._schema.returns:  # it writes its list arguments: compare what it wrote
            got = results(op, torch_args, kwargs, got)
        elif inplace:
            assert got is torch_args[0]
        _same(_numpy(got), want, f"{name} threads={threads} compiled={compiled}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_mapped_operator_on_cuda_equals_cpu() -> None:
    # The eager kernels on the GPU (the compiled ones are CPU-only) against the CPU's bits.
    for name in sorted(CASES):
        for seed in range(3):
            args, kwargs = CASES[name](np.random.default_rng(seed))
            op = _overload(name)
            results = []
            for device in ("cpu", "cuda"):
                moved = [_torch(a).to(device) if isinstance(a, np.ndarray) else a for a in args]
                with RepOpsMode():
                    got = op(*moved, **kwargs)
                results.append(torch.utils._pytree.tree_map(_to_cpu, got))
            _same(_numpy(results[1]), _numpy(results[0]), f"{name} cuda, seed {seed}")


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


# ---- backwards --------------------------------------------------------------------------------


def _scan_and_extremes(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """maximum, minimum, prod (whole and along a dim), cumprod and atan in one loss."""
    pair = torch.maximum(x, y) + torch.minimum(x, y * 2)
    return (
        torch.prod(x, 1).sum() + torch.prod(pair) + torch.cumprod(x, 1).sum()
        + torch.atan(pair * 3).sum()
    )  # fmt: skip


@pytest.mark.parametrize("zeros", [False, True])
def test_backwards_of_maximum_minimum_prod_cumprod_atan_are_mapped_and_thread_independent(
    zeros: bool,
) -> None:
    """Autograd's backwards of these operators are made of mapped ones (a product's and a
    running product's take another path when an input is 0): bit-identical on one and two
    threads, close to native torch's gradients."""
    generator = torch.Generator().manual_seed(4)
    x0 = 1 + 0.1 * torch.randn(4, 6, generator=generator)
    y0 = 1 + 0.1 * torch.randn(4, 6, generator=generator)
    y0[0, :3] = x0[0, :3]  # ties: maximum's and minimum's gradients are split
    if zeros:
        x0[1, 2] = x0[3, 0] = 0.0
    grads = {}
    for threads in (1, 2, 0):  # 0: native torch
        torch.set_num_threads(max(1, threads))
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        with RepOpsMode() if threads else contextlib.nullcontext() as mode:
            _scan_and_extremes(x, y).backward()
        assert x.grad is not None and y.grad is not None
        grads[threads] = (x.grad, y.grad)
        if threads:
            used = set(mode.ops)  # type: ignore[union-attr]
    for ours, theirs in zip(grads[1], grads[2], strict=True):
        assert ours.numpy().tobytes() == theirs.numpy().tobytes()
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    names = {"aten.maximum.default", "aten.minimum.default", "aten.prod.default",
             "aten.prod.dim_int", "aten.cumprod.default", "aten.atan.default"}  # fmt: skip
    assert names <= used, names - used


# ---- refusals ---------------------------------------------------------------------------------


class _ArcSine(torch.nn.Module):
    """A user's module with an operator RepOps has no mapping for (asin: a libm function)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.asin(x * self.weight).sum()


def test_unmapped_operator_is_refused_with_its_name_before_it_runs() -> None:
    x = torch.rand(3, 4)
    name = r"^aten\.asin\.default has no RepOps mapping"
    with pytest.raises(UnmappedOperator, match=name), RepOpsMode():
        _ArcSine()(x).backward()
    with pytest.raises(UnmappedOperator, match=r"aten\.nansum\.default"), RepOpsMode():
        torch.nansum(x, 0)  # a float reduction in an order of torch's choosing
    a = torch.ones(2, 2, dtype=torch.float64)
    refusals = [
        (lambda: torch.mm(a, a), r"aten\.mm .*float64 tensor; RepOps maps float32"),
        (lambda: torch.ops.aten.gelu(x, approximate="erf"), "approximate='erf'"),
        (
            lambda: x.abs().pow(2.5),
            r"aten\.pow\.Tensor_Scalar has no RepOps mapping \(exponent 2\.5\)",
        ),
        (lambda: torch.arange(0.0, 1.0, 0.1), r"aten\.arange"),
        (lambda: torch.div(x, 2.0, rounding_mode="floor"), "rounding_mode='floor'"),
    ]
    for call, message in refusals:
        with pytest.raises(UnmappedOperator, match=message), RepOpsMode():
            call()


def test_the_mode_is_entered_once() -> None:
    with RepOpsMode(), pytest.raises(RuntimeError, match="already active"), RepOpsMode():
        pass


def test_integer_arithmetic_and_data_movement_run_natively() -> None:
    tokens = torch.tensor([[3, 1], [2, 7]])
    x = torch.randn(2, 3)
    with RepOpsMode() as mode:
        positions = torch.cumsum(torch.ones_like(tokens), 1) - 1
        picked = torch.cat([x, -x]).t().contiguous()[:, tokens[0, 1]]
        ratio = tokens / 2  # integer inputs, a float result: the mapped true division
    assert positions.tolist() == [[0, 1], [0, 1]]
    assert torch.equal(picked, torch.cat([x, -x]).t()[:, 1])
    assert ratio.tolist() == [[1.5, 0.5], [1.0, 3.5]]
    assert mode.ops["aten.cumsum.default"] == 1 and mode.ops["aten.div.Tensor"] == 1


def test_survey_lists_the_operators_and_the_unmapped_ones() -> None:
    model, x = _ArcSine(), torch.rand(3, 4)
    found = survey(lambda: model(x).backward())
    assert found.unmapped == {"aten.asin.default"}
    assert survey(lambda: torch.randn(2)).unmapped == {"aten.randn.default"}  # no RNG mapped
    assert found.ops["aten.asin.default"] == 1 and found.ops["aten.sum.default"] == 1
    assert model.weight.grad is not None  # it ran, natively


def test_tanh_sin_and_cos_kernels_are_accurate_and_equal_their_numpy_twins() -> None:
    # The kernels RepOps adds for tanh (GPT-2's GELU) and sin/cos (rotary embeddings).
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(20000) * rng.choice([0.01, 0.5, 3.0, 200.0], 20000)).astype(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, 0.625, -0.625, 44.0, 100.0, -1e-30], np.float32)])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        tanh = ops.tanh(torch.from_numpy(x)).numpy()
        sin, cos = (t.numpy() for t in ops.sin_cos(torch.from_numpy(x)))
        with np.errstate(all="ignore"):
            _same(tanh, reference.tanh(x), "tanh")
            _same([sin, cos], list(reference.sin_cos(x)), "sin_cos")
    wide = x.astype(np.float64)
    ulp = np.spacing(np.abs(np.tanh(wide)).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(tanh - np.tanh(wide)) <= 3 * ulp)
    for got, truth in ((sin, np.sin(wide)), (cos, np.cos(wide))):
        ulp = np.spacing(np.abs(truth).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(got - truth) <= ulp)  # within one ulp (measured: half of one)


def test_log_and_log1p_kernels_are_accurate_and_equal_their_numpy_twins() -> None:
    # Subnormal to huge inputs, near 1 and near -1 (log1p), and every special value.
    rng = np.random.default_rng(6)
    scale = rng.choice([1e-40, 1e-20, 1e-6, 0.01, 1.0, 12.0, 1e30], 20000)
    x = np.abs(rng.standard_normal(20000) * scale).astype(np.float32)
    x = np.concatenate([x, -x, x - 1, [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan]])
    x = x.astype(np.float32)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        log, log1p = (fn(torch.from_numpy(x)).numpy() for fn in (ops.log, ops.log1p))
        with np.errstate(all="ignore"):
            _same([log, log1p], [reference.log(x), reference.log1p(x)], "log, log1p")
    with np.errstate(all="ignore"):
        truths = np.log(x.astype(np.float64)), np.log1p(x.astype(np.float64))
    for got, truth in ((log, truths[0]), (log1p, truths[1])):
        assert np.array_equal(np.isnan(got), np.isnan(truth))
        finite = np.isfinite(truth)
        assert np.array_equal(got[~finite & ~np.isnan(truth)], truth[~finite & ~np.isnan(truth)])
        ulp = np.spacing(np.abs(truth[finite]).astype(np.float32)).astype(np.float64)
        # Within half an ulp plus the float64 series' error: correctly rounded on these inputs.
        assert np.all(np.abs(got[finite] - truth[finite]) <= 0.5 * ulp * (1 + 1e-6))
