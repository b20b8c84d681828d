"""Verified runs with ``[training] grad_clip`` (issue 23): the clip is ``clip_grad_norm_`` inside
``DispatchStep``'s mode, its operators records of the trace. A clipped run of the default model
goes through the dispatch path (its hand-written graph has no clip): a whole clipped step is
bit-identical on one and two threads, traced or not; the clip really scales; a tampered clip
operator is named by the dispute game at its step and operator; the spec accepts the setting."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from referee_game import referee_game

from diloco import Corpus
from swarmtrain.config import RunConfig, config_from_mapping
from swarmtrain.training.workload import build_model
from swarmtrain.verified.task import (
    DispatchTaskStep,
    Task,
    check_verifiable,
    dispatched,
    make_task,
    param_layout,
    run_fast,
    run_traced,
)
from verify import TaskSpec, Verdict, state_hash
from verify.dispatch import tamperable
from verify.dispute import Provider

STEPS, ROUND, RUN_SEED = 2, 1, 7
OWNER = b"\x02" * 38
CLIP = 0.05  # below the small model's gradient norm at every step (asserted): the clip scales
CLIP_OPS = ("aten.linalg_vector_norm.default", "aten.clamp.default", "aten.mul_.Tensor")


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return config_from_mapping(
        {
            "run": {"id": "run-clip"},
            "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 16},
            "training": {
                "inner_steps": STEPS, "batch_size": 2, "sequence_length": 16, "grad_clip": CLIP,
            },
            "verify": {"rate": 1.0},
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    data = np.frombuffer(bytes(range(256)) * 8, np.uint8)
    return Corpus(data[:1800], data[1800:], (), (), "test")


@pytest.fixture(scope="module")
def model(config: RunConfig) -> torch.nn.Module:
    return build_model(config)


def _task(config: RunConfig, corpus: Corpus, model: torch.nn.Module) -> Task:
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return make_task(config, corpus, RUN_SEED, ROUND, OWNER, params, model)


@pytest.fixture(scope="module")
def honest(config: RunConfig, corpus: Corpus, model: torch.nn.Module) -> tuple[Task, Provider]:
    torch.set_num_threads(1)
    task = _task(config, corpus, model)
    return task, run_traced(task)


def _clip_records(task: Task) -> dict[str, list[int]]:
    """Each clip operator's record indices in one traced step of ``task``."""
    records = task.step(task.start, 0).records
    found: dict[str, list[int]] = {name: [] for name in CLIP_OPS}
    for i, record in enumerate(records):
        if record.name in found and tamperable(record):
            found[record.name].append(i)
    return found


def test_a_clipped_default_model_task_is_a_dispatch_trace_bit_identical_on_1_and_2_threads(
    config: RunConfig, corpus: Corpus, model: torch.nn.Module, honest: tuple[Task, Provider]
) -> None:
    assert dispatched(config) and not dispatched(config.replace(training={"grad_clip": 0.0}))
    task, provider = honest
    assert isinstance(task.step, DispatchTaskStep) and task.step.optimizer.grad_clip == CLIP
    assert check_verifiable(config, model) > 100
    layout = param_layout(config, model)
    assert list(layout) == [n for n, p in model.named_parameters() if p.requires_grad]

    params = list(task.step.params)
    found = _clip_records(task)
    # One norm per gradient and the norm of the norms; one clamp; one multiply per gradient.
    assert len(found["aten.linalg_vector_norm.default"]) == len(params) + 1, found
    assert len(found["aten.clamp.default"]) == 1 and len(found["aten.mul_.Tensor"]) >= len(params)
    # The clip scaled: after it the gradients' global norm is CLIP (the loss's is larger).
    grads = [p.grad for p in task.step.params.values()]
    assert all(g is not None for g in grads)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert abs(float(norm) - CLIP) < 1e-6, float(norm)

    # The whole clipped task: traced at one thread, untraced at one and at two, the same bits.
    finals = {"traced, 1 thread": state_hash(provider.final_state)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        finals[f"fast, {threads} threads"] = state_hash(run_fast(_task(config, corpus, model)))
    torch.set_num_threads(2)
    finals["traced, 2 threads"] = state_hash(run_traced(_task(config, corpus, model)).final_state)
    assert len(set(finals.values())) == 1, finals
    # With a clip that never bites the same task ends elsewhere: the clip is part of the step.
    other = make_task(
        config.replace(training={"grad_clip": 1e9}), corpus, RUN_SEED, ROUND, OWNER,
        {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, model,
    )  # fmt: skip
    assert state_hash(run_fast(other)) != finals["traced, 1 thread"]


def _referee_game(
    config: RunConfig, corpus: Corpus, spec: TaskSpec, providers: list[Provider]
) -> Verdict:
    return referee_game(
        config, corpus, spec, providers, run_seed=RUN_SEED, round_number=ROUND, owner=OWNER
    )


@pytest.mark.parametrize(
    ("name", "which", "step"),
    [("aten.linalg_vector_norm.default", -1, 0), ("aten.clamp.default", 0, STEPS - 1),
     ("aten.mul_.Tensor", 0, STEPS - 1)],
)  # fmt: skip
def test_a_tampered_clip_operator_is_named_at_its_step_and_operator(
    config: RunConfig,
    corpus: Corpus,
    model: torch.nn.Module,
    honest: tuple[Task, Provider],
    name: str,
    which: int,
    step: int,
) -> None:
    """The global norm (the last norm), the clamped coefficient, and the first gradient's
    multiply: each tampered by one bit, at the first or last step."""
    torch.set_num_threads(1)
    task, provider = honest
    op = _clip_records(task)[name][which]
    cheating = run_traced(_task(config, corpus, model), tamper=(step, op))
    assert cheating.commitment != provider.commitment
    verdict = _referee_game(config, corpus, task.spec, [provider, cheating])
    assert (verdict.cheaters, verdict.step, verdict.op) == ((1,), step, op), verdict
    assert verdict.op_name == name and verdict.reason.startswith("output differs"), verdict
    verdict = _referee_game(config, corpus, task.spec, [cheating, provider])
    assert verdict.cheaters == (0,), verdict
