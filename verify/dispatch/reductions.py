"""Reductions under RepOps beyond ``sum``/``mean``: maxima and minima (exact in any order, signed
zeros and ties fixed; ``maximum``/``minimum`` elementwise the same way), variance and standard
deviation (two passes of the pairwise tree), vector norms and ``_foreach_norm`` (what
``torch.nn.utils.clip_grad_norm_`` calls), the mean squared error and its backward, the float
``cumsum`` and ``cumprod`` (sequential in index order), and ``prod`` (a fixed pairwise tree of
multiplies). Importing it registers them in ``HANDLERS``; ``sum_dims`` is the tree sum the
sums among them use."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from verify.dispatch.registry import F32, UnmappedOperator, as_f32, maps, operand
from verify.repops import ops

aten = torch.ops.aten


def reduced_dims(x: torch.Tensor, dim: Sequence[int] | int | None) -> list[int]:
    """The dims a reduction over ``dim`` covers (all for None or an empty list), sorted."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(x.dim()))
    return sorted({d % max(1, x.dim()) for d in ([dim] if isinstance(dim, int) else dim)})


def sum_dims(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """Sum over ``dims`` by ``sum_tree`` over their elements in row-major order."""
    if x.dim() == 0:
        return x.clone()
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    flat = moved.reshape(*moved.shape[: len(kept)], -1)
    if flat.shape[-1] == 1:  # sum_tree would return a view of the input: a result must not alias
        out = flat[..., 0].clone()
    elif flat.shape[-1]:
        out = ops.sum_tree(flat, -1)
    else:
        out = torch.zeros(flat.shape[:-1], dtype=x.dtype, device=x.device)
    if keepdim:
        out = out.view([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return out


def _count(x: torch.Tensor, dims: list[int]) -> int:
    return math.prod(x.shape[d] for d in dims) if x.dim() else 1


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=F32, device=like.device)


# ---- maxima and minima: exact, on order keys ----------------------------------------------------


def _keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys in float32's total order (-0 below +0): the bits with the lower 31 flipped
    for negative values. An integer maximum is exact in any order; the map is its own inverse."""
    bits = x.contiguous().view(torch.int32)
    return bits ^ (bits >> 31).bitwise_and_(0x7FFFFFFF)


def _extreme(
    x: torch.Tensor, dims: list[int], keepdim: bool, largest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the largest or smallest value over ``dims``, whether that slice holds a NaN): +0 beats
    -0 in a maximum and -0 wins a minimum; a slice with a NaN gives NaN."""
    keys = _keys(x)
    best = keys.amax(dim=dims, keepdim=keepdim) if largest else keys.amin(dim=dims, keepdim=keepdim)
    nan = torch.isnan(x).any(dim=dims, keepdim=keepdim) if dims else torch.isnan(x)
    out = (best ^ (best >> 31).bitwise_and_(0x7FFFFFFF)).view(F32)
    return torch.where(nan, math.nan, out), nan


def _amax_amin(largest: bool) -> Any:
    def run(x: torch.Tensor, dim: Any = (), keepdim: bool = False) -> torch.Tensor:
        x = as_f32(x, "aten.amax" if largest else "aten.amin")
        if x.dim() == 0:
            return x.clone()
        return _extreme(x, reduced_dims(x, dim), keepdim, largest)[0]

    return run


maps(aten.amax.default, aten.max.default)(_amax_amin(True))
maps(aten.amin.default, aten.min.default)(_amax_amin(False))


def _max_min_dim(largest: bool) -> Any:
    def run(x: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices): the index of the first element with the value's bits (the first
        NaN in a slice holding one)."""
        x = as_f32(x, "aten.max.dim" if largest else "aten.min.dim")
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        dim %= x.dim()
        value, nan = _extreme(x, [dim], True, largest)
        hit = torch.where(nan, torch.isnan(x), _keys(x) == _keys(value))
        n = x.shape[dim]
        shape = [n if d == dim else 1 for d in range(x.dim())]
        position = torch.arange(n, device=x.device).view(shape)
        index = torch.where(hit, position, n).amin(dim=dim, keepdim=True)
        if not keepdim:
            value, index = value.squeeze(dim), index.squeeze(dim)
        return value, index

    return run


maps(aten.max.dim)(_max_min_dim(True))
maps(aten.min.dim)(_max_min_dim(False))


def _float(x: torch.Tensor, name: str) -> torch.Tensor:
    """A float32 operand; an integer one converted as torch promotes it (correctly rounded)."""
    return as_f32(x, name) if x.is_floating_point() else x.to(F32)


def _maximum_minimum(largest: bool) -> Any:
    name = "aten.maximum" if largest else "aten.minimum"

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The larger (smaller) of each broadcast pair by float32's total order, so +0 beats -0
        in a maximum and -0 wins a minimum whichever side it is on; NaN where either is NaN:
        selections, no arithmetic."""
        a, b = torch.broadcast_tensors(_float(a, name), _float(b, name))
        first = _keys(a) >= _keys(b) if largest else _keys(a) <= _keys(b)
        out = torch.where(first, a, b)
        return torch.where(torch.isnan(a) | torch.isnan(b), math.nan, out)

    return run


maps(aten.maximum.default)(_maximum_minimum(True))
maps(aten.minimum.default)(_maximum_minimum(False))


# ---- variance and standard deviation ------------------------------------------------------------


def _var_mean(
    x: torch.Tensor, dim: Any, correction: Any, keepdim: bool, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum((x - mean)^2) / (n - correction), mean), mean = tree sum / n: two passes of the
    pairwise tree, each product and quotient one float32 rounding; n - correction below 0
    counts as 0 (then inf or NaN, as torch)."""
    x = as_f32(x, name)
    dims = reduced_dims(x, dim)
    n = _count(x, dims)
    mean = torch.div(sum_dims(x, dims, True), _f32(float(n), x))
    centred = torch.sub(x, mean)
    squares = sum_dims(centred.mul_(centred), dims, keepdim)
    c = 1 if correction is None else correction
    var = torch.div(squares, _f32(float(max(0, n - c)), x))
    return var, (mean if keepdim or not dims else mean.squeeze(dims))


@maps(aten.var.correction)
def _var(x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    return _var_mean(x, dim, correction, keepdim, "aten.var")[0]


@maps(aten.std.correction)
def _std(x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    return ops.sqrt(_var_mean(x, dim, correction, keepdim, "aten.std")[0])


@maps(aten.var_mean.correction)
def _var_and_mean(
    x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return _var_mean(x, dim, correction, keepdim, "aten.var_mean")


@maps(aten.std_mean.correction)
def _std_and_mean(
    x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = _var_mean(x, dim, correction, keepdim, "aten.std_mean")
    return ops.sqrt(var), mean


# ---- vector norms (clip_grad_norm_) --------------------------------------------------------------


def _norm(x: torch.Tensor, order: Any, dims: list[int], keepdim: bool, name: str) -> torch.Tensor:
    """2: correctly rounded sqrt of the tree sum of squares; 1: tree sum of |x|; inf: max |x|
    (exact). Other orders need a library pow and are refused."""
    x = as_f32(x, name)
    order = float(order)
    if order == 2:
        return ops.sqrt(sum_dims(torch.mul(x, x), dims, keepdim))
    if order == 1:
        return sum_dims(torch.abs(x), dims, keepdim)
    if order == math.inf:
        return _extreme(torch.abs(x), dims, keepdim, True)[0] if x.dim() else torch.abs(x)
    raise UnmappedOperator(name, f"ord={order}")


@maps(aten.linalg_vector_norm.default)
def _vector_norm(
    x: torch.Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> torch.Tensor:
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.linalg_vector_norm", f"dtype {dtype}")
    return _norm(x, ord, reduced_dims(x, dim), keepdim, "aten.linalg_vector_norm")


@maps(aten._foreach_norm.Scalar)
def _foreach_norm(
    tensors: Sequence[torch.Tensor], ord: Any = 2, dtype: Any = None
) -> list[torch.Tensor]:
    """Each tensor's norm over all its elements, as ``linalg_vector_norm``."""
    if dtype not in (None, F32):
        raise UnmappedOperator("aten._foreach_norm", f"dtype {dtype}")
    return [_norm(t, ord, list(range(t.dim())), False, "aten._foreach_norm") for t in tensors]


# ---- mean squared error --------------------------------------------------------------------------


@maps(aten.mse_loss.default)
def _mse_loss(x: torch.Tensor, target: torch.Tensor, reduction: int = 1) -> torch.Tensor:
    """(x - target)^2, then none, its tree sum, or that sum / numel (one division)."""
    diff = torch.sub(as_f32(x, "aten.mse_loss"), as_f32(target, "aten.mse_loss"))
    squares = diff.mul_(diff)
    if reduction == 0:
        return squares
    total = sum_dims(squares, list(range(squares.dim())), False)
    return torch.div(total, _f32(float(squares.numel()), x)) if reduction == 1 else total


@maps(aten.mse_loss_backward.default)
def _mse_loss_backward(
    grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, reduction: int
) -> torch.Tensor:
    """((x - target) * norm) * dy, norm = 2 / numel (mean) or 2, rounded to float32 once:
    torch's formula, each product rounded."""
    norm = 2.0 / x.numel() if reduction == 1 else 2.0
    diff = torch.sub(as_f32(x, "aten.mse_loss_backward"), as_f32(target, "aten.mse_loss_backward"))
    return diff.mul_(_f32(norm, x)).mul_(as_f32(grad, "aten.mse_loss_backward"))


# ---- cumulative sum ------------------------------------------------------------------------------


def _scan(x: torch.Tensor, dim: int, op: Any) -> torch.Tensor:
    """out[0] = x[0], out[i] = op(out[i - 1], x[i]) along ``dim``: one IEEE op an element, in
    index order."""
    if x.dim() == 0:
        return x.clone()
    moved = x.movedim(dim, 0)
    out = moved.clone(memory_format=torch.contiguous_format)
    for i in range(1, len(out)):
        op(out[i - 1], moved[i], out=out[i])
    return out.movedim(0, dim)


@maps(aten.cumsum.default)
def _cumsum(x: torch.Tensor, dim: int, *, dtype: Any = None) -> torch.Tensor:
    """out[0] = x[0], out[i] = out[i - 1] + x[i] along ``dim``: sequential, in index order.
    (Integer cumsums never reach here: they are exact and run natively.)"""
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.cumsum", f"dtype {dtype}")
    x = as_f32(x, "aten.cumsum") if x.is_floating_point() else x.to(F32)
    return _scan(x, dim, torch.add)


@maps(aten.cumprod.default)
def _cumprod(x: torch.Tensor, dim: int, *, dtype: Any = None) -> torch.Tensor:
    """out[0] = x[0], out[i] = out[i - 1] * x[i] along ``dim``: sequential, in index order, as
    ``cumsum``. (Integer cumprods are exact and run natively.)"""
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.cumprod", f"dtype {dtype}")
    return _scan(_float(x, "aten.cumprod"), dim, torch.mul)


def _product_tree(flat: torch.Tensor) -> torch.Tensor:
    """The product over the last dim by a fixed pairwise tree: each level multiplies neighbours
    (0 with 1, 2 with 3, ...), an odd last element passes up unchanged; elementwise IEEE
    multiplies only, so no thread split or vector width changes a bit."""
    while flat.shape[-1] > 1:
        n = flat.shape[-1]
        pairs = torch.mul(flat[..., 0 : n - 1 : 2], flat[..., 1:n:2])
        flat = torch.cat([pairs, flat[..., n - 1 :]], -1) if n % 2 else pairs
    return flat[..., 0].clone()


def _prod_dims(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """The product over ``dims`` by ``_product_tree`` over their elements in row-major order
    (an empty product is 1)."""
    if x.dim() == 0:
        return x.clone()
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    flat = moved.reshape(*moved.shape[: len(kept)], -1)
    if flat.shape[-1]:
        out = _product_tree(flat)
    else:
        out = torch.ones(flat.shape[:-1], dtype=x.dtype, device=x.device)
    if keepdim:
        out = out.view([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return out


@maps(aten.prod.default)
def _prod(x: torch.Tensor, *, dtype: Any = None) -> torch.Tensor:
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.prod", f"dtype {dtype}")
    x = _float(x, "aten.prod")
    return _prod_dims(x, list(range(x.dim())), False)


@maps(aten.prod.dim_int)
def _prod_dim(x: torch.Tensor, dim: int, keepdim: bool = False, *, dtype: Any = None) -> Any:
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.prod", f"dtype {dtype}")
    x = _float(x, "aten.prod")
    return _prod_dims(x, reduced_dims(x, dim), keepdim)


@maps(aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar)
def _foreach_mul_(tensors: Sequence[torch.Tensor], scalar: Any) -> None:
    """Each tensor times the scalar (a 0-d tensor or a number, rounded to float32 first) in
    place: one IEEE multiplication, as ``aten.mul_`` (clip_grad_norm_'s scaling)."""
    for tensor in tensors:
        value = as_f32(tensor, "aten._foreach_mul_")
        tensor.copy_(torch.mul(value, operand(scalar, tensor, "aten._foreach_mul_")))
