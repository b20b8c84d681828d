"""Auditable aggregation: reducers' claims from real machines, and the referee's recheck."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allreduce import FakeNetwork, build, make_vectors, round_setup

from swarm.aggregation_audit import (
    MAX_AUDIT_RECORD_BYTES,
    MAX_AUDITED_PARTS,
    AuditRecord,
    PartAudit,
    audited,
    audits_of,
    contested,
    decode_audits,
    encode_audits,
    recheck,
    slice_hash,
)


def _slices(net: FakeNetwork, audit: PartAudit) -> dict[bytes, np.ndarray]:
    """What each contributor would serve the referee: its slice of the part."""
    return {peer: net.vectors[peer][audit.start : audit.stop] for peer, _, _ in audit.inputs}


@settings(max_examples=40, deadline=None)
@given(round_setup)
def test_every_part_is_claimed_once_and_rechecks_equal(setup) -> None:
    net = build(setup)
    net.start()
    net.run()
    claims = {}
    for peer in net.ids:
        for audit in audits_of(net.machines[peer]):
            assert audit.part not in claims, "two reducers claim one part"
            claims[audit.part] = audit
    machine = net.machines[net.ids[0]]
    assert sorted(claims) == list(range(len(machine.parts)))
    for audit in claims.values():
        assert [p for p, _, _ in audit.inputs] == sorted(net.ids)
        assert recheck(audit, _slices(net, audit)) == (
            True,
            f"part {audit.part}: output recomputed, equal",
        )


def test_a_crashed_peers_reassigned_parts_are_claimed_by_their_new_reducer() -> None:
    rng = random.Random(3)
    net = FakeNetwork(make_vectors(rng, 4, 200), [1.0, 2.0, 1.0, 0.5], [1, 1, 1, 1], rng)
    net.start([p for p in net.ids if p != net.ids[1]])
    net.crash(net.ids[1])  # before it sent anything: excluded, its part reduced by the next
    net.run()
    claims = [a for p in net.survivors() for a in audits_of(net.machines[p])]
    assert sorted(a.part for a in claims) == [0, 1, 2, 3]
    for audit in claims:
        assert net.ids[1] not in [p for p, _, _ in audit.inputs]
        assert recheck(audit, _slices(net, audit))[0] is True


def _one_claim() -> tuple[FakeNetwork, PartAudit]:
    rng = random.Random(7)
    net = FakeNetwork(make_vectors(rng, 3, 90), [1.0, 2.0, 3.0], [1, 1, 1], rng)
    net.start()
    net.run()
    return net, audits_of(net.machines[net.ids[0]])[0]


def test_a_wrong_output_names_the_reducer() -> None:
    net, audit = _one_claim()
    lie = PartAudit(audit.part, audit.start, audit.stop, audit.inputs, slice_hash(np.ones(1)))
    ok, why = recheck(lie, _slices(net, audit))
    assert ok is False and "not the mean of its inputs" in why


def test_a_slice_that_differs_from_the_claim_names_nobody() -> None:
    net, audit = _one_claim()
    slices = _slices(net, audit)
    changed = slices[net.ids[2]].copy()
    changed[0] += 1
    ok, why = recheck(audit, {**slices, net.ids[2]: changed})
    assert ok is None and "differs from the reducer's claimed input" in why
    del slices[net.ids[1]]
    ok, why = recheck(audit, slices)
    assert ok is None and "no slice" in why


def test_records_round_trip_and_garbage_decodes_to_none() -> None:
    net, audit = _one_claim()
    record = AuditRecord(5, b"g" * 32, tuple(net.ids), (audit,))
    assert decode_audits(encode_audits(record)) == record
    for bad in (
        b"",
        b"\xc1",
        msgpack.packb([2, 5, b"g", [], []]),
        msgpack.packb([1, 5, b"g", ["not bytes"], []]),
        msgpack.packb([1, 5, b"g", [], [[0, 5, 1, [[b"a", 1.0, b"h" * 32]], b"o" * 32]]]),
        msgpack.packb([1, 5, b"g", [], [[0, 0, 1, [[b"a", -1.0, b"h" * 32]], b"o" * 32]]]),
        msgpack.packb([1, 5, b"g", [], [[0, 0, 1, [[b"a", 1.0, b"short"]], b"o" * 32]]]),
        msgpack.packb([1, 5, b"g", [], [[0, 0, 1, [], b"o" * 32]]]),
        b"\x00" * (MAX_AUDIT_RECORD_BYTES + 1),
    ):
        assert decode_audits(bad) is None
    too_big = AuditRecord(5, b"g", (), (audit,) * 200)
    with pytest.raises(ValueError, match="over the limit"):
        encode_audits(too_big)


@given(st.binary(max_size=400))
def test_the_record_decoder_never_raises(data: bytes) -> None:
    decode_audits(data)


def test_the_audit_draw_follows_the_rate() -> None:
    draws = [audited("run", r, b"g", p, 0.3, 10) for r in range(100) for p in range(10)]
    assert 0.24 < sum(draws) / len(draws) < 0.36
    assert not audited("run", 0, b"g", 0, 0.0, 10)
    assert all(audited("run", r, b"g", 1, 1.0, 10) for r in range(20))
    # A round cut into more parts than one record can describe is not audited at all.
    assert not any(audited("run", r, b"g", 1, 1.0, MAX_AUDITED_PARTS + 1) for r in range(20))


def test_a_member_record_at_the_audited_limit_fits_one_dht_value() -> None:
    """The worst ordinary case: MAX_AUDITED_PARTS parts among 64 members, a member reducing its
    share of them (two parts) with 64 inputs each, peer ids of libp2p's 38 bytes."""
    members = [bytes([i]) * 38 for i in range(64)]
    inputs = tuple((m, 1.0, b"h" * 32) for m in members)
    claims = tuple(PartAudit(p, 0, 10, inputs, b"o" * 32) for p in range(2))
    record = AuditRecord(7, b"g" * 32, tuple(members[p % 64] for p in range(MAX_AUDITED_PARTS)),
                         claims, tuple(range(8)))  # fmt: skip
    assert len(encode_audits(record)) <= MAX_AUDIT_RECORD_BYTES


def test_a_contributor_contests_a_claim_that_lists_an_input_it_did_not_send() -> None:
    net, audit = _one_claim()
    me, other = net.ids[1], net.ids[2]

    def hashes(peer: bytes) -> list[bytes]:
        return [slice_hash(net.vectors[peer][a:b]) for _, a, b in net.machines[peer].parts]

    mine = hashes(me)
    honest = AuditRecord(0, b"g", tuple(net.ids), (audit,))
    assert contested(honest, me, mine) == []
    forged = tuple((p, w, slice_hash(np.zeros(3)) if p == me else h) for p, w, h in audit.inputs)
    lying = AuditRecord(0, b"g", tuple(net.ids), (replace(audit, inputs=forged),), (2,))
    assert contested(lying, me, mine) == [audit.part]
    assert contested(lying, other, hashes(other)) == []  # its input is claimed right
    assert decode_audits(encode_audits(lying)) == lying  # the disputed parts travel too
