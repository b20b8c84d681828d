"""The dispute game played to its end as the coordinator's referee plays it, for unit tests."""

from __future__ import annotations

from diloco import Corpus
from swarmtrain.config import RunConfig
from swarmtrain.verified.task import (
    DATA_LABELS,
    recompute_of,
    same_program_every_step,
    task_data,
)
from verify import Answered, Finish, TaskSpec, Verdict, tensor_hash
from verify.dispute import Provider, Referee, RefereeConfig


def referee_game(
    config: RunConfig,
    corpus: Corpus,
    spec: TaskSpec,
    providers: list[Provider],
    *,
    run_seed: int,
    round_number: int,
    owner: bytes,
) -> Verdict:
    """The game as ``RefereeService.referee`` sets it up: the task's data alone (``task_data``)
    for the leaf oracle, ``recompute_of`` for the disputed record, no model."""
    data = task_data(config, corpus, run_seed, round_number, owner)

    def data_leaf(index: int, label: str, attrs: bytes) -> bytes | None:
        if label not in DATA_LABELS or not 0 <= index < len(data.batches):
            return None
        return tensor_hash(data.batches[index][DATA_LABELS[label]])

    referee = Referee(
        TaskSpec(spec.start_state_hash, data.seed, len(data.batches)),
        recompute_of(config),
        leaf_oracle=data_leaf,
        config=RefereeConfig(30.0, same_program_every_step=same_program_every_step(config)),
    )
    actions = referee.start(0.0)
    for _ in range(200):  # bounded: the game ends in about log2(steps) + log2(ops) rounds
        finish = next((a for a in actions if isinstance(a, Finish)), None)
        if finish is not None:
            return finish.verdict
        answers = [Answered(q.party, providers[q.party].answer(q.request)) for q in actions]  # type: ignore[union-attr]
        actions = [out for answer in answers for out in referee.handle(answer, 0.0)]
    raise AssertionError("the dispute game did not end")
