"""Auditable aggregation: reducers' claims from real machines, signed slices, the referee's
recheck."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allreduce import FakeNetwork, build, make_vectors, round_setup

from p2p import RecordSigner, verify_peer_signature
from swarm.averaging.audit import (
    MAX_AUDIT_RECORD_BYTES,
    MAX_AUDITED_PARTS,
    AuditRecord,
    PartAudit,
    audited,
    audits_of,
    contested,
    decode_audits,
    encode_audits,
    merge_records,
    proof_message,
    recheck,
    records_by_group,
    slice_hash,
    split_record,
)

RUN, ROUND, GROUP = "run", 3, b"g" * 32


def _signers(net: FakeNetwork) -> dict[bytes, RecordSigner]:
    """A real Ed25519 identity per machine, its peer id in place of the fake network's."""
    return {peer: RecordSigner(bytes([i + 1]) * 32) for i, peer in enumerate(net.ids)}


def _proofs(net: FakeNetwork, signers: dict[bytes, RecordSigner]) -> dict:
    """What every contributor signs for each of its slices (as a session does)."""
    out = {}
    for peer in net.ids:
        for p, (_, start, stop) in enumerate(net.machines[peer].parts):
            digest = slice_hash(net.vectors[peer][start:stop])
            message = proof_message(RUN, ROUND, GROUP, p, net.weights[peer], digest)
            out[(p, peer)] = signers[peer].sign_message(message)
    return out


def _checker(net: FakeNetwork, signers: dict[bytes, RecordSigner], part: int):  # type: ignore[no-untyped-def]
    ids = {peer: signer.peer_id for peer, signer in signers.items()}

    def valid(peer: bytes, weight: float, digest: bytes, proof: bytes) -> bool:
        message = proof_message(RUN, ROUND, GROUP, part, weight, digest)
        return verify_peer_signature(ids[peer], message, proof)

    return valid


def _slices(net: FakeNetwork, audit: PartAudit) -> dict[bytes, np.ndarray]:
    """What each contributor serves the referee: its slice of the part."""
    return {peer: net.vectors[peer][audit.start : audit.stop] for peer, *_ in audit.inputs}


@settings(max_examples=30, deadline=None)
@given(round_setup)
def test_every_part_is_claimed_once_with_signed_inputs_and_rechecks_equal(setup) -> None:
    net = build(setup)
    net.start()
    net.run()
    signers = _signers(net)
    proofs = _proofs(net, signers)
    claims = {}
    for peer in net.ids:
        for audit in audits_of(net.machines[peer], proofs):
            assert audit.part not in claims, "two reducers claim one part"
            claims[audit.part] = audit
    assert sorted(claims) == list(range(len(net.machines[net.ids[0]].parts)))
    for audit in claims.values():
        assert [p for p, *_ in audit.inputs] == sorted(net.ids)
        ruling = recheck(audit, _slices(net, audit), _checker(net, signers, audit.part))
        assert ruling.ok is True, ruling


def test_a_crashed_peers_reassigned_parts_are_claimed_by_their_new_reducer() -> None:
    rng = random.Random(3)
    net = FakeNetwork(make_vectors(rng, 4, 200), [1.0, 2.0, 1.0, 0.5], [1, 1, 1, 1], rng)
    net.start([p for p in net.ids if p != net.ids[1]])
    net.crash(net.ids[1])  # before it sent anything: excluded, its part reduced by the next
    net.run()
    signers = _signers(net)
    proofs = _proofs(net, signers)
    claims = [a for p in net.survivors() for a in audits_of(net.machines[p], proofs)]
    assert sorted(a.part for a in claims) == [0, 1, 2, 3]
    for audit in claims:
        assert net.ids[1] not in [p for p, *_ in audit.inputs]
        assert recheck(audit, _slices(net, audit), _checker(net, signers, audit.part)).ok


def _one_claim() -> tuple[FakeNetwork, dict[bytes, RecordSigner], PartAudit]:
    rng = random.Random(7)
    net = FakeNetwork(make_vectors(rng, 3, 90), [1.0, 2.0, 3.0], [1, 1, 1], rng)
    net.start()
    net.run()
    signers = _signers(net)
    return net, signers, audits_of(net.machines[net.ids[0]], _proofs(net, signers))[0]


def test_a_wrong_output_names_the_reducer() -> None:
    net, signers, audit = _one_claim()
    lie = replace(audit, output=slice_hash(np.ones(1)))
    ruling = recheck(lie, _slices(net, audit), _checker(net, signers, audit.part))
    assert ruling.ok is False and ruling.contributor is None
    assert "not the mean of its inputs" in ruling.reason


def test_an_input_nobody_signed_names_the_reducer() -> None:
    """A reducer claiming to have summed other bytes from a contributor cannot show that
    contributor's signature over them."""
    net, signers, audit = _one_claim()
    victim = net.ids[2]
    forged = tuple(
        (p, w, slice_hash(np.zeros(3)) if p == victim else h, proof)
        for p, w, h, proof in audit.inputs
    )
    ruling = recheck(
        replace(audit, inputs=forged), _slices(net, audit), _checker(net, signers, audit.part)
    )
    assert ruling.ok is False and ruling.contributor is None and "never signed" in ruling.reason


def test_a_contributor_serving_other_bytes_than_it_signed_is_named() -> None:
    net, signers, audit = _one_claim()
    slices = _slices(net, audit)
    liar = net.ids[2]
    changed = slices[liar].copy()
    changed[0] += 1
    ruling = recheck(audit, {**slices, liar: changed}, _checker(net, signers, audit.part))
    assert ruling.ok is False and ruling.contributor == liar
    del slices[net.ids[1]]
    ruling = recheck(audit, slices, _checker(net, signers, audit.part))
    assert ruling.ok is None and "no slice" in ruling.reason


def test_a_contributor_contests_a_claim_that_lists_an_input_it_did_not_send() -> None:
    net, _, audit = _one_claim()
    me, other = net.ids[1], net.ids[2]

    def hashes(peer: bytes) -> list[bytes]:
        return [slice_hash(net.vectors[peer][a:b]) for _, a, b in net.machines[peer].parts]

    mine = hashes(me)
    honest = AuditRecord(0, b"g", tuple(net.ids), (audit,))
    assert contested(honest, me, mine) == []
    forged = tuple(
        (p, w, slice_hash(np.zeros(3)) if p == me else h, s) for p, w, h, s in audit.inputs
    )
    lying = AuditRecord(0, b"g", tuple(net.ids), (replace(audit, inputs=forged),), (2,))
    assert contested(lying, me, mine) == [audit.part]
    assert contested(lying, other, hashes(other)) == []  # its input is claimed right
    assert decode_audits(encode_audits(lying)) == lying  # the disputed parts travel too


def test_records_round_trip_and_garbage_decodes_to_none() -> None:
    net, _, audit = _one_claim()
    record = AuditRecord(5, b"g" * 32, tuple(net.ids), (audit,))
    assert decode_audits(encode_audits(record)) == record
    entry = [b"a", 1.0, b"h" * 32, b"s" * 64]

    def value(*body: object, version: int = 1) -> bytes:
        return msgpack.packb([version, AuditRecord.TYPE_CODE, list(body)])

    for bad in (
        b"",
        b"\xc1",
        value(5, b"g", [], [], [], version=2),
        msgpack.packb([1, PartAudit.TYPE_CODE, [0, 0, 1, [entry], b"o" * 32]]),  # another type
        value(5, b"g", ["not bytes"], [], []),
        value(5, b"g", [], [[0, 5, 1, [entry], b"o" * 32]], []),
        value(5, b"g", [], [[0, 0, 1, [[b"a", -1.0, *entry[2:]]], b"o" * 32]], []),
        value(5, b"g", [], [[0, 0, 1, [[*entry[:2], b"short", entry[3]]], b"o"]], []),
        value(5, b"g", [], [[0, 0, 1, [[*entry[:3], b"s" * 500]], b"o" * 32]], []),
        value(5, b"g", [], [[0, 0, 1, [], b"o" * 32]], []),
        value(5, b"g", [], [[0, 0, 1, [entry[:3]], b"o" * 32]], []),  # an input of 3 fields
        value(5, b"g", [], [], [-1]),
        b"\x00" * (MAX_AUDIT_RECORD_BYTES + 1),
    ):
        assert decode_audits(bad) is None


@given(st.binary(max_size=400))
def test_the_record_decoder_never_raises(data: bytes) -> None:
    decode_audits(data)


def test_a_big_record_splits_into_values_that_each_fit_and_merge_back() -> None:
    """A member that took over lost peers' parts may claim more than one value holds."""
    members = [bytes([i]) * 38 for i in range(64)]
    inputs = tuple((m, 1.0, b"h" * 32, b"s" * 64) for m in members)
    claims = tuple(PartAudit(p, 0, 10, inputs, b"o" * 32) for p in range(4))
    reducers = tuple(members[p % 64] for p in range(MAX_AUDITED_PARTS))
    record = AuditRecord(7, b"g" * 32, reducers, claims, (1, 2))
    with pytest.raises(ValueError, match="over the limit"):
        encode_audits(record)
    values = split_record(record)
    assert len(values) > 1 and all(len(v) <= MAX_AUDIT_RECORD_BYTES for v in values)
    decoded = [decode_audits(v) for v in values]
    assert all(d is not None for d in decoded)
    assert merge_records(decoded) == record  # type: ignore[arg-type]
    other = replace(record, round=8, audits=())
    assert merge_records([*decoded, other]) is None  # type: ignore[list-item]


def test_the_audit_draw_follows_the_rate() -> None:
    draws = [audited("run", r, b"g", p, 0.3, 10) for r in range(100) for p in range(10)]
    assert 0.24 < sum(draws) / len(draws) < 0.36
    assert not audited("run", 0, b"g", 0, 0.0, 10)
    assert all(audited("run", r, b"g", 1, 1.0, 10) for r in range(20))
    # A round cut into more parts than one record can describe is not audited at all.
    assert not any(audited("run", r, b"g", 1, 1.0, MAX_AUDITED_PARTS + 1) for r in range(20))


def test_a_rounds_records_group_by_group_with_each_members_values_merged() -> None:
    net, _, audit = _one_claim()
    a, b = net.ids[0], net.ids[1]
    first = AuditRecord(5, b"g1", tuple(net.ids), (audit,))
    second = AuditRecord(5, b"g1", tuple(net.ids), (replace(audit, part=1),), (2,))
    other = AuditRecord(5, b"g2", tuple(net.ids), ())
    stale = AuditRecord(4, b"g1", tuple(net.ids), ())
    groups = records_by_group([(a, first), (a, second), (b, other), (b, stale)], 5)
    assert set(groups) == {b"g1", b"g2"} and set(groups[b"g1"]) == {a}
    assert groups[b"g1"][a] == merge_records([first, second])
    assert groups[b"g2"] == {b: other}
