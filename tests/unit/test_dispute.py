"""The dispute game without sockets: the referee machine against two in-process providers.

A tampered operator at every position of a small task (first and last step, first and last
operator) is found and its provider named, with the step and the operator; the referee computes one
operator; rounds stay within ceil(log2 S) + ceil(log2 ops) + 4. A silent provider, a bad proof, a
malformed or wrong-typed answer lose; honest providers have no dispute.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import LocalProtocolError, Message, RemoteProtocolError, decode, encode
from verify.commit import MerkleTree, StepLeaf, StepTrace, TaskSpec, record_leaf
from verify.dispute.game import (
    Answered,
    Failed,
    Finish,
    Query,
    Referee,
    RefereeConfig,
    Stage,
    Timeout,
    Verdict,
)
from verify.dispute.provider import Provider
from verify.dispute.toytask import ToyTask, flip_low_bit, run_op
from verify.dispute.wire import (
    ANSWER_TYPES,
    OpOpenAnswer,
    OpOpenQuery,
    OpPrefixQuery,
    PrefixAnswer,
    StepOpenAnswer,
    StepOpenQuery,
    StepPrefixQuery,
)
from verify.trace import OpRecord, StepResult, state_hash, tensor_hash

ROOT = Path(__file__).resolve().parents[2]
DATA_SEED = 5
# Per query type: rewrite an answer (a misbehaving provider), or None to stay silent.
Meddle = Callable[[Message, Message], Message | None]


class CountingRecompute:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, name: str, inputs: list[np.ndarray], attrs: bytes) -> np.ndarray:
        self.calls += 1
        return run_op(name, inputs, attrs)


@dataclasses.dataclass
class Game:
    verdict: Verdict
    referee: Referee
    providers: list[Provider]
    recompute: CountingRecompute
    n_ops: int

    def bound(self) -> int:
        steps = self.referee.task.steps
        return math.ceil(math.log2(steps)) + math.ceil(math.log2(self.n_ops)) + 4


def play(
    steps: int,
    *,
    tamper: tuple[int, int] | None = None,
    cheater: int = 1,
    layers: int = 2,
    cheat_step: Callable[..., StepResult] | None = None,
    meddle: dict[type[Message], Meddle] | None = None,
    through_wire: bool = False,
    same_program: bool = True,
    cheater_class: type[Provider] = Provider,
) -> Game:
    toy = ToyTask(layers=layers, data_seed=DATA_SEED)
    start = toy.initial_state(seed=1)
    task = TaskSpec(state_hash(start), DATA_SEED, steps)
    steppers = [toy, toy]
    if cheat_step is not None:
        steppers[cheater] = cheat_step
    providers = [
        (cheater_class if p == cheater else Provider)(
            steppers[p], start, task, tamper=tamper if p == cheater else None
        )
        for p in (0, 1)
    ]
    for provider in providers:
        provider.run()
    recompute = CountingRecompute()
    config = RefereeConfig(10, same_program_every_step=same_program)
    referee = Referee(task, recompute, leaf_oracle=toy.data_leaf_hash, config=config)
    now = 0.0
    actions = referee.start(now)
    while True:
        finished = [a for a in actions if isinstance(a, Finish)]
        if finished:
            n_ops = max(leaf.n_ops for p in providers for leaf in p.leaves)
            return Game(finished[0].verdict, referee, providers, recompute, n_ops)
        now += 1.0
        queries = [a for a in actions if isinstance(a, Query)]
        assert len(queries) == len(actions) == 2 and referee.deadline == now - 1 + 10
        actions = []
        for query in queries:
            answer = providers[query.party].answer(query.request)
            if through_wire:  # every query and answer survives its own codec and size limit
                request = decode(encode(query.request), type(query.request))
                answer = decode(encode(providers[query.party].answer(request)), type(answer))
            hook = (meddle or {}).get(type(query.request)) if query.party == cheater else None
            if hook is not None:
                changed = hook(query.request, answer)
                if changed is None:
                    continue  # silent: the deadline will speak for it
                answer = changed
            actions += referee.handle(Answered(query.party, answer), now)
            if any(isinstance(a, Finish) for a in actions):
                break
        if not actions:
            late = now + 10
            actions = referee.handle(Timeout(referee.pending[0]), late)


def non_leaf_ops(layers: int = 2) -> list[int]:
    toy = ToyTask(layers=layers, data_seed=DATA_SEED)
    result = toy(toy.initial_state(seed=1), 0)
    return [i for i, r in enumerate(result.records) if not r.is_leaf]


def assert_caught(game: Game, cheater: int, step: int, op: int) -> None:
    v = game.verdict
    assert v.cheaters == (cheater,), v
    assert (v.step, v.op) == (step, op), v
    assert v.reason == "output differs from the referee's"
    assert game.recompute.calls == v.ops_recomputed == 1
    assert v.rounds <= game.bound(), (v.rounds, game.bound())
    assert all(p.steps_recomputed <= 1 for p in game.providers)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("step_at", ["first", "last"])
def test_tamper_at_every_operator_of_the_first_and_last_step(steps: int, step_at: str) -> None:
    step = 0 if step_at == "first" else steps - 1
    ops = non_leaf_ops()
    for op in ops:
        for cheater in (0, 1):
            game = play(steps, tamper=(step, op), cheater=cheater)
            assert_caught(game, cheater, step, op)
            assert game.verdict.op_name == game.providers[1 - cheater].trace(step).records[op].name


def test_first_and_last_operator_in_a_deeper_task_over_the_wire_codecs() -> None:
    ops = non_leaf_ops(layers=4)
    for step in (0, 6, 12):
        for op in (ops[0], ops[-1]):
            game = play(13, tamper=(step, op), layers=4, through_wire=True)
            assert_caught(game, 1, step, op)


@settings(deadline=None, max_examples=25)
@given(st.data())
def test_random_tamper_is_found(data: st.DataObject) -> None:
    steps = data.draw(st.integers(1, 17), label="steps")
    layers = data.draw(st.integers(1, 4), label="layers")
    step = data.draw(st.integers(0, steps - 1), label="step")
    op = data.draw(st.sampled_from(non_leaf_ops(layers)), label="op")
    cheater = data.draw(st.sampled_from([0, 1]), label="cheater")
    assert_caught(play(steps, tamper=(step, op), cheater=cheater, layers=layers), cheater, step, op)


def test_honest_providers_have_no_dispute() -> None:
    game = play(6)
    assert game.verdict.agreed and game.verdict.cheaters == ()
    assert game.verdict.rounds == 1 and game.recompute.calls == 0
    assert game.providers[0].commitment == game.providers[1].commitment


@pytest.mark.parametrize("silent_on", [StepPrefixQuery, StepOpenQuery, OpPrefixQuery, OpOpenQuery])
def test_a_silent_provider_loses(silent_on: type[Message]) -> None:
    game = play(5, tamper=(2, 9), meddle={silent_on: lambda q, a: None})
    assert game.verdict.cheaters == (1,)
    assert game.verdict.reason == "no answer by the deadline"
    assert game.recompute.calls == 0


def test_both_silent_both_lose() -> None:
    referee = Referee(TaskSpec(b"\0" * 32, 0, 3), run_op)
    referee.start(0.0)
    [finish] = referee.handle(Timeout(0), 30.0)
    assert isinstance(finish, Finish) and finish.verdict.cheaters == (0, 1)


def _bad_prefix_proof(q: Message, a: Message) -> Message:
    assert isinstance(a, PrefixAnswer)
    return dataclasses.replace(a, proof=[bytes(32), *a.proof[1:]])


def _forged_prefix_root(q: Message, a: Message) -> Message:
    assert isinstance(a, PrefixAnswer)
    return dataclasses.replace(a, root=bytes(32))


def _bad_step_path(q: Message, a: Message) -> Message:
    assert isinstance(a, StepOpenAnswer)
    return dataclasses.replace(a, path=a.path[:-1])


def _bad_record_path(q: Message, a: Message) -> Message:
    assert isinstance(a, OpOpenAnswer)
    return dataclasses.replace(a, path=[bytes(32)] * len(a.path))


def _wrong_tensor(q: Message, a: Message) -> Message:
    assert isinstance(a, OpOpenAnswer)
    return dataclasses.replace(a, tensors=[a.tensors[0][:-4] + bytes(4), *a.tensors[1:]])


def _garbage_record(q: Message, a: Message) -> Message:
    assert isinstance(a, OpOpenAnswer)
    return dataclasses.replace(a, record=b"\xff" * 7)


def _wrong_type(q: Message, a: Message) -> Message:
    return PrefixAnswer(bytes(32), [])


@pytest.mark.parametrize(
    ("query_type", "meddle", "why"),
    [
        (StepPrefixQuery, _bad_prefix_proof, "not consistent"),
        (OpPrefixQuery, _forged_prefix_root, "not consistent"),
        (StepOpenQuery, _bad_step_path, "does not extend"),
        (OpOpenQuery, _bad_record_path, "does not extend"),
        (OpOpenQuery, _wrong_tensor, "does not match its record"),
        (OpOpenQuery, _garbage_record, "malformed record"),
        (StepOpenQuery, _wrong_type, "PrefixAnswer answers StepOpenQuery"),
    ],
)
def test_an_answer_that_does_not_verify_loses(
    query_type: type[Message], meddle: Meddle, why: str
) -> None:
    # The meddling provider is the honest one here: a bad proof loses even with a true result.
    game = play(6, tamper=(3, 9), cheater=0, meddle={query_type: meddle})
    assert game.verdict.cheaters == (0,), game.verdict
    assert why in game.verdict.reason


def test_a_failed_answer_loses_and_late_events_are_refused() -> None:
    referee = Referee(TaskSpec(b"\0" * 32, 0, 3), run_op)
    referee.start(0.0)
    [finish] = referee.handle(Failed(1, "frame of 9 GiB exceeds limit"), 1.0)
    assert isinstance(finish, Finish) and finish.verdict.cheaters == (1,)
    assert "exceeds limit" in finish.verdict.reason
    with pytest.raises(LocalProtocolError):
        referee.handle(Timeout(0), 99.0)
    assert referee.stage is Stage.DONE


class StaleWeights:
    """A cheater that skips the update of ``w0`` at ``step`` (keeps the leaf as the new w0)."""

    def __init__(self, toy: ToyTask, step: int) -> None:
        self.toy, self.step = toy, step

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        result = self.toy(state, step, tamper_op)
        if step == self.step:
            result.state["w0"] = np.asarray(state["w0"])
        return result


class WrongData(ToyTask):
    def batch_for(self, step: int) -> dict[str, np.ndarray]:
        data = super().batch_for(step)
        return {**data, "y": flip_low_bit(data["y"])} if step == 2 else data


class WrongStart:
    """Starts step 2 from a perturbed w1 (a state leaf that is not the agreed state)."""

    def __init__(self, toy: ToyTask) -> None:
        self.toy = toy

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        if step == 2:
            state = {**state, "w1": flip_low_bit(state["w1"])}
        return self.toy(state, step, tamper_op)


class OtherLearningRate(ToyTask):
    """A cheater whose step uses another learning rate (other attrs) from ``step`` on."""

    def __init__(self, step: int) -> None:
        super().__init__(data_seed=DATA_SEED)
        self.from_step = step

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        self.lr = 0.07 if step >= self.from_step else 0.05
        return super().__call__(state, step, tamper_op)


@pytest.mark.parametrize("same_program", [True, False])
def test_a_state_binding_to_the_wrong_record_is_a_graph_dispute(same_program: bool) -> None:
    toy = ToyTask(data_seed=DATA_SEED)
    game = play(4, cheat_step=StaleWeights(toy, 1), same_program=same_program)
    v = game.verdict
    # The cheater's state record points w0 at its leaf: the graph itself differs. Against the
    # agreed graph of step 0 the cheater is named; without that rule nobody can be.
    if same_program:
        assert v.cheaters == (1,) and v.reason == "operator graph differs from the previous step's"
        assert v.op_name == "commit:state"
    else:
        assert v.cheaters == () and "operator graph" in v.reason
    assert v.step == 1 and game.recompute.calls == 0 and v.rounds <= game.bound()


@pytest.mark.parametrize(("from_step", "named"), [(0, False), (1, True), (3, True)])
def test_other_attrs_are_named_after_step_0_and_undecided_at_it(
    from_step: int, named: bool
) -> None:
    game = play(4, cheat_step=OtherLearningRate(from_step), cheater=0)
    v = game.verdict
    assert v.step == from_step and v.op_name == "scale" and game.recompute.calls == 0
    assert v.cheaters == ((0,) if named else ()), v


class ExtraOperator(ToyTask):
    """A cheater whose step at ``step`` records one more operator just before the state record."""

    def __init__(self, step: int) -> None:
        super().__init__(data_seed=DATA_SEED)
        self.extra_at = step

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        result = super().__call__(state, step, tamper_op)
        if step == self.extra_at:
            value = run_op("sum", [result.outputs[-1]], b"")
            result.records.append(
                OpRecord("sum", (len(result.records) - 1,), b"", tensor_hash(value))
            )
            result.outputs.append(value)
        return result


class TrailingRecords(Provider):
    """Commits, at step 2, the honest trace followed by two more records (the last a copy of the
    state record, so its leaf still passes the state check): a longer trace with the same prefix."""

    def _traced(self, step: int) -> StepTrace:
        trace = super()._traced(step)
        if step == 2:
            last = trace.records[-1]
            trace.records += [OpRecord("sum", (0,), b"", bytes(32)), last]
            trace.outputs += [None, None]
            trace.tree = MerkleTree([record_leaf(r) for r in trace.records])
            trace.leaf = StepLeaf(step, last.output, len(trace.records), trace.tree.root)
        return trace


@pytest.mark.parametrize("step", [0, 2])
def test_an_extra_operator_is_a_graph_dispute(step: int) -> None:
    game = play(4, cheat_step=ExtraOperator(step))
    v = game.verdict
    assert v.step == step and v.op == game.providers[0].leaves[step].n_ops - 1
    assert v.cheaters == ((1,) if step else ()), v
    assert v.rounds <= game.bound() and game.recompute.calls == 0


def test_records_after_the_state_record_lose_on_the_length_check() -> None:
    game = play(5, cheater_class=TrailingRecords, cheater=0)
    v = game.verdict
    assert v.cheaters == (0,) and v.reason == "records after the step's state record", v
    assert v.step == 2 and v.rounds <= game.bound()


def test_a_wrong_data_leaf_is_caught_by_the_data_oracle() -> None:
    game = play(4, cheat_step=WrongData(data_seed=DATA_SEED))
    v = game.verdict
    assert v.cheaters == (1,) and v.step == 2 and v.op_name == "leaf:y"
    assert game.recompute.calls == 0


def test_a_state_leaf_off_the_agreed_state_is_caught() -> None:
    game = play(4, cheat_step=WrongStart(ToyTask(data_seed=DATA_SEED)), cheater=0)
    v = game.verdict
    assert v.cheaters == (0,) and v.step == 2 and v.op_name == "leaf:w1"


def test_a_false_final_state_hash_with_true_steps_loses() -> None:
    def lie(q: Message, a: Message) -> Message:
        return dataclasses.replace(a, final_state_hash=bytes(32))

    from verify.dispute.wire import CommitmentQuery

    game = play(5, meddle={CommitmentQuery: lie})
    assert game.verdict.cheaters == (1,) and game.verdict.step == 4
    assert "final state hash" in game.verdict.reason


@settings(deadline=None, max_examples=200)
@given(st.binary(max_size=200))
def test_garbage_answers_decode_or_raise_remote_protocol_error(data: bytes) -> None:
    for answer_type in set(ANSWER_TYPES.values()):
        with contextlib.suppress(RemoteProtocolError):
            decode(data, answer_type)


def test_an_oversized_opening_is_refused_by_its_limit() -> None:
    big = OpOpenAnswer(b"", [], [], [], [b"\0" * (OpOpenAnswer.MAX_BYTES + 1)], [], [], b"", [])
    with pytest.raises(LocalProtocolError):
        encode(big)


def test_the_machine_is_sans_io() -> None:
    forbidden = {"trio", "libp2p", "socket", "time", "random", "asyncio", "threading"}
    for rel in ("verify/dispute/game.py", "verify/commit.py", "verify/dispute/wire.py"):
        tree = ast.parse((ROOT / rel).read_text())
        names = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not names & forbidden, (rel, names & forbidden)
    assert {OpOpenQuery, OpPrefixQuery} <= set(ANSWER_TYPES)


def _mutate(value: object, data: st.DataObject) -> object:
    """One random corruption of a wire field (bytes, list, int or str)."""
    if isinstance(value, bytes):
        if not value:
            return data.draw(st.binary(min_size=1, max_size=40))
        kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "random"]))
        if kind == "flip":
            i = data.draw(st.integers(0, len(value) - 1))
            return value[:i] + bytes([value[i] ^ data.draw(st.integers(1, 255))]) + value[i + 1 :]
        if kind == "truncate":
            return value[: data.draw(st.integers(0, len(value) - 1))]
        if kind == "extend":
            return value + data.draw(st.binary(min_size=1, max_size=8))
        return data.draw(st.binary(max_size=len(value) + 8))
    if isinstance(value, list):
        if not value:
            return [data.draw(st.binary(min_size=32, max_size=32))]
        i = data.draw(st.integers(0, len(value) - 1))
        kind = data.draw(st.sampled_from(["drop", "duplicate", "swap", "mutate"]))
        if kind == "drop":
            return value[:i] + value[i + 1 :]
        if kind == "duplicate":
            return [*value[: i + 1], value[i], *value[i + 1 :]]
        if kind == "swap" and len(value) > 1:
            out = list(value)
            out[0], out[-1] = out[-1], out[0]
            return out
        return [*value[:i], _mutate(value[i], data), *value[i + 1 :]]
    if isinstance(value, int):
        return value + data.draw(st.sampled_from([-1, 1, 2**31]))
    if isinstance(value, str):
        return value + "x"
    return value


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_an_honest_provider_never_loses_whatever_the_other_answers(data: st.DataObject) -> None:
    """The property the game exists for: a corrupted, replayed or silent counterpart may lose or
    leave the dispute undecided, but the honest side is never named."""
    steps = data.draw(st.integers(1, 6), label="steps")
    step = data.draw(st.integers(0, steps - 1), label="step")
    op = data.draw(st.sampled_from(non_leaf_ops()), label="op")
    meddled = data.draw(
        st.sets(st.sampled_from(sorted(ANSWER_TYPES, key=lambda t: t.__name__))), label="meddled"
    )

    def corrupt(q: Message, a: Message) -> Message | None:
        kind = data.draw(st.sampled_from(["field", "field", "silent", "honest"]), label="how")
        if kind == "silent":
            return None
        if kind == "honest":
            return a
        name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(a)]), label="field")
        changed = _mutate(getattr(a, name), data)
        try:
            return dataclasses.replace(a, **{name: changed})
        except (ValueError, TypeError):
            return a

    cheater = data.draw(st.sampled_from([0, 1]), label="cheater")
    game = play(steps, tamper=(step, op), cheater=cheater, meddle=dict.fromkeys(meddled, corrupt))
    assert game.verdict.cheaters in ((), (cheater,)), game.verdict
    if not meddled:
        assert_caught(game, cheater, step, op)
    assert game.recompute.calls <= 1
