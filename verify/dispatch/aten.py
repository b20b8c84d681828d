"""The aten operators RepOps runs, each defined as a fixed sequence of reproducible kernels.

Three kinds of operator reach ``RepOpsMode`` (``verify.dispatch.mode``):

* ``HANDLERS``: every floating-point operator whose result depends on an order or a library:
  matmuls (exact float64 GEMM on grids, ``verify.repops.ops.matmul``), reductions (the pairwise
  ``sum_tree``), softmax, log-softmax, LayerNorm, cross-entropy, embedding backward, and the
  transcendental functions (RepOps' own ``exp``, ``erf``, ``log``, ``tanh``, ``sin``/``cos``,
  a correctly rounded ``sqrt``). Elementwise ``+ - * /`` are IEEE-correctly rounded on every
  library, so their handlers only fix what torch would otherwise choose: a Python scalar is
  rounded to float32 first, ``alpha`` / ``value`` multiplies are separate roundings (torch's
  kernels fuse them into an FMA in the vector body but not in the scalar tail), and compound
  operators (``lerp``, ``addcmul``, ``addcdiv``) are split into single IEEE operations.
* ``EXACT``: operators that move, select, compare or convert values without arithmetic that
  could round differently (views, copies, concatenation, indexing, ``where``, ``neg``).
* integer and boolean arithmetic, which is exact: any operator with no floating-point tensor
  among its inputs and outputs.

Everything else is refused (``UnmappedOperator``), never run natively. Float tensors must be
float32; a 0-d tensor or a Python number is a scalar and is rounded to float32 first. Each
handler has a numpy twin in ``verify.dispatch.reference``; the tests compare the two bit for bit.
The elementwise mappings live in ``verify.dispatch.elementwise``, maxima, variance, norms
(gradient clipping), MSE and cumsum in ``verify.dispatch.reductions`` (both imported here, so
that ``HANDLERS`` is complete whenever this module is), the matmuls, sums, softmax, loss,
LayerNorm and embedding ones here, the shared rules in ``verify.dispatch.registry``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

# Imported for what importing them does: they register the elementwise and fused AdamW mappings.
from verify.dispatch import elementwise, optim  # noqa: F401
from verify.dispatch.reductions import reduced_dims as _dims
from verify.dispatch.reductions import sum_dims
from verify.dispatch.registry import (
    F32,
    HANDLERS,
    UnmappedOperator,
    as_f32,
    maps,
    scaled,
)
from verify.repops import native as repops_native
from verify.repops import ops

aten = torch.ops.aten

__all__ = ["EXACT", "HANDLERS", "UnmappedOperator", "sum_dims"]


# ---- matmuls: exact on float64 grids, one rounding --------------------------------------------


@maps(aten.mm.default, aten.bmm.default)
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ops.matmul(as_f32(a, "aten.mm"), as_f32(b, "aten.mm"))


@maps(aten.addmm.default)
def _addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    """alpha (a @ b) + beta bias: the exact product rounded once, then each scale and the sum."""
    a, b, bias = (as_f32(t, "aten.addmm") for t in (a, b, bias))
    if alpha == 1 and beta == 1:
        return ops.matmul(a, b, bias=bias)  # the bias added in the rounding pass: same bits
    return torch.add(scaled(ops.matmul(a, b), alpha), scaled(bias, beta))


@maps(aten.baddbmm.default)
def _baddbmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    """alpha (a @ b) + beta bias per batch, as ``addmm``; beta 0 ignores ``bias`` (a NaN in it
    too), as torch does."""
    a, b, bias = (as_f32(t, "aten.baddbmm") for t in (a, b, bias))
    product = scaled(ops.matmul(a, b), alpha)
    if not isinstance(beta, torch.Tensor) and beta == 0:
        return product
    return torch.add(product, scaled(bias, beta))


# ---- reductions: the fixed pairwise tree (more in ``verify.dispatch.reductions``) -------------


@maps(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> torch.Tensor:
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.sum", f"dtype {dtype}")
    x = as_f32(x, "aten.sum")
    return sum_dims(x, _dims(x, dim), keepdim)


@maps(aten.mean.dim, aten.mean.default)
def _mean(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> torch.Tensor:
    """The tree sum divided by the number of terms (one float32 division)."""
    total = _sum(x, dim, keepdim, dtype=dtype)
    count = math.prod(x.shape[d] for d in _dims(x, dim)) if x.dim() else 1
    return torch.div(total, torch.tensor(float(count), dtype=F32, device=x.device))


# ---- softmax family ---------------------------------------------------------------------------


def _last(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """``x`` with ``dim`` moved last, contiguous, and the dim to move it back from."""
    dim %= max(1, x.dim())
    return x.movedim(dim, -1).contiguous(), dim


def _softmax_last(x: torch.Tensor) -> torch.Tensor:
    fused = repops_native.softmax_rows(x, ops.NATIVE_CONSTANTS)
    if fused is not None:
        return fused
    return ops.rowwise(ops.softmax_rows, x.view(-1, x.shape[-1])).view(x.shape)


@maps(aten._softmax.default)
def _softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    last, dim = _last(as_f32(x, "aten._softmax"), dim)
    return _softmax_last(last).movedim(-1, dim)


@maps(aten._safe_softmax.default)
def _safe_softmax(x: torch.Tensor, dim: int, dtype: Any = None) -> torch.Tensor:
    """Softmax whose fully masked rows (all -inf) are 0 instead of NaN."""
    last, dim = _last(as_f32(x, "aten._safe_softmax"), dim)
    fused = repops_native.softmax_rows(last, ops.NATIVE_CONSTANTS, safe=True)
    if fused is None:
        masked = (last == -math.inf).all(dim=-1, keepdim=True)
        fused = _softmax_last(last).masked_fill_(masked, 0.0)
    return fused.movedim(-1, dim)


@maps(aten._softmax_backward_data.default)
def _softmax_backward(
    grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: Any = None
) -> torch.Tensor:
    """y (dy - sum(dy y)): the attention-scores gradient kernel with scale 1 (x * 1 == x)."""
    dy, dim = _last(grad, dim)
    y, _ = _last(out, dim)
    fused = repops_native.scores_grad_rows(dy, y, 1.0)
    if fused is None:
        rows = ops.rowwise(
            lambda d, p: ops._scores_grad_rows(d, p, 1.0),
            dy.view(-1, dy.shape[-1]),
            y.view(-1, y.shape[-1]),
        )
        fused = rows.view(dy.shape)
    return fused.movedim(-1, dim)


@maps(aten._log_softmax.default)
def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    """(x - max) - log(sum(exp(x - max))), the max made +0 rather than -0."""
    last, dim = _last(as_f32(x, "aten._log_softmax"), dim)
    shifted = torch.sub(last, last.amax(dim=-1, keepdim=True).add_(0.0))
    total = ops.sum_tree(ops.exp(shifted), -1)
    return shifted.sub_(ops.log_pos(total).unsqueeze(-1)).movedim(-1, dim)


@maps(aten._log_softmax_backward_data.default)
def _log_softmax_backward(
    grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: Any = None
) -> torch.Tensor:
    """dy - exp(y) sum(dy)."""
    dy, dim = _last(grad, dim)
    y, _ = _last(out, dim)
    total = ops.sum_tree(dy, -1).unsqueeze(-1)
    return torch.sub(dy, ops.exp(y).mul_(total)).movedim(-1, dim)


# ---- loss -------------------------------------------------------------------------------------

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _nll_plain(weight: torch.Tensor | None, name: str) -> None:
    if weight is not None:
        raise UnmappedOperator(name, "class weights")


@maps(aten.nll_loss_forward.default)
def _nll_loss(
    x: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-sum of the picked log-probabilities [/ count], count): rows whose target is
    ``ignore_index`` pick 0; the sum is the pairwise tree over rows."""
    _nll_plain(weight, "aten.nll_loss_forward.default")
    x = as_f32(x, "aten.nll_loss_forward")
    rows, tgt = x.reshape(-1, x.shape[-1]), target.reshape(-1, 1)
    kept = tgt != ignore_index
    picked = rows.gather(1, torch.where(kept, tgt, 0)).neg_().masked_fill_(~kept, 0.0)[:, 0]
    count = kept.sum().to(F32)
    if reduction == 0:
        return picked.view(target.shape), torch.zeros((), dtype=F32, device=x.device)
    total = ops.sum_tree(picked, 0) if len(picked) else torch.zeros((), dtype=F32, device=x.device)
    return (torch.div(total, count) if reduction == 1 else total), count


@maps(aten.nll_loss_backward.default)
def _nll_loss_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    weight: Any,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """-dy [/ count] at each row's target, 0 elsewhere and on ignored rows."""
    _nll_plain(weight, "aten.nll_loss_backward.default")
    rows, tgt = x.reshape(-1, x.shape[-1]), target.reshape(-1, 1)
    kept = tgt != ignore_index
    g = torch.neg(as_f32(grad, "aten.nll_loss_backward"))
    if reduction == 1:
        g = torch.div(g, total_weight)
    g = g.reshape(-1, 1).expand(len(rows), 1) if g.dim() else g.expand(len(rows), 1)
    out = torch.zeros_like(rows)
    out.scatter_(1, torch.where(kept, tgt, 0), torch.where(kept, g, 0.0))
    return out.view(x.shape)


# ---- LayerNorm --------------------------------------------------------------------------------


def _rows(x: torch.Tensor, normalized: Sequence[int]) -> torch.Tensor:
    width = math.prod(normalized)
    return x.reshape(-1, width).contiguous()


def _affine(weight: torch.Tensor | None, fill: float, width: int, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm weight (or bias) flattened; a missing one is 1 (or 0), which changes no bit
    beyond a -0 made +0 by adding the zero bias."""
    if weight is None:
        return torch.full((width,), fill, dtype=F32, device=x.device)
    return as_f32(weight, "aten.native_layer_norm").reshape(width)


@maps(aten.native_layer_norm.default)
def _layer_norm(
    x: torch.Tensor, normalized: Sequence[int], weight: Any, bias: Any, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) by RepOps' LayerNorm kernels; mean and rstd shaped as torch's."""
    rows = _rows(as_f32(x, "aten.native_layer_norm"), normalized)
    width = rows.shape[1]
    stats = ops.OPS["layernorm_stats"]([rows], {"eps": eps})
    g, b = _affine(weight, 1.0, width, x), _affine(bias, 0.0, width, x)
    y = ops.OPS["layernorm"]([rows, stats, g, b], {}).view(x.shape)
    stat_shape = [*x.shape[: x.dim() - len(normalized)], *([1] * len(normalized))]
    return y, stats[:, 0].reshape(stat_shape), stats[:, 1].reshape(stat_shape)


@maps(aten.native_layer_norm_backward.default)
def _layer_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    normalized: Sequence[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: Any,
    bias: Any,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    rows = _rows(as_f32(x, "aten.native_layer_norm_backward"), normalized)
    dy = _rows(grad, normalized)
    width = rows.shape[1]
    stats = torch.stack((mean.reshape(-1), rstd.reshape(-1)), dim=-1)
    g = _affine(weight, 1.0, width, x)
    dx = ops.OPS["layernorm_backward"]([rows, stats, g, dy], {}).view(x.shape)
    shape = list(normalized)
    dw = ops.OPS["layernorm_grad_weight"]([rows, stats, dy], {}).view(shape)
    db = ops.sum_tree(dy, 0).view(shape)
    return (
        dx if output_mask[0] else None,
        dw if output_mask[1] and weight is not None else None,
        db if output_mask[2] and bias is not None else None,
    )


# ---- embedding --------------------------------------------------------------------------------


@maps(aten.embedding_dense_backward.default)
def _embedding_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """onehot(indices)^T @ dy through the exact matmul: each row the sum of its tokens' grads
    (in any order: the sum is exact before its one rounding); the padding row is 0."""
    if scale_grad_by_freq:
        raise UnmappedOperator("aten.embedding_dense_backward.default", "scale_grad_by_freq")
    dy = as_f32(grad, "aten.embedding_dense_backward").reshape(-1, grad.shape[-1])
    if len(dy) == 1:  # one token: the kernel's grids would need 52 bits; its exact sum is dy
        out = torch.zeros(num_weights, dy.shape[1], dtype=F32, device=dy.device)
        out[indices.reshape(-1)[0]] = torch.add(dy[0], 0.0)  # + 0: as the matmul's -0 -> +0
    else:
        out = ops.OPS["embedding_backward"]([indices.reshape(1, -1), dy], {"vocab": num_weights})
    if padding_idx >= 0:
        out[padding_idx] = 0.0
    return out


@maps(aten.scatter.src, aten.scatter.value)
def _scatter(x: torch.Tensor, dim: int, index: torch.Tensor, src: Any) -> torch.Tensor:
    """``x`` with ``src`` placed at ``index`` along ``dim`` (no arithmetic: what ``max.dim``'s
    backward does); an index repeated along ``dim`` is refused, since which write wins would be
    torch's choice."""
    if index.numel() and index.dim():
        ordered = index.sort(dim=dim).values
        if bool((ordered.diff(dim=dim) == 0).any()):
            raise UnmappedOperator("aten.scatter", "an index repeated along the dim")
    return torch.scatter(x, dim, index, src)


# ---- operators that are exact natively ---------------------------------------------------------

EXACT: frozenset[torch._ops.OpOverloadPacket] = frozenset(
    {
        # views and metadata
        aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.t, aten.t_,
        aten.transpose, aten.transpose_, aten.permute, aten.expand, aten.slice, aten.select,
        aten.unsqueeze, aten.unsqueeze_, aten.squeeze, aten.squeeze_, aten.split,
        aten.split_with_sizes, aten.unbind, aten.as_strided, aten.alias, aten.detach,
        aten.detach_, aten.lift_fresh, aten.movedim, aten.unfold,
        # copies, conversions (correctly rounded casts) and fills
        aten.clone, aten._to_copy, aten.copy_, aten.contiguous, aten._local_scalar_dense,
        aten.empty, aten.empty_like, aten.empty_strided, aten.zeros, aten.zeros_like, aten.ones,
        aten.ones_like, aten.full, aten.full_like, aten.new_zeros, aten.new_ones, aten.new_empty,
        aten.new_empty_strided, aten.new_full, aten.scalar_tensor, aten.fill_, aten.zero_,
        aten.fill,
        # moving and selecting values
        aten.cat, aten.stack, aten.embedding, aten.index_select, aten.index, aten.gather,
        aten.where, aten.masked_fill, aten.masked_fill_, aten.tril, aten.triu,
        aten.tril_, aten.triu_, aten.flip, aten.roll, aten.repeat, aten.repeat_interleave,
        aten.slice_backward, aten.select_backward, aten.slice_scatter, aten.select_scatter,
        aten.neg, aten.abs, aten.threshold_backward,
        # comparisons and logic
        aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_not,
        aten.logical_and, aten.logical_or, aten.all, aten.any, aten.isnan, aten.isinf,
    }
)  # fmt: skip


@maps(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Integer-valued ranges only: then every float element is an exact product."""
    if not all(isinstance(a, int) for a in args):
        raise UnmappedOperator("aten.arange", f"non-integer bounds or step {args}")
    return torch.arange(*args, **kwargs)
