"""The dispute game on the real RepOps step (a small model of the default architecture): one
tampered record of every operator kind is found, and ``verify.repops.step.run_op`` recomputes it
from
the tensors as they travel (canonical bytes decoded by the referee)."""

from __future__ import annotations

import math

import pytest

from verify.commit import TaskSpec
from verify.dispute.game import Answered, Finish, Referee, RefereeConfig
from verify.dispute.provider import Provider
from verify.trace import state_hash, tensor_hash

repops = pytest.importorskip("verify.repops.step")
SHAPE = repops.ModelShape(d_model=16, n_layers=1, n_heads=2, context=8)
CORPUS = bytes(range(256)) * 4
STEPS = 2


@pytest.fixture(scope="module")
def step() -> object:
    return repops.RepOpsStep(CORPUS, 3, shape=SHAPE, batch_size=2)


def one_record_per_operator(step: object) -> list[int]:
    result = step(step.initial_state(), 0)  # type: ignore[operator, attr-defined]
    first: dict[str, int] = {}
    for index, record in enumerate(result.records):
        if not record.is_leaf:
            first.setdefault(record.name, index)
    return sorted({*first.values(), len(result.records) - 1})


@pytest.fixture(scope="module")
def honest(step: object) -> Provider:
    provider = Provider(step, step.initial_state(), task_of(step))  # type: ignore[arg-type, attr-defined]
    provider.run()
    return provider


def task_of(step: object) -> TaskSpec:
    return TaskSpec(state_hash(step.initial_state()), 3, STEPS)  # type: ignore[attr-defined]


def play(step: object, honest: Provider, tamper: tuple[int, int]) -> object:
    cheater = Provider(step, step.initial_state(), task_of(step), tamper=tamper)  # type: ignore[arg-type, attr-defined]
    cheater.run()
    providers = [honest, cheater]
    labels = {"inputs": 0, "targets": 1}

    def data_leaf(index: int, label: str, attrs: bytes) -> bytes | None:
        batch = step.batch(index)  # type: ignore[attr-defined]
        return tensor_hash(batch[labels[label]]) if label in labels else None

    config = RefereeConfig(same_program_every_step=True)
    referee = Referee(task_of(step), repops.run_op, leaf_oracle=data_leaf, config=config)
    actions = referee.start(0.0)
    while not any(isinstance(a, Finish) for a in actions):
        answers = [Answered(q.party, providers[q.party].answer(q.request)) for q in actions]  # type: ignore[union-attr]
        actions = [out for answer in answers for out in referee.handle(answer, 0.0)]
    return next(a for a in actions if isinstance(a, Finish)).verdict


def test_every_operator_kind_tampered_is_found(step: object, honest: Provider) -> None:
    n_ops = honest.leaves[0].n_ops
    for op in one_record_per_operator(step):
        verdict = play(step, honest, (1, op))
        assert (verdict.cheaters, verdict.step, verdict.op) == ((1,), 1, op), verdict  # type: ignore[attr-defined]
        assert verdict.ops_recomputed == 1  # type: ignore[attr-defined]
        assert verdict.rounds <= math.ceil(math.log2(STEPS)) + math.ceil(math.log2(n_ops)) + 4  # type: ignore[attr-defined]
