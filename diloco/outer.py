"""The outer optimizer: Nesterov SGD on the averaged pseudo-gradient, bit-identical on every peer.

Why explicit tensor ops instead of ``torch.optim.SGD``: a fused kernel may contract ``a * b + c``
into one fused multiply-add on one CPU and not on another (or in a vector body but not in its scalar
tail), and then peers' global parameters drift apart in the last bit. Here every step is a separate
elementwise float32 ``mul``, ``add`` or ``sub``; IEEE 754 rounds each of those exactly, so the same
inputs give the same bits on any machine, any thread count and any memory alignment.

The update, with pseudo-gradient ``g`` (the weighted mean over peers of global minus local params),
momentum ``mu`` and learning rate ``lr``, matches ``torch.optim.SGD(nesterov=True, dampening=0)``::

    m <- mu * m + g
    p <- p - lr * (g + mu * m)

Momentum warm-up (``OuterConfig.momentum_warmup`` = W rounds): the momentum used in round r is
``momentum * min(r, W) / W``, so the first round is plain averaging (mu 0) and mu reaches its
value at round W. Why: with the 10-20 rounds a bench-sized run has, a momentum of 0.9 is still
carrying the early, large pseudo-gradients when the run ends, and it overshoots; the ramp keeps
the early rounds close to model averaging. mu is a pure function of the round number (computed in
float64, then pinned to float32 once), so every peer uses the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.state import GlobalState


@dataclass(frozen=True)
class OuterConfig:
    """Outer Nesterov SGD settings (OpenDiLoCo's defaults)."""

    lr: float = 0.7
    momentum: float = 0.9
    momentum_warmup: int = 0  # rounds over which mu ramps linearly from 0; 0: constant mu

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1 or self.momentum_warmup < 0:
            raise ValueError("OuterConfig needs lr > 0, 0 <= momentum < 1, momentum_warmup >= 0")

    def momentum_at(self, round: int) -> float:
        """The momentum for the outer step that completes ``round`` (0-based)."""
        if self.momentum_warmup == 0 or round >= self.momentum_warmup:
            return self.momentum
        return self.momentum * max(round, 0) / self.momentum_warmup


def _f32(value: float) -> torch.Tensor:
    # A 0-d float32 tensor pins the scalar to float32 before the multiply, so the product is one
    # float32 multiply however torch chooses to treat Python scalars.
    return torch.tensor(value, dtype=torch.float32)


# Elements per slice of the in-place update: its temporaries are this size, not the model's.
CHUNK = 1 << 20


def nesterov_update_(
    params: torch.Tensor,
    momentum: torch.Tensor,
    pseudo_gradient: torch.Tensor,
    lr: float,
    mu: float,
) -> None:
    """Apply the update to ``params`` and ``momentum`` in place, ``CHUNK`` elements at a time,
    so a 100M-parameter model needs two 4 MB temporaries instead of four 400 MB ones. Each
    element goes through the same float32 operations as ``nesterov_update``: the same bits.

    All three tensors must be flat float32 of one length (ValueError otherwise)."""
    for tensor in (params, momentum, pseudo_gradient):
        if tensor.dtype != torch.float32 or tensor.shape != params.shape or tensor.dim() != 1:
            raise ValueError("nesterov_update needs flat float32 tensors of one shape")
    lr_, mu_ = _f32(lr), _f32(mu)
    for start in range(0, params.numel(), CHUNK):
        p, m = params[start : start + CHUNK], momentum[start : start + CHUNK]
        g = pseudo_gradient[start : start + CHUNK]
        m.mul_(mu_).add_(g)
        direction = torch.add(g, torch.mul(m, mu_))
        p.sub_(direction.mul_(lr_))


def nesterov_update(
    params: torch.Tensor,
    momentum: torch.Tensor,
    pseudo_gradient: torch.Tensor,
    lr: float,
    mu: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return new ``(params, momentum)``; the inputs are not modified.

    All three tensors must be float32 of one shape (ValueError otherwise). The update is
    ``nesterov_update_`` on copies; its lines are each one correctly rounded float32 operation
    (do not merge them into ``addcmul``/``alpha=`` forms)."""
    for tensor in (params, momentum, pseudo_gradient):
        if tensor.dtype != torch.float32 or tensor.shape != params.shape:
            raise ValueError("nesterov_update needs float32 tensors of one shape")
    new_params, new_momentum = params.clone(), momentum.clone()
    nesterov_update_(
        new_params.view(-1), new_momentum.view(-1), pseudo_gradient.reshape(-1), lr, mu
    )
    return new_params, new_momentum


def outer_step(
    state: GlobalState,
    pseudo_gradient: torch.Tensor,
    config: OuterConfig,
    *,
    in_place: bool = False,
    span: slice | None = None,
) -> GlobalState:
    """The global state after one outer round: Nesterov step on the averaged pseudo-gradient with
    the momentum of ``state.round`` (see ``OuterConfig.momentum_at``), round + 1.
    ``span``: the elements the round averaged (a streaming fragment, ``slice(start, stop)``);
    only their params and momentum change. ``pseudo_gradient`` is flat float32 of the span's
    length, the state's without one (ValueError otherwise). ``in_place``: the new state reuses
    (and changes) ``state``'s tensors instead of copying them, for a caller that drops ``state``
    (DiLoCo: no second copy of a large model's state)."""
    mu = config.momentum_at(state.round)
    params, momentum = (
        (state.params, state.momentum)
        if in_place
        else (state.params.clone(), state.momentum.clone())
    )
    part = slice(None) if span is None else span
    nesterov_update_(params[part], momentum[part], pseudo_gradient, config.lr, mu)
    return GlobalState(state.round + 1, params, momentum, state.layout)


def skipped_round(state: GlobalState) -> GlobalState:
    """The global state after a round whose averaging failed: unchanged except round + 1, so peers
    that all failed the round stay in agreement and draw fresh data for the next one."""
    return GlobalState(state.round + 1, state.params, state.momentum, state.layout)
