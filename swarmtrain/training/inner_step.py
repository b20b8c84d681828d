"""One inner step of a DiLoCo volunteer as ``[training]`` sets it: the learning rate of the run's
schedule, gradients accumulated over ``grad_accumulation`` batches (each loss divided by their
number, so the gradient is the large batch's mean), the forward under bfloat16 autocast when
``precision = "bf16"``, and the global-norm clip. The optimizer step itself is DiLoCo's
(``DiLoCo.step``), which runs the round on the H-th."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco import lr_factor
from swarmtrain.config import TrainingSection


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
) -> tuple[float, int]:
    """Forward and backward over ``micro`` (the step's batches), gradients added into the
    parameters' ``.grad``, then clipped. Returns (the mean loss, tokens)."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for inputs, targets in micro:
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(
            device_type=device.type, dtype=torch.bfloat16, enabled=training.precision == "bf16"
        ):
            loss = model.loss(inputs, targets)  # type: ignore[operator]
        (loss / len(micro)).backward()
        total += float(loss.detach())
        tokens += inputs.numel()
    if training.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
    return total / len(micro), tokens
