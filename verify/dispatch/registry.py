"""The registry of RepOps' aten mappings and what every mapping shares: ``HANDLERS`` (overload ->
its reproducible definition), the ``maps`` decorator, ``UnmappedOperator``, and the float32 rules
(a float tensor must be float32; a Python number or a 0-d float tensor is a scalar, rounded to
float32 first; a scale factor is its own rounding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

F32 = torch.float32
Handler = Callable[..., Any]


class UnmappedOperator(RuntimeError):
    """An operator RepOps has no reproducible mapping for; the message names it."""

    def __init__(self, name: str, detail: str = "") -> None:
        why = f" ({detail})" if detail else ""
        super().__init__(f"{name} has no RepOps mapping{why}: a verified run cannot use it")
        self.name = name


HANDLERS: dict[torch._ops.OpOverload, Handler] = {}


def maps(*overloads: torch._ops.OpOverload) -> Callable[[Handler], Handler]:
    """Register the decorated function as the definition of ``overloads``."""

    def register(fn: Handler) -> Handler:
        for overload in overloads:
            HANDLERS[overload] = fn
        return fn

    return register


def inplace(fn: Handler) -> Handler:
    """The in-place variant of ``fn``: the same result, copied into ``self`` (copies are exact)."""

    def run(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.copy_(fn(self, *args, **kwargs))

    return run


def as_f32(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` if it is float32 (or not floating point); a float32 copy of a 0-d float tensor."""
    if x.is_floating_point() and x.dtype != F32:
        if x.dim() != 0:
            raise UnmappedOperator(name, f"{x.dtype} tensor; RepOps maps float32")
        return x.to(F32)
    return x


def operand(x: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor operand as float32 (see ``as_f32``), or a Python number as a 0-d float32 tensor
    on ``like``'s device (a device tensor: CUDA turns division by a CPU scalar into a
    multiplication by its reciprocal)."""
    if isinstance(x, torch.Tensor):
        return as_f32(x, name)
    return torch.tensor(float(x), dtype=F32, device=like.device)


def scaled(x: torch.Tensor, factor: Any) -> torch.Tensor:
    """``x * factor`` as one float32 rounding, skipped when the factor is 1 (x * 1 == x)."""
    if not isinstance(factor, torch.Tensor) and factor == 1:
        return x
    return torch.mul(x, operand(factor, x, "scale"))


def one(x: torch.Tensor) -> torch.Tensor:
    """A 0-d 1 of ``x``'s dtype on its device (a numerator: see ``operand``)."""
    return torch.ones((), dtype=x.dtype, device=x.device)
