"""One inner step of a DiLoCo volunteer as ``[training]`` sets it: the learning rate of the run's
schedule, gradients accumulated over ``grad_accumulation`` batches (each loss divided by their
number, so the gradient is the large batch's mean), the forward under bfloat16 autocast when
``precision = "bf16"``, and the global-norm clip. The optimizer step itself is DiLoCo's
(``DiLoCo.step``), which runs the round on the H-th. On a node of several local ranks
(``--nproc-per-node``) the batches go through the ranks' ``DistributedDataParallel`` wrapper,
which averages the gradients across ranks in the last batch's backward, before the clip."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

from diloco import lr_factor
from swarmtrain.config import TrainingSection


def inner_optimizer(model: torch.nn.Module, training: TrainingSection) -> torch.optim.Optimizer:
    """The inner AdamW of ``[training]`` over ``model``'s parameters (every local rank of a node
    builds the same one, so their states stay bit-identical)."""
    return torch.optim.AdamW(
        model.parameters(), lr=training.inner_lr, weight_decay=training.weight_decay
    )


def set_lr(
    optimizer: torch.optim.Optimizer, training: TrainingSection, step: int, total: int
) -> float:
    """Give every parameter group the schedule's learning rate at the run's inner step ``step``
    of ``total`` (rounds x H). Returns it."""
    lr = training.inner_lr * lr_factor(
        step, total, training.lr_schedule, training.warmup, training.final_lr
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def accumulate(
    model: torch.nn.Module,
    micro: Sequence[tuple[torch.Tensor, torch.Tensor]],
    training: TrainingSection,
    ddp: DistributedDataParallel | None = None,
) -> tuple[float, int]:
    """Forward and backward over ``micro`` (the step's batches), gradients added into the
    parameters' ``.grad``, then clipped. ``ddp``: ``model`` wrapped for the node's local ranks
    (its forward is ``model.loss``); the gradients are averaged across ranks in the last batch's
    backward only (``no_sync`` before it). Returns (this rank's mean loss, its tokens)."""
    device = next(model.parameters()).device
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    forward = model.loss if ddp is None else ddp  # type: ignore[assignment]
    total, tokens = 0.0, 0
    for index, (inputs, targets) in enumerate(micro):
        inputs, targets = inputs.to(device), targets.to(device)
        last = index == len(micro) - 1
        with ddp.no_sync() if ddp is not None and not last else nullcontext():
            with torch.autocast(
                device_type=device.type, dtype=torch.bfloat16, enabled=training.precision == "bf16"
            ):
                loss = forward(inputs, targets)
            (loss / len(micro)).backward()
        total += float(loss.detach())
        tokens += inputs.numel()
    if training.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
    return total / len(micro), tokens
