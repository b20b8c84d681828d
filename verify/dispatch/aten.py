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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from verify.repops import native as repops_native
from verify.repops import ops

F32 = torch.float32
aten = torch.ops.aten
Handler = Callable[..., Any]


class UnmappedOperator(RuntimeError):
    """An operator RepOps has no reproducible mapping for; the message names it."""

    def __init__(self, name: str, detail: str = "") -> None:
        why = f" ({detail})" if detail else ""
        super().__init__(f"{name} has no RepOps mapping{why}: a verified run cannot use it")
        self.name = name


HANDLERS: dict[torch._ops.OpOverload, Handler] = {}


def _maps(*overloads: torch._ops.OpOverload) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for overload in overloads:
            HANDLERS[overload] = fn
        return fn

    return register


def _inplace(fn: Handler) -> Handler:
    """The in-place variant of ``fn``: the same result, copied into ``self`` (copies are exact)."""

    def run(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.copy_(fn(self, *args, **kwargs))

    return run


def _f32(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` if it is float32 (or not floating point); a float32 copy of a 0-d float tensor."""
    if x.is_floating_point() and x.dtype != F32:
        if x.dim() != 0:
            raise UnmappedOperator(name, f"{x.dtype} tensor; RepOps maps float32")
        return x.to(F32)
    return x


def _operand(x: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor operand as float32 (see ``_f32``), or a Python number as a 0-d float32 tensor
    on ``like``'s device (a device tensor: CUDA turns division by a CPU scalar into a
    multiplication by its reciprocal)."""
    if isinstance(x, torch.Tensor):
        return _f32(x, name)
    return torch.tensor(float(x), dtype=F32, device=like.device)


def _scaled(x: torch.Tensor, factor: Any) -> torch.Tensor:
    """``x * factor`` as one float32 rounding, skipped when the factor is 1 (x * 1 == x)."""
    if not isinstance(factor, torch.Tensor) and factor == 1:
        return x
    return torch.mul(x, _operand(factor, x, "scale"))


# ---- elementwise arithmetic: IEEE, one rounding per operation ---------------------------------


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str) -> Handler:
    def run(self: Any, other: Any, alpha: Any = 1) -> torch.Tensor:
        like = self if isinstance(self, torch.Tensor) else other
        a, b = _operand(self, like, name), _operand(other, like, name)
        return fn(a, _scaled(b, alpha))

    return run


_add = _maps(aten.add.Tensor, aten.add.Scalar)(_binary(torch.add, "aten.add"))
_sub = _maps(aten.sub.Tensor, aten.sub.Scalar)(_binary(torch.sub, "aten.sub"))
_maps(aten.add_.Tensor, aten.add_.Scalar)(_inplace(_add))
_maps(aten.sub_.Tensor, aten.sub_.Scalar)(_inplace(_sub))


@_maps(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(self: torch.Tensor, other: Any, alpha: Any = 1) -> torch.Tensor:
    return _sub(_operand(other, self, "aten.rsub"), self, alpha)  # other - alpha self


def _mul(self: Any, other: Any) -> torch.Tensor:
    like = self if isinstance(self, torch.Tensor) else other
    return torch.mul(_operand(self, like, "aten.mul"), _operand(other, like, "aten.mul"))


def _div(self: Any, other: Any, rounding_mode: str | None = None) -> torch.Tensor:
    if rounding_mode is not None and (self.is_floating_point() or isinstance(other, float)):
        raise UnmappedOperator("aten.div", f"rounding_mode={rounding_mode!r} on floats")
    return torch.div(_operand(self, self, "aten.div"), _operand(other, self, "aten.div"))


_maps(aten.mul.Tensor, aten.mul.Scalar)(_mul)
_maps(aten.mul_.Tensor, aten.mul_.Scalar)(_inplace(_mul))
_maps(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)(_div)
_maps(aten.div_.Tensor, aten.div_.Scalar)(_inplace(_div))


@_maps(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(self: torch.Tensor, end: torch.Tensor, weight: Any) -> torch.Tensor:
    """self + w (end - self) for |w| < 0.5, else end - (end - self)(1 - w): torch's formula,
    each operation rounded on its own (torch's vector body fuses them)."""
    start, end = _f32(self, "aten.lerp"), _f32(end, "aten.lerp")
    w = _operand(weight, start, "aten.lerp")
    diff = torch.sub(end, start)
    low = torch.add(start, torch.mul(w, diff))
    high = torch.sub(end, torch.mul(diff, torch.sub(torch.ones_like(w), w)))
    return torch.where(w.abs() < 0.5, low, high)


@_maps(aten.addcmul.default)
def _addcmul(
    self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any = 1
) -> torch.Tensor:
    """self + value (t1 t2): the product, then the scale, then the sum, each rounded."""
    product = torch.mul(_f32(t1, "aten.addcmul"), _f32(t2, "aten.addcmul"))
    return torch.add(_f32(self, "aten.addcmul"), _scaled(product, value))


@_maps(aten.addcdiv.default)
def _addcdiv(
    self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any = 1
) -> torch.Tensor:
    """self + value (t1 / t2): the quotient, then the scale, then the sum, each rounded."""
    quotient = torch.div(_f32(t1, "aten.addcdiv"), _f32(t2, "aten.addcdiv"))
    return torch.add(_f32(self, "aten.addcdiv"), _scaled(quotient, value))


_maps(aten.lerp_.Scalar, aten.lerp_.Tensor)(_inplace(_lerp))
_maps(aten.addcmul_.default)(_inplace(_addcmul))
_maps(aten.addcdiv_.default)(_inplace(_addcdiv))


# ---- elementwise functions: RepOps' own polynomials --------------------------------------------


def _unary(fn: Callable[[torch.Tensor], torch.Tensor], name: str) -> Handler:
    # An integer tensor is converted as torch would (to float32, each value correctly rounded).
    return lambda x: fn(_f32(x, name) if x.is_floating_point() else x.to(F32))


def _one(x: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=x.dtype, device=x.device)


def _rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.div(_one(x), ops.sqrt(x))  # two roundings: the correctly rounded sqrt, 1 / it


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.div(_one(x), ops.exp(torch.neg(x)).add_(1.0))  # 1 / (1 + exp(-x))


HANDLERS.update(
    {
        aten.sqrt.default: _unary(ops.sqrt, "aten.sqrt"),
        aten.rsqrt.default: _unary(_rsqrt, "aten.rsqrt"),
        aten.exp.default: _unary(ops.exp, "aten.exp"),
        aten.tanh.default: _unary(ops.tanh, "aten.tanh"),
        aten.sin.default: _unary(lambda x: ops.sin_cos(x)[0], "aten.sin"),
        aten.cos.default: _unary(lambda x: ops.sin_cos(x)[1], "aten.cos"),
        aten.sigmoid.default: _unary(_sigmoid, "aten.sigmoid"),
    }
)


@_maps(aten.relu.default)
def _relu(x: torch.Tensor) -> torch.Tensor:
    """x where x > 0, else +0: a selection (torch's max(x, 0) may keep a -0 in its vector body
    and not in its scalar tail)."""
    x = _f32(x, "aten.relu")
    return torch.where(x > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


@_maps(aten.tanh_backward.default)
def _tanh_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mul(grad, torch.sub(_one(y), torch.mul(y, y)))  # dy (1 - y^2)


@_maps(aten.sigmoid_backward.default)
def _sigmoid_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mul(grad, torch.sub(_one(y), y).mul_(y))  # dy ((1 - y) y)


@_maps(aten.silu.default)
def _silu(x: torch.Tensor) -> torch.Tensor:
    x = _f32(x, "aten.silu")
    return torch.div(x, ops.exp(torch.neg(x)).add_(1.0))  # x / (1 + exp(-x))


@_maps(aten.silu_backward.default)
def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy s (1 + x (1 - s)), s = sigmoid(x)."""
    s = _sigmoid(_f32(x, "aten.silu_backward"))
    inner = torch.sub(_one(s), s).mul_(x).add_(1.0)
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


@_maps(aten.gelu.default)
def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x Phi(x) with RepOps' erf; or (x / 2)(1 + tanh(beta (x + kappa x^3)))."""
    x = _f32(x, "aten.gelu")
    if _gelu_kind("aten.gelu.default", approximate):
        return torch.mul(x, 0.5).mul_(_gelu_tanh_inner(x)[1].add_(1.0))
    return torch.mul(x, ops.OPS["gelu_cdf"]([x.contiguous()], {}))


@_maps(aten.gelu_backward.default)
def _gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """dy (Phi(x) + x phi(x)); for tanh, torch's formula: dy ((1 + t) / 2
    + (x / 2)(1 - t^2) beta (1 + 3 kappa x^2)), t the forward's tanh."""
    x = _f32(x, "aten.gelu_backward").contiguous()
    if _gelu_kind("aten.gelu_backward.default", approximate):
        x2, t = _gelu_tanh_inner(x)
        left = torch.add(t, 1.0).mul_(0.5)
        slope = x2.mul_(3.0 * GELU_KAPPA).add_(1.0)
        right = torch.mul(x, 0.5).mul_(torch.sub(_one(t), torch.mul(t, t))).mul_(GELU_BETA)
        return torch.mul(grad, left.add_(right.mul_(slope)))
    cdf = ops.OPS["gelu_cdf"]([x], {})
    return ops.OPS["gelu_backward"]([x, cdf, grad.contiguous()], {})


@_maps(aten.pow.Tensor_Scalar)
def _pow(x: torch.Tensor, exponent: Any) -> torch.Tensor:
    """Small integer powers as left-to-right products; 0.5 and -0.5 through the correctly
    rounded sqrt. Other exponents need a library pow (not reproducible) and are refused."""
    x = _f32(x, "aten.pow")
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
    return torch.div(_one(x), out) if e < 0 else out


# ---- matmuls: exact on float64 grids, one rounding --------------------------------------------


@_maps(aten.mm.default, aten.bmm.default)
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ops.matmul(_f32(a, "aten.mm"), _f32(b, "aten.mm"))


@_maps(aten.addmm.default)
def _addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    """alpha (a @ b) + beta bias: the exact product rounded once, then each scale and the sum."""
    a, b, bias = (_f32(t, "aten.addmm") for t in (a, b, bias))
    if alpha == 1 and beta == 1:
        return ops.matmul(a, b, bias=bias)  # the bias added in the rounding pass: same bits
    return torch.add(_scaled(ops.matmul(a, b), alpha), _scaled(bias, beta))


# ---- reductions: the fixed pairwise tree ------------------------------------------------------


def _dims(x: torch.Tensor, dim: Sequence[int] | int | None) -> list[int]:
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


@_maps(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> torch.Tensor:
    if dtype not in (None, F32):
        raise UnmappedOperator("aten.sum", f"dtype {dtype}")
    x = _f32(x, "aten.sum")
    return sum_dims(x, _dims(x, dim), keepdim)


@_maps(aten.mean.dim, aten.mean.default)
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


@_maps(aten._softmax.default)
def _softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    last, dim = _last(_f32(x, "aten._softmax"), dim)
    return _softmax_last(last).movedim(-1, dim)


@_maps(aten._safe_softmax.default)
def _safe_softmax(x: torch.Tensor, dim: int, dtype: Any = None) -> torch.Tensor:
    """Softmax whose fully masked rows (all -inf) are 0 instead of NaN."""
    last, dim = _last(_f32(x, "aten._safe_softmax"), dim)
    masked = (last == -math.inf).all(dim=-1, keepdim=True)
    out = _softmax_last(last).masked_fill_(masked, 0.0)
    return out.movedim(-1, dim)


@_maps(aten._softmax_backward_data.default)
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


@_maps(aten._log_softmax.default)
def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    """(x - max) - log(sum(exp(x - max))), the max made +0 rather than -0."""
    last, dim = _last(_f32(x, "aten._log_softmax"), dim)
    shifted = torch.sub(last, last.amax(dim=-1, keepdim=True).add_(0.0))
    total = ops.sum_tree(ops.exp(shifted), -1)
    return shifted.sub_(ops.log_pos(total).unsqueeze(-1)).movedim(-1, dim)


@_maps(aten._log_softmax_backward_data.default)
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


@_maps(aten.nll_loss_forward.default)
def _nll_loss(
    x: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-sum of the picked log-probabilities [/ count], count): rows whose target is
    ``ignore_index`` pick 0; the sum is the pairwise tree over rows."""
    _nll_plain(weight, "aten.nll_loss_forward.default")
    x = _f32(x, "aten.nll_loss_forward")
    rows, tgt = x.reshape(-1, x.shape[-1]), target.reshape(-1, 1)
    kept = tgt != ignore_index
    picked = rows.gather(1, torch.where(kept, tgt, 0)).neg_().masked_fill_(~kept, 0.0)[:, 0]
    count = kept.sum().to(F32)
    if reduction == 0:
        return picked.view(target.shape), torch.zeros((), dtype=F32, device=x.device)
    total = ops.sum_tree(picked, 0) if len(picked) else torch.zeros((), dtype=F32, device=x.device)
    return (torch.div(total, count) if reduction == 1 else total), count


@_maps(aten.nll_loss_backward.default)
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
    g = torch.neg(_f32(grad, "aten.nll_loss_backward"))
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
    return _f32(weight, "aten.native_layer_norm").reshape(width)


@_maps(aten.native_layer_norm.default)
def _layer_norm(
    x: torch.Tensor, normalized: Sequence[int], weight: Any, bias: Any, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) by RepOps' LayerNorm kernels; mean and rstd shaped as torch's."""
    rows = _rows(_f32(x, "aten.native_layer_norm"), normalized)
    width = rows.shape[1]
    stats = ops.OPS["layernorm_stats"]([rows], {"eps": eps})
    g, b = _affine(weight, 1.0, width, x), _affine(bias, 0.0, width, x)
    y = ops.OPS["layernorm"]([rows, stats, g, b], {}).view(x.shape)
    stat_shape = [*x.shape[: x.dim() - len(normalized)], *([1] * len(normalized))]
    return y, stats[:, 0].reshape(stat_shape), stats[:, 1].reshape(stat_shape)


@_maps(aten.native_layer_norm_backward.default)
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
    rows = _rows(_f32(x, "aten.native_layer_norm_backward"), normalized)
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


@_maps(aten.embedding_dense_backward.default)
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
    dy = _f32(grad, "aten.embedding_dense_backward").reshape(-1, grad.shape[-1])
    if len(dy) == 1:  # one token: the kernel's grids would need 52 bits; its exact sum is dy
        out = torch.zeros(num_weights, dy.shape[1], dtype=F32, device=dy.device)
        out[indices.reshape(-1)[0]] = torch.add(dy[0], 0.0)  # + 0: as the matmul's -0 -> +0
    else:
        out = ops.OPS["embedding_backward"]([indices.reshape(1, -1), dy], {"vocab": num_weights})
    if padding_idx >= 0:
        out[padding_idx] = 0.0
    return out


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


@_maps(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Integer-valued ranges only: then every float element is an exact product."""
    if not all(isinstance(a, int) for a in args):
        raise UnmappedOperator("aten.arange", f"non-integer bounds or step {args}")
    return torch.arange(*args, **kwargs)
