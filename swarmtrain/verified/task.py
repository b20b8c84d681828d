"""A verified run's task: one peer's inner phase of one round, as RepOps training.

The task of (round r, owner O) is H RepOps AdamW steps (``verify.repops.step``: bit-identical on any
machine) of the run's model from the round's global parameters with zero AdamW moments, on the
batches DiLoCo gives O in round r (``diloco.inner_batches``: a pure function of run seed, round
and peer id). Everything is fixed by the spec and the start state, so the owner, a verifier and
the referee's data oracle all build the same one.

``run_traced`` executes it as a ``verify.dispute.provider.Provider`` (every step's operators hashed
and Merkle-committed, states kept for the dispute game); ``run_fast`` executes the same steps
untraced (the same bits) for a task nobody re-executes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from diloco import Corpus, inner_batches
from swarmtrain.config import RunConfig
from swarmtrain.verified.plan import task_seed
from verify import StepResult, TaskSpec, state_hash
from verify.dispute import Provider
from verify.repops import (
    AdamWConfig,
    ModelShape,
    RepOpsStep,
    initial_state,
    step_loss,
    train_step,
)

# The leaf labels RepOps gives a step's data (``verify.repops.graph``): the referee's data oracle.
DATA_LABELS = {"inputs": 0, "targets": 1}


def model_shape(config: RunConfig) -> ModelShape:
    return ModelShape(
        config.model.d_model, config.model.n_layers, config.model.n_heads, config.model.context
    )


def inner_optimizer(config: RunConfig) -> AdamWConfig:
    """``torch.optim.AdamW(lr=training.inner_lr)``'s defaults, as the native inner phase uses."""
    return AdamWConfig(lr=config.training.inner_lr)


class TaskStep(RepOpsStep):
    """``RepOpsStep`` whose step ``i`` trains on the task's ``i``-th batch; keeps each traced
    step's loss (the progress line shows it)."""

    def __init__(
        self, batches: list[tuple[np.ndarray, np.ndarray]], seed: int, config: RunConfig
    ) -> None:
        # RepOpsStep draws its own windows from a corpus; a task's data is DiLoCo's shard.
        self.batches = batches
        self.seed = seed
        self.shape = model_shape(config)
        self.optimizer = inner_optimizer(config)
        self.batch_size = config.training.batch_size
        self.device = torch.device("cpu")
        self.losses: dict[int, float] = {}

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.batches[step]

    def __call__(
        self, state: dict[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        result = super().__call__(state, step, tamper_op)
        self.losses[step] = step_loss(result)
        return result


@dataclass
class Task:
    owner: bytes
    round: int
    step: TaskStep
    start: dict[str, np.ndarray]
    spec: TaskSpec
    losses: list[float] = field(default_factory=list)


def make_task(
    config: RunConfig,
    corpus: Corpus,
    run_seed: int,
    round_number: int,
    owner: bytes,
    params: dict[str, np.ndarray],
) -> Task:
    """The task of (``round_number``, ``owner``) from the global ``params`` (name -> float32)."""
    batches = [
        (inputs.numpy(), targets.numpy())
        for inputs, targets in inner_batches(
            corpus,
            run_seed=run_seed,
            round=round_number,
            peer_id=owner,
            steps=config.training.inner_steps,
            batch_size=config.training.batch_size,
            context=config.training.sequence_length,
        )
    ]
    seed = task_seed(config.run.id, round_number, owner)
    step = TaskStep(batches, seed, config)
    start = initial_state(params, step.shape)
    return Task(owner, round_number, step, start, TaskSpec(state_hash(start), seed, len(batches)))


def run_traced(task: Task, tamper: tuple[int, int] | None = None) -> Provider:
    """Execute and commit; the provider answers the dispute game about it afterwards.
    ``tamper=(step, op)`` flips a bit of that operator's output (a cheater, for tests)."""
    provider = Provider(task.step, task.start, task.spec, tamper=tamper)
    provider.run()
    task.losses = [task.step.losses[i] for i in range(task.spec.steps)]
    return provider


def run_fast(task: Task) -> dict[str, np.ndarray]:
    """Execute untraced; returns the final state (the same bits ``run_traced`` ends at)."""
    state = {k: torch.from_numpy(v.copy()) for k, v in task.start.items()}
    task.losses = []
    for i in range(task.spec.steps):
        inputs, targets = task.step.batch(i)
        state, loss = train_step(
            state,
            torch.from_numpy(inputs),
            torch.from_numpy(targets),
            task.step.shape,
            task.step.optimizer,
        )
        task.losses.append(float(loss))
    return {k: v.numpy() for k, v in state.items()}
