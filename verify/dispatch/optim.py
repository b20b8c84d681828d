"""``torch.optim.AdamW(fused=True)`` under RepOps: its two aten operators, each one trace record
per tensor it writes.

A fused AdamW step is ``_foreach_add_(state_steps, 1)`` then one ``_fused_adamw_`` over all the
parameters. Both return nothing and write their list arguments in place; the dispatch trace
records each written tensor (``verify.dispatch.calls.results``), so a referee recomputes a
disputed parameter, moment or step count from the operator's inputs.

Why map the fused operator rather than leave the optimizer to the single-tensor path: that path
runs about eight small elementwise operators per parameter (``lerp_``, ``mul_``, ``addcmul_``,
``sqrt``, ``div``, ``add_``, ``addcdiv_``...), each through the mode, and takes its bias
corrections from Python's ``beta ** step`` (C ``pow``, outside any operator, so not fixed across
libms). Here each parameter is one compiled pass (``verify.repops.ops.adamw_``: the
hand-written graph's AdamW definition), and the bias corrections come from the step tensor by
``pow_int``, a fixed sequence of float64 multiplies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from verify.dispatch.registry import UnmappedOperator, as_f32, maps, operand
from verify.repops import ops

aten = torch.ops.aten


@maps(aten._foreach_add_.Scalar)
def _foreach_add_scalar(tensors: Sequence[torch.Tensor], scalar: Any) -> None:
    """Each tensor + the scalar (rounded to float32 first) in place: one IEEE addition, as
    ``aten.add_``; integer tensors exactly."""
    for tensor in tensors:
        if tensor.is_floating_point():
            value = as_f32(tensor, "aten._foreach_add_")
            tensor.copy_(torch.add(value, operand(scalar, tensor, "aten._foreach_add_")))
        else:
            tensor.add_(scalar)


@maps(aten._fused_adamw_.default)
def _fused_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``verify.repops.ops.adamw_`` on each parameter, its step count read from its (already
    incremented) step tensor; ``maximize`` negates the gradient (exact)."""
    name = "aten._fused_adamw_.default"
    if amsgrad or max_exp_avg_sqs:
        raise UnmappedOperator(name, "amsgrad")
    if grad_scale is not None or found_inf is not None:
        raise UnmappedOperator(name, "grad_scale / found_inf (AMP)")
    lists = (params, grads, exp_avgs, exp_avg_sqs, state_steps)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"{name}: the tensor lists differ in length")
    attrs = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    for p, g, m, v, step in zip(*lists, strict=True):
        p, g, m, v = (as_f32(t, name) for t in (p, g, m, v))
        if not p.shape == g.shape == m.shape == v.shape:
            raise ValueError(f"{name}: a parameter, its gradient and moments differ in shape")
        ops.adamw_(p, torch.neg(g) if maximize else g, m, v, _count(step), attrs)


def _count(step: torch.Tensor) -> int:
    """A step tensor's count (a float32 or integer 0-d tensor; a fraction truncated, so that the
    operator is defined on whatever a tampered trace holds)."""
    value = float(step)
    return int(value) if abs(value) < 2**62 else 0
