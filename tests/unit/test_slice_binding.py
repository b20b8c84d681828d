"""Issue 19 point 2: a verified peer's signed slices bound to its task, up to the referee's
ruling (``swarmtrain.verified.binding``, ``swarm.misbound``), from a real RepOps task of a tiny
model: who lied is named from the evidence alone, and unusable evidence names nobody."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from diloco import Corpus
from p2p import RecordSigner, decode, encode, verify_peer_signature
from swarm.averaging.audit import (
    MAX_SLICE_DISPUTES,
    AuditRecord,
    PartAudit,
    SliceDispute,
    decode_audits,
    encode_audits,
    merge_records,
    misbound,
    proof_message,
    slice_hash,
    split_record,
)
from swarmtrain.config import config_from_mapping
from swarmtrain.verified.binding import (
    TaskStateQuery,
    answer_state,
    covering,
    param_ranges,
    rule_slice,
)
from swarmtrain.verified.plan import SLICE, Verdict
from swarmtrain.verified.task import make_task, model_shape, param_layout, run_traced
from verify.repops import init_params

RUN, ROUND, GROUP = "run-binding", 1, b"g" * 32
OWNER = RecordSigner(b"\x01" * 32)
VERIFIER = RecordSigner(b"\x02" * 32)
OUT = b"o" * 32


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    """A real two-step task of a one-layer model, traced as a verifier runs it."""
    config = config_from_mapping(
        {
            "run": {"id": RUN},
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 8},
            "training": {"inner_steps": 2, "batch_size": 2, "sequence_length": 8},
            "verify": {"rate": 1.0},
        }
    )
    data = np.frombuffer(bytes(range(256)) * 8, np.uint8)
    corpus = Corpus(data[:1800], data[1800:], (), (), "test")
    params = init_params(model_shape(config), seed=3)
    made = make_task(config, corpus, 7, ROUND, OWNER.peer_id, params)
    provider = run_traced(made)
    ranges = param_ranges(param_layout(config))
    flat_start = np.concatenate([params[r.name].reshape(-1) for r in ranges])
    final = provider.final_state
    flat_final = np.concatenate([final[r.name].reshape(-1) for r in ranges])
    owed = np.subtract(flat_start, flat_final, dtype=np.float32)
    return config, made, provider, owed


def _dispute(owed: np.ndarray, start: int, stop: int, values: np.ndarray) -> SliceDispute:
    digest = slice_hash(values)
    proof = OWNER.sign_message(proof_message(RUN, ROUND, GROUP, 0, 1.0, digest))
    return SliceDispute(0, start, stop, OWNER.peer_id, 1.0, digest, proof)


def _answers(provider, ranges, dispute):  # type: ignore[no-untyped-def]
    names = [r.name for r in covering(ranges, dispute.start, dispute.stop)]
    task_id = provider.task.task_id
    return (
        answer_state(provider, TaskStateQuery(task_id, 0, names)),
        answer_state(provider, TaskStateQuery(task_id, provider.task.steps, names)),
    )


def _rule(task, dispute, start=None, final=None):  # type: ignore[no-untyped-def]
    config, made, provider, _ = task
    ranges = param_ranges(param_layout(config))
    served = _answers(provider, ranges, dispute)
    return rule_slice(
        dispute,
        ranges,
        start or served[0],
        final or served[1],
        made.spec.start_state_hash,
        provider.commitment.final_state_hash,
    )


def test_a_signed_slice_other_than_the_tasks_pseudo_gradient_is_ruled_guilty(task) -> None:  # type: ignore[no-untyped-def]
    owed = task[3]
    start, stop = 100, 700  # spans several parameters
    dispute = _dispute(owed, start, stop, owed[start:stop] * np.float32(1.5))
    message = proof_message(RUN, ROUND, GROUP, 0, 1.0, dispute.digest)
    assert verify_peer_signature(OWNER.peer_id, message, dispute.proof)
    ruling = _rule(task, dispute)
    assert ruling.guilty is True, ruling


def test_an_accusation_of_the_exact_pseudo_gradient_turns_on_the_accuser(task) -> None:  # type: ignore[no-untyped-def]
    owed = task[3]
    for start, stop in [(0, 1), (100, 700), (len(owed) - 5, len(owed))]:
        ruling = _rule(task, _dispute(owed, start, stop, owed[start:stop]))
        assert ruling.guilty is False, (start, stop, ruling)


def test_states_that_do_not_hash_to_the_commitment_rule_on_nobody(task) -> None:  # type: ignore[no-untyped-def]
    config, _, provider, owed = task
    dispute = _dispute(owed, 10, 50, owed[10:50] + 1)
    ranges = param_ranges(param_layout(config))
    start, final = _answers(provider, ranges, dispute)
    # A verifier serving the start state as the final one (or any other bytes) proves nothing.
    assert _rule(task, dispute, final=start).guilty is None
    swapped = replace(final, tensors=[start.tensors[0], *final.tensors[1:]])
    assert "listed hash" in _rule(task, dispute, final=swapped).reason
    relabelled = replace(final, hashes=[*final.hashes[:-1], b"\0" * 32])
    assert "committed hash" in _rule(task, dispute, final=relabelled).reason
    outside = replace(dispute, start=len(owed), stop=len(owed) + 4)
    assert _rule(task, outside, start, final).guilty is None


def test_the_state_query_refuses_unknown_steps_and_names(task) -> None:  # type: ignore[no-untyped-def]
    provider = task[2]
    with pytest.raises(ValueError, match="no state"):
        answer_state(provider, TaskStateQuery(provider.task.task_id, 99, []))
    with pytest.raises(ValueError, match="unknown tensor"):
        answer_state(provider, TaskStateQuery(provider.task.task_id, 0, ["nope"]))
    query = TaskStateQuery(provider.task.task_id, 0, ["embed.weight"])
    assert decode(encode(query), TaskStateQuery) == query


def test_misbound_finds_only_the_parts_whose_claimed_hash_differs(task) -> None:  # type: ignore[no-untyped-def]
    owed = task[3]
    owner, other = OWNER.peer_id, VERIFIER.peer_id
    honest = slice_hash(owed[0:300])
    wrong = slice_hash(owed[300:600] * 2)
    claims = (
        PartAudit(
            0, 0, 300, ((owner, 1.0, honest, b"p"), (other, 1.0, b"x" * 32, b"q")), b"o" * 32
        ),
        PartAudit(1, 300, 600, ((owner, 1.0, wrong, b"p"),), OUT),
    )
    record = AuditRecord(ROUND, GROUP, (owner, other), claims)
    found = misbound(record, owner, owed)
    assert [(d.part, d.start, d.stop, d.digest) for d in found] == [(1, 300, 600, wrong)]
    assert misbound(record, other, owed)[0].part == 0  # another peer's input, checked alike


def test_a_reducer_refusing_a_slice_gives_the_verifier_its_evidence(task) -> None:  # type: ignore[no-untyped-def]
    """Issue 19: a reducer that is no verifier refused an owner's slice against its committed
    contribution and published it signed; the task's verifier takes it up (``misbound``) only
    when it is not what the task owes, so the referee rules with the verifier as accuser."""
    owed = task[3]
    lied = _dispute(owed, 100, 700, owed[100:700] * np.float32(1.5))
    honest = replace(_dispute(owed, 0, 100, owed[0:100]), part=1)
    record = AuditRecord(ROUND, GROUP, (b"r",), (), (), (lied, honest))
    assert misbound(record, OWNER.peer_id, owed) == [lied]
    assert misbound(record, VERIFIER.peer_id, owed) == []


def test_slice_disputes_travel_in_audit_records_bounded(task) -> None:  # type: ignore[no-untyped-def]
    owed = task[3]
    disputes = tuple(
        replace(_dispute(owed, 0, 8, owed[:8] + 1), part=p) for p in range(MAX_SLICE_DISPUTES)
    )
    record = AuditRecord(ROUND, GROUP, (b"r",), (), (), disputes)
    assert decode_audits(encode_audits(record)) == record
    halves = [AuditRecord(ROUND, GROUP, (b"r",), (), (), disputes[:5]), record]
    assert merge_records(halves) == record
    assert len(split_record(record)) == 1
    with pytest.raises(ValueError, match="at most"):
        AuditRecord(ROUND, GROUP, (b"r",), (), (), (*disputes, disputes[0]))
    with pytest.raises(ValueError):
        replace(disputes[0], weight=float("nan"))
    with pytest.raises(ValueError):
        replace(disputes[0], digest=b"short")


def test_a_slice_verdict_says_what_was_wrong() -> None:
    owner, verifier = OWNER.peer_id, VERIFIER.peer_id
    guilty = Verdict(2, owner, verifier, owner, None, 1, SLICE, "r")
    assert "a slice other than its task's pseudo-gradient" in guilty.describe()
    false = Verdict(2, owner, verifier, verifier, None, 1, SLICE, "r")
    assert "false accusation" in false.describe()
