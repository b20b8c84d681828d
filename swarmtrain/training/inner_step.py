"""One inner step of a DiLoCo volunteer as ``[training]`` sets it: the learning rate of the run's
schedule, gradients accumulated over ``grad_accumulation`` batches (each loss divided by their
number, so the gradient is the large batch's mean), the forward under bfloat16 autocast when
``precision = "bf16"`` or float16 autocast with a gradient scaler when ``"fp16"`` (float16's
narrow range underflows small gradients unless the loss is scaled up first), and the global-norm
clip. The optimizer step itself is DiLoCo's
(``DiLoCo.step``), which runs the round on the H-th. On a node of several local ranks
(``--nproc-per-node``) the batches go through the ranks' ``DistributedDataParallel`` wrapper,
which averages the gradients across ranks in the last batch's backward, before the clip
(with ``--fsdp``: the sharded root, which reduce-scatters them to their shards)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from diloco import Corpus, inner_batches, lr_factor
from swarmtrain.config import RunConfig, TrainingSection, run_seed_of


class RankForward(Protocol):
    """The model's loss across a node's local ranks: ``DistributedDataParallel`` (its forward
    is ``model.loss``) or a ``--fsdp`` node's sharded root; ``no_sync`` for the batches
    before a step's last."""

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def no_sync(self) -> AbstractContextManager[object]: ...


def inner_optimizer(model: torch.nn.Module, training: TrainingSection) -> torch.optim.Optimizer:
    """The inner AdamW of ``[training]`` over ``model``'s parameters (every local rank of a node
    builds the same one, so their states stay bit-identical)."""
    return torch.optim.AdamW(
        model.parameters(), lr=training.inner_lr, weight_decay=training.weight_decay
    )


def grad_scaler(model: torch.nn.Module, training: TrainingSection) -> torch.amp.GradScaler | None:
    """The loss scaler of ``precision = "fp16"`` on the device of ``model``'s parameters; None
    for the other precisions (bfloat16 has float32's range and needs none)."""
    if training.precision != "fp16":
        return None
    return torch.amp.GradScaler(next(model.parameters()).device.type)


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
    ddp: RankForward | None = None,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[float, int]:
    """Forward and backward over ``micro`` (the step's batches), gradients added into the
    parameters' ``.grad``, then clipped. ``ddp``: ``model`` wrapped for the node's local ranks
    (its forward is ``model.loss``); the gradients are averaged across ranks in the last batch's
    backward only (``no_sync`` before it). ``scaler`` (fp16, ``grad_scaler``): each loss is
    scaled before its backward and ``optimizer``'s gradients unscaled before the clip; the step
    itself must then go through the scaler (``DiLoCo.step`` does). Returns (this rank's mean
    loss, its tokens)."""
    device = next(model.parameters()).device
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    forward = model.loss if ddp is None else ddp  # type: ignore[assignment]
    total, tokens = 0.0, 0
    for index, (inputs, targets) in enumerate(micro):
        inputs, targets = inputs.to(device), targets.to(device)
        last = index == len(micro) - 1
        with ddp.no_sync() if ddp is not None and not last else nullcontext():
            with torch.autocast(
                device_type=device.type,
                dtype=torch.float16 if training.precision == "fp16" else torch.bfloat16,
                enabled=training.precision != "fp32",
            ):
                loss = forward(inputs, targets)
            scaled = loss / len(micro)
            (scaled if scaler is None else scaler.scale(scaled)).backward()
        total += float(loss.detach())
        tokens += inputs.numel()
    if scaler is not None:
        if optimizer is None:
            raise ValueError("a gradient scaler needs the optimizer whose gradients it unscales")
        scaler.unscale_(optimizer)
    if training.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
    return total / len(micro), tokens


def phase_batches(
    config: RunConfig,
    corpus: Corpus,
    round: int,
    peer_id: bytes,
    steps: int,
    shard: tuple[int, int] = (0, 1),
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of a node's inner phase ``round`` of ``steps`` steps (``grad_accumulation``
    each), this rank's ``shard`` of them: a pure function of the run's seed, the round and the
    peer id, so every rank of a node, and a verifier, draws the same ones."""
    training = config.training
    return inner_batches(
        corpus,
        run_seed=run_seed_of(config.run.id),
        round=round,
        peer_id=peer_id,
        steps=steps * training.grad_accumulation,
        batch_size=training.batch_size,
        context=training.sequence_length,
        shard=shard,
    )
