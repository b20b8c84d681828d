"""The dispatch trace (issue 23 point 3): any model's step recorded by ``RepOpsMode`` as its aten
operator list, the same bytes at one and two threads, every record recomputed from its inputs by
the referee's ``recompute``, and the dispute game over a tampered operator of a Llama-style
model naming the cheater, the step and the operator, at the first and last step and operator."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from diloco.causal_lm import build_causal_lm
from verify.commit import StepTrace, TaskSpec, encode_record
from verify.dispatch import (
    CONST_OP,
    DispatchStep,
    Recorder,
    RepOpsMode,
    TraceError,
    UnmappedOperator,
    recompute,
    tamperable,
)
from verify.dispute.game import Answered, Finish, Referee, Verdict
from verify.dispute.provider import Provider
from verify.trace import state_hash, tensor_hash

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 16}  # fmt: skip
STEPS = 2
SEED = 4


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([SEED, step])
    tokens = rng.integers(0, LLAMA["vocab_size"], (2, 9))  # type: ignore[call-overload]
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def data_leaf(step: int, label: str, attrs: bytes) -> bytes | None:
    labels = {"inputs": 0, "targets": 1}
    return tensor_hash(batch(step)[labels[label]]) if label in labels else None


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama() -> DispatchStep:
    return DispatchStep(build_causal_lm(LLAMA, seed=0), batch)


@pytest.fixture(scope="module")
def honest(llama: DispatchStep) -> Provider:
    provider = Provider(llama, llama.initial_state(), task_of(llama))
    provider.run()
    return provider


def task_of(step: DispatchStep) -> TaskSpec:
    return TaskSpec(state_hash(step.initial_state()), SEED, STEPS)


def test_the_trace_is_the_same_bytes_at_one_and_two_threads(llama: DispatchStep) -> None:
    torch.set_num_threads(1)
    one = StepTrace(0, llama(llama.initial_state(), 0))
    torch.set_num_threads(2)
    two = StepTrace(0, llama(llama.initial_state(), 0))
    assert [encode_record(r) for r in one.records] == [encode_record(r) for r in two.records]
    assert one.leaf == two.leaf
    names = {r.name for r in one.records}
    assert {"aten.mm.default", "aten._safe_softmax.default", "aten._fused_adamw_.default"} <= names
    assert "leaf:inputs" in names and "leaf:adamw.step" in names


def test_every_record_is_recomputed_from_its_inputs(llama: DispatchStep) -> None:
    """What the referee does with the one disputed record, done to all of them."""
    result = llama(llama.initial_state(), 1)
    checked = 0
    for record in result.records:
        if record.is_leaf:
            continue
        inputs = [result.outputs[k] for k in record.inputs]
        assert tensor_hash(recompute(record.name, inputs, record.attrs)) == record.output, record
        checked += 1
    assert checked > 300


def play(step: DispatchStep, honest: Provider, tamper: tuple[int, int]) -> Verdict:
    cheater = Provider(step, step.initial_state(), task_of(step), tamper=tamper)
    cheater.run()
    providers = [honest, cheater]
    referee = Referee(task_of(step), recompute, leaf_oracle=data_leaf)
    actions = referee.start(0.0)
    while not any(isinstance(a, Finish) for a in actions):
        answers = [Answered(q.party, providers[q.party].answer(q.request)) for q in actions]  # type: ignore[union-attr]
        actions = [out for answer in answers for out in referee.handle(answer, 0.0)]
    return next(a for a in actions if isinstance(a, Finish)).verdict


@pytest.mark.parametrize("where", ["first step, first op", "last step, last op",
                                   "first step, last op", "last step, first op"])  # fmt: skip
def test_a_tampered_operator_of_a_llama_model_is_named(
    llama: DispatchStep, honest: Provider, where: str
) -> None:
    records = llama(llama.initial_state(), 0).records
    ops = [i for i, record in enumerate(records) if tamperable(record)]
    step = 0 if where.startswith("first step") else STEPS - 1
    op = ops[0] if where.endswith("first op") else ops[-1]
    verdict = play(llama, honest, (step, op))
    assert (verdict.cheaters, verdict.step, verdict.op) == ((1,), step, op), verdict
    assert verdict.op_name == records[op].name and verdict.reason.startswith("output differs")
    assert verdict.ops_recomputed == 1
    n_ops = honest.leaves[0].n_ops
    assert verdict.rounds <= math.ceil(math.log2(STEPS)) + math.ceil(math.log2(n_ops)) + 4
    if where == "last step, last op":  # the fused AdamW: its last written tensor
        assert verdict.op_name == "aten._fused_adamw_.default"


def test_a_view_and_a_leaf_cannot_be_tampered_with(llama: DispatchStep) -> None:
    records = llama(llama.initial_state(), 0).records
    view = next(i for i, r in enumerate(records) if r.name == "aten.view.default")
    assert not tamperable(records[view]) and not tamperable(records[0])
    with pytest.raises(ValueError, match=rf"tamper_op {view} is a view \(aten\.view\.default\)"):
        llama(llama.initial_state(), 0, tamper_op=view)
    with pytest.raises(ValueError, match="tamper_op 0 is not an operator"):
        llama(llama.initial_state(), 0, tamper_op=0)


class _Cumulative(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(self.weight * inputs.float(), 0).sum()


def test_an_unmapped_operator_stops_the_traced_step_with_its_name() -> None:
    step = DispatchStep(_Cumulative(), lambda i: (np.arange(4), np.arange(4)))
    name = r"aten\.logcumsumexp\.default has no RepOps mapping"
    with pytest.raises(UnmappedOperator, match=name):
        step(step.initial_state(), 0)


def test_a_small_outside_tensor_is_a_constant_and_a_large_one_is_refused() -> None:
    recorder = Recorder()
    x = torch.arange(6, dtype=torch.float32)
    recorder.leaf("x", x)
    small, large = torch.full((6,), 0.5), torch.ones(5000)  # made outside the mode
    with RepOpsMode(recorder):
        x + small
    const = next(r for r in recorder.records if r.name == CONST_OP)
    assert tensor_hash(recompute(CONST_OP, [], const.attrs)) == const.output
    assert [r.name for r in recorder.records] == ["leaf:x", CONST_OP, "aten.add.Tensor"]
    outside = r"aten\.add\.Tensor: tensor argument 1, of shape \(5000,\), was made outside"
    with pytest.raises(TraceError, match=outside), RepOpsMode(Recorder()):
        torch.zeros(5000) + large


def test_a_tensor_changed_through_another_view_is_refused() -> None:
    recorder = Recorder()
    base = torch.zeros(4, 4)
    recorder.leaf("base", base)
    with pytest.raises(TraceError, match="changed in place through another view"):  # noqa: SIM117
        with RepOpsMode(recorder):
            row = base[0]
            row.add_(1.0)  # base's record no longer holds its values
            torch.mul(base, 2.0)


TENSOR = msgpack.ExtType(1, (0).to_bytes(4, "little"))
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(), st.text(max_size=3),
    st.just(TENSOR), st.lists(st.integers(-3, 3), max_size=3),
)  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(st.one_of(
    st.binary(max_size=64),
    st.tuples(st.lists(VALUES, max_size=4), st.integers(-1, 2)).map(
        lambda c: msgpack.packb([c[0], {}, c[1]])
    ),
))  # fmt: skip
# Found by hypothesis: two ints where add wants a tensor (the kernel read ``.device`` of an int).
@example(attrs=b"\x93\x93\x00\x00\xd6\x01\x00\x00\x00\x00\x80\x00")
def test_recompute_refuses_garbage_attrs_with_value_error(attrs: bytes) -> None:
    """What a lying provider can send the referee: garbage is a ValueError, never a crash."""
    with contextlib.suppress(ValueError):
        out = recompute("aten.add.Tensor", [np.ones(2, np.float32)], attrs)
        assert isinstance(out, np.ndarray)


def test_recompute_refuses_names_outside_aten_and_wrong_tensor_counts() -> None:
    attrs = msgpack.packb([[TENSOR], {}, 0])
    assert recompute("aten.neg.default", [np.ones(2, np.float32)], attrs).tolist() == [-1, -1]
    for name in ("os.system.default", "aten.nope.default", "aten.neg"):
        with pytest.raises(ValueError, match="aten operator"):
            recompute(name, [np.ones(2, np.float32)], attrs)
    with pytest.raises(ValueError, match="1 of the 2 input tensors"):
        recompute("aten.neg.default", [np.ones(2, np.float32)] * 2, attrs)
