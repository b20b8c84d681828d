"""Verified runs of any model (issue 23, point 4): a ``[model] kind = "transformers"`` run's tasks
are dispatch traces (``swarmtrain.verified.task``): a cheating provider's tampered aten operator
is named by the dispute game the coordinator's referee plays (its data oracle and recomputation
as ``swarmtrain.verified.referee`` builds them, no model on the referee's side); a model whose
step uses an operator RepOps cannot run is refused at spec time, by name, in one line."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from referee_game import referee_game

from diloco import Corpus
from swarmtrain.cli import _run
from swarmtrain.config import RunConfig, config_from_mapping, default_toml
from swarmtrain.training.workload import build_model
from swarmtrain.verified.task import (
    DispatchTaskStep,
    NotVerifiable,
    Task,
    check_verifiable,
    make_task,
    param_layout,
    run_fast,
    run_traced,
)
from verify import TaskSpec, Verdict, tensor_hash
from verify.dispatch import tamperable
from verify.dispute import Provider

# llama-tiny's architecture (examples/configs/llama-tiny.json), narrower: grouped KV heads,
# RMS norm, rotary positions, SiLU MLP. Built from the config; nothing is downloaded.
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 16}  # fmt: skip
STEPS, ROUND, RUN_SEED = 2, 1, 7
OWNER = b"\x01" * 38


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return config_from_mapping(
        {
            "run": {"id": "run-any-model"},
            "model": {"kind": "transformers", "config": LLAMA},
            "training": {"inner_steps": STEPS, "batch_size": 2, "sequence_length": 8},
            "verify": {"rate": 1.0},
        }
    )


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
    task = _task(config, corpus, model)
    return task, run_traced(task)


def _referee_game(
    config: RunConfig, corpus: Corpus, spec: TaskSpec, providers: list[Provider]
) -> Verdict:
    return referee_game(
        config, corpus, spec, providers, run_seed=RUN_SEED, round_number=ROUND, owner=OWNER
    )


def test_a_transformers_task_is_a_dispatch_trace_and_its_fast_run_has_the_same_bits(
    config: RunConfig, corpus: Corpus, model: torch.nn.Module, honest: tuple[Task, Provider]
) -> None:
    task, provider = honest
    assert isinstance(task.step, DispatchTaskStep)
    assert task.step.model is not model  # its own copy: a provider recomputes in a thread
    again = _task(config, corpus, model)
    assert again.spec == task.spec  # a verifier builds the same task
    final = run_fast(again)
    assert {n: final[n].tobytes() for n in final} == {
        n: v.tobytes() for n, v in provider.final_state.items()
    }
    assert again.losses == task.losses and len(task.losses) == STEPS
    assert all(math.isfinite(loss) for loss in task.losses)
    # The averaged vector's layout is the model's trainable parameters in order.
    layout = param_layout(config)
    assert list(layout) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(
        not np.array_equal(final[n], p.detach().numpy()) for n, p in model.named_parameters()
    )


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_tampered_operator_of_a_transformers_task_names_the_cheating_provider(
    config: RunConfig,
    corpus: Corpus,
    model: torch.nn.Module,
    honest: tuple[Task, Provider],
    where: str,
) -> None:
    task, provider = honest
    records = task.step(task.start, 0).records
    ops = [i for i, record in enumerate(records) if tamperable(record)]
    step, op = (0, ops[0]) if where == "first" else (STEPS - 1, ops[-1])
    cheating = run_traced(_task(config, corpus, model), tamper=(step, op))
    assert cheating.commitment != provider.commitment
    verdict = _referee_game(config, corpus, task.spec, [provider, cheating])
    assert (verdict.cheaters, verdict.step, verdict.op) == ((1,), step, op), verdict
    assert verdict.op_name == records[op].name and verdict.reason.startswith("output differs")
    # And the other way round: the honest party is never named.
    verdict = _referee_game(config, corpus, task.spec, [cheating, provider])
    assert verdict.cheaters == (0,), verdict


def test_a_model_with_an_unmapped_operator_is_refused_at_spec_time_by_name() -> None:
    config = RunConfig().replace(
        run={"id": "run-logcumsumexp"},
        model={"factory": "pipeline_user_model:build_cumulative"},
        training={"sequence_length": 16},
        verify={"rate": 0.5},
    )
    with pytest.raises(NotVerifiable, match=r"aten\.logcumsumexp\.default has no RepOps mapping"):
        check_verifiable(config)


def test_the_coordinator_refuses_it_in_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = RunConfig().replace(
        model={"factory": "pipeline_user_model:build_cumulative"},
        training={"sequence_length": 16},
        verify={"rate": 0.5},
    )
    path = tmp_path / "run.toml"
    path.write_text(default_toml(config))
    identity = tmp_path / "coordinator.key"
    status = _run(["coordinator", "--config", str(path), "--identity", str(identity)])
    err = capsys.readouterr().err.strip()
    assert status == 1
    assert err.splitlines() == [
        "swarmtrain coordinator: verify.rate > 0: the model's training step: "
        "aten.logcumsumexp.default has no RepOps mapping: a verified run cannot use it"
    ], err
    assert not (tmp_path / "coordinator.key.runs.json").exists()  # no run was started


def test_a_provider_answering_in_a_thread_while_a_task_runs_keeps_both_exact(
    config: RunConfig, corpus: Corpus, model: torch.nn.Module, honest: tuple[Task, Provider]
) -> None:
    """A node recomputes a disputed step in a worker thread (the dispute driver) while its next
    task runs: each task has its own model copy, dispatch modes are per thread, and the math
    attention path (a process-global flag) stays on until the last mode exits."""
    task, provider = honest
    other = _task(config, corpus, model)
    results: dict[str, str] = {}

    def run(name: str, step: DispatchTaskStep) -> None:
        for _ in range(3):
            after = step(task.start, 0).state
            hashes = {n: tensor_hash(v) for n, v in after.items()}
            results.setdefault(name, repr(sorted(hashes.items())))
            assert results[name] == repr(sorted(hashes.items()))

    threads = [
        threading.Thread(target=run, args=(name, step))
        for name, step in (("task", task.step), ("other", other.step))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    expected = repr(sorted((n, tensor_hash(v)) for n, v in provider.states[1].items()))
    assert results == {"task": expected, "other": expected}
    assert torch.backends.cuda.flash_sdp_enabled()  # restored once both modes left
