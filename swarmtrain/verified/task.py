"""A verified run's task: one peer's inner phase of one round, as RepOps training.

The task of (round r, owner O) is H RepOps AdamW steps (bit-identical on any machine) of the run's
model from the round's global parameters with zero AdamW moments, on the batches DiLoCo gives O in
round r (``diloco.inner_batches``: a pure function of run seed, round and peer id). Everything is
fixed by the spec and the start state, so the owner, a verifier and the referee's data oracle all
build the same one.

Two ways to run a step, by the run's model (``dispatched``):

* the default model: ``verify.repops.RepOpsStep``, its hand-written graph (484 records a step;
  1.2x faster than the same model by dispatch, see docs/verification.md);
* any other model (``[model] kind = "transformers"``, a ``factory``), and the default model with
  ``[training] grad_clip`` (the graph has no clip operators): ``verify.dispatch.
  DispatchStep``, the model's own forward, loss, backward and ``torch.optim.AdamW`` step under
  ``RepOpsMode``; its trace is the dispatch log, and the referee recomputes one aten operator
  (``recompute_of``); a clip is ``clip_grad_norm_`` inside the mode, its operators recorded.
  ``check_verifiable`` runs one such step at spec time and refuses a model
  with an operator RepOps cannot run, naming it.

``run_traced`` executes a task as a ``verify.dispute.provider.Provider`` (every step's operators
hashed and Merkle-committed, states kept for the dispute game); ``run_fast`` executes the same
steps untraced (the same bits) for a task nobody re-executes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from diloco import Corpus, inner_batches
from swarmtrain.config import RunConfig
from swarmtrain.verified.plan import task_seed
from verify import Recompute, StepResult, TaskSpec, param_shapes, state_hash
from verify.dispatch import AdamWSettings, DispatchStep, TraceError, UnmappedOperator, recompute
from verify.dispute import Provider
from verify.repops import (
    AdamWConfig,
    ModelShape,
    RepOpsStep,
    initial_state,
    run_op,
    step_loss,
    train_step,
)

# The leaf labels both traces give a step's data (``verify.repops.graph``, ``DispatchStep``):
# the referee's data oracle.
DATA_LABELS = {"inputs": 0, "targets": 1}
Batches = list[tuple[np.ndarray, np.ndarray]]


class NotVerifiable(ValueError):
    """The run's model cannot be a verified task; the message names the operator and why."""


def dispatched(config: RunConfig) -> bool:
    """Whether the run's tasks are dispatch traces: every model but the default one, and the
    default one too when its gradients are clipped (``[training] grad_clip``: the hand-written
    graph has no clip; the model's own step under the mode clips as the native step does)."""
    return config.model.kind != "default" or bool(config.model.factory) or _clipped(config)


def _clipped(config: RunConfig) -> bool:
    return config.training.grad_clip > 0


def model_shape(config: RunConfig) -> ModelShape:
    return ModelShape(
        config.model.d_model, config.model.n_layers, config.model.n_heads, config.model.context
    )


def inner_optimizer(config: RunConfig) -> AdamWConfig:
    """``torch.optim.AdamW(lr=training.inner_lr)``'s defaults, as the native inner phase uses."""
    return AdamWConfig(lr=config.training.inner_lr)


def inner_adamw(config: RunConfig) -> AdamWSettings:
    """The same optimizer for a dispatch trace (``torch.optim.AdamW(fused=True)``, mapped to
    RepOps' one-pass AdamW)."""
    return AdamWSettings(
        lr=config.training.inner_lr,
        weight_decay=config.training.weight_decay,
        grad_clip=config.training.grad_clip,
    )


def recompute_of(config: RunConfig) -> Recompute:
    """The referee's recomputation of one disputed record of this run's tasks."""
    return recompute if dispatched(config) else run_op


def same_program_every_step(config: RunConfig) -> bool:
    """Whether every step of a task records the same operator graph (the hand-written one
    does; a dispatch trace's does only for a model that does not branch on its data, which the
    referee cannot assume: see ``verify.dispatch.traced``)."""
    return not dispatched(config)


class TaskStep(RepOpsStep):
    """``RepOpsStep`` whose step ``i`` trains on the task's ``i``-th batch; keeps each traced
    step's loss (the progress line shows it)."""

    def __init__(self, batches: Batches, seed: int, config: RunConfig) -> None:
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


class DispatchTaskStep(DispatchStep):
    """``DispatchStep`` of the task's own copy of the model (a provider recomputes steps in a
    worker thread while the next round's task runs: they must not share one) whose step ``i``
    trains on the task's ``i``-th batch; keeps each step's loss."""

    def __init__(self, model: nn.Module, batches: Batches, seed: int, config: RunConfig) -> None:
        super().__init__(copy.deepcopy(model), batches.__getitem__, optimizer=inner_adamw(config))
        self.seed = seed
        self.losses: dict[int, float] = {}

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        result = super().__call__(state, step, tamper_op)
        assert self.last_loss is not None
        self.losses[step] = self.last_loss
        return result


@dataclass
class Task:
    owner: bytes
    round: int
    step: TaskStep | DispatchTaskStep
    start: dict[str, np.ndarray]
    spec: TaskSpec
    losses: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TaskData:
    """What fixes a task besides its start state: its data seed and batches (the referee's
    view: it needs no model)."""

    seed: int
    batches: Batches


def task_data(
    config: RunConfig, corpus: Corpus, run_seed: int, round_number: int, owner: bytes
) -> TaskData:
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
    return TaskData(task_seed(config.run.id, round_number, owner), batches)


def make_task(
    config: RunConfig,
    corpus: Corpus,
    run_seed: int,
    round_number: int,
    owner: bytes,
    params: Mapping[str, np.ndarray],
    model: nn.Module | None = None,
) -> Task:
    """The task of (``round_number``, ``owner``) from the global ``params`` (name -> float32:
    the model's trainable parameters). ``model``: the run's model (a dispatched run's tasks each
    train a copy of it; its frozen parameters and buffers are part of every start state)."""
    data = task_data(config, corpus, run_seed, round_number, owner)
    step: TaskStep | DispatchTaskStep
    if dispatched(config):
        if model is None:
            raise ValueError("a task of this run's model needs the model")
        step = DispatchTaskStep(model, data.batches, data.seed, config)
        start = step.initial_state()
        if set(params) != set(step.params):
            odd = sorted(set(params) ^ set(step.params))
            raise ValueError(f"the global parameters are not the model's trainable ones: {odd[:4]}")
        start.update({name: np.array(value, np.float32) for name, value in params.items()})
    else:
        step = TaskStep(data.batches, data.seed, config)
        start = initial_state(dict(params), step.shape)
    spec = TaskSpec(state_hash(start), data.seed, len(data.batches))
    return Task(owner, round_number, step, start, spec)


def run_traced(task: Task, tamper: tuple[int, int] | None = None) -> Provider:
    """Execute and commit; the provider answers the dispute game about it afterwards.
    ``tamper=(step, op)`` flips a bit of that operator's output (a cheater, for tests)."""
    provider = Provider(task.step, task.start, task.spec, tamper=tamper)
    provider.run()
    task.losses = [task.step.losses[i] for i in range(task.spec.steps)]
    return provider


def run_fast(task: Task) -> dict[str, np.ndarray]:
    """Execute untraced; returns the final state (the same bits ``run_traced`` ends at)."""
    task.losses = []
    step = task.step
    if isinstance(step, DispatchTaskStep):
        after: Mapping[str, np.ndarray] = task.start
        for i in range(task.spec.steps):
            after = step.advance(after, i)
            assert step.last_loss is not None
            task.losses.append(step.last_loss)
        return dict(after)
    state = {k: torch.from_numpy(v.copy()) for k, v in task.start.items()}
    for i in range(task.spec.steps):
        inputs, targets = step.batch(i)
        state, loss = train_step(
            state, torch.from_numpy(inputs), torch.from_numpy(targets), step.shape, step.optimizer
        )
        task.losses.append(float(loss))
    return {k: v.numpy() for k, v in state.items()}


def param_layout(config: RunConfig, model: nn.Module | None = None) -> dict[str, tuple[int, ...]]:
    """Each trainable parameter's shape, in the order of the flat vector a node averages (the
    model's ``named_parameters``). A dispatched run's model is built from the spec unless given
    (its weights do not matter here)."""
    if not dispatched(config):
        return {name: tuple(dims) for name, dims in param_shapes(model_shape(config)).items()}
    model = model if model is not None else _spec_model(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def _spec_model(config: RunConfig) -> nn.Module:
    # Imported here: the node's workload module reads data and weights; only these runs need it.
    from swarmtrain.training.workload import build_model

    return build_model(config, weights=False)


def check_verifiable(config: RunConfig, model: nn.Module | None = None) -> int:
    """Run one traced step of a dispatched run's model (built from the spec unless given) on a
    batch of zeros of the run's shape; return its records. Raises ``NotVerifiable`` naming the
    operator RepOps has no mapping for, or the one the dispatch trace cannot follow. The default
    model's graph is RepOps' own: nothing to check (0)."""
    if not dispatched(config):
        return 0
    model = model if model is not None else _spec_model(config)
    shape = (config.training.batch_size, config.training.sequence_length)
    zeros = np.zeros(shape, np.int64)
    step = DispatchTaskStep(model, [(zeros, zeros)], 0, config)
    try:
        return len(step(step.initial_state(), 0).records)
    except (UnmappedOperator, TraceError) as exc:
        raise NotVerifiable(f"verify.rate > 0: the model's training step: {exc}") from None
