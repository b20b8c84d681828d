"""The verified run's plan: who re-executes which task, what peers publish, how a peer decides."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p import RemoteProtocolError
from swarmtrain.verified.plan import (
    AGGREGATION,
    CONTRIBUTION_DIFFERS,
    MAX_AUDIT_RESULTS,
    MAX_CLAIMS,
    MAX_NEWCOMERS,
    MAX_VERDICTS_BYTES,
    SLICE,
    Assignment,
    AuditResult,
    AuditResultList,
    ClaimsRecord,
    Decision,
    RoundClaims,
    Verdict,
    VerdictList,
    assignments,
    banned,
    decide,
    decide_all,
    decode_audit_results,
    decode_verdicts,
    disputes,
    encode_audit_results,
    encode_verdicts,
    majority_start,
    newcomers,
    selected,
    task_seed,
    verifier_of,
)
from verify.commit import Commitment

PEERS = [hashlib.sha256(bytes([i])).digest()[:20] + bytes([i]) for i in range(8)]
H = [hashlib.sha256(b"h%d" % i).digest() for i in range(6)]


def _claim(i: int) -> Commitment:
    return Commitment(4, H[i], H[i + 1])


def test_selection_follows_the_rate_and_does_not_depend_on_who_asks() -> None:
    draws = [selected("run", r, p, 0.25) for r in range(200) for p in PEERS]
    assert 0.18 < sum(draws) / len(draws) < 0.32
    assert not any(selected("run", r, p, 0.0) for r in range(50) for p in PEERS)
    assert all(selected("run", r, p, 1.0) for r in range(50) for p in PEERS)
    # Another run or round draws differently (the owner cannot pick a round it is never checked).
    assert [selected("a", 0, p, 0.5) for p in PEERS] != [selected("b", 0, p, 0.5) for p in PEERS]


def test_the_verifier_is_another_member_and_the_same_whatever_the_member_order() -> None:
    members = PEERS[:5]
    for r in range(20):
        for owner in members:
            v = verifier_of("run", r, owner, members)
            assert v in members and v != owner
            assert v == verifier_of("run", r, owner, list(reversed(members)))
    assert verifier_of("run", 0, PEERS[0], [PEERS[0]]) is None
    # Verifiers rotate: over many rounds each owner meets several.
    assert len({verifier_of("run", r, PEERS[0], members) for r in range(40)}) >= 3


def test_assignments_cover_the_selected_owners_only() -> None:
    plan = assignments("run", 3, PEERS[:4], 1.0)
    assert [a.owner for a in plan] == sorted(PEERS[:4])
    assert assignments("run", 3, PEERS[:1], 1.0) == []  # nobody to verify a lone member
    assert assignments("run", 3, PEERS[:4], 0.0) == []


def test_task_seeds_differ_per_round_and_owner() -> None:
    seeds = {task_seed("run", r, p) for r in range(10) for p in PEERS}
    assert len(seeds) == 80 and all(0 <= s < 2**63 for s in seeds)


def test_claims_round_trip_and_garbage_claims_nothing() -> None:
    record = RoundClaims(H[0], {PEERS[0]: _claim(1), PEERS[1]: _claim(2)})
    assert RoundClaims.from_bytes(record.to_bytes()) == record
    code = ClaimsRecord.TYPE_CODE
    for bad in (
        b"",
        b"\xc1",
        msgpack.packb([2, code, [H[0], []]]),
        msgpack.packb([1, VerdictList.TYPE_CODE, [H[0], []]]),  # another type
        msgpack.packb([1, code, [b"short", []]]),
        msgpack.packb([1, code, [H[0], [[PEERS[0], 0, H[1], H[2]]]]]),  # zero steps
        msgpack.packb([1, code, [H[0], [[PEERS[0], 4, H[1][:5], H[2]]]]]),
        msgpack.packb([1, code, [H[0], [[PEERS[0], 4, H[1]]]]]),  # no final state hash
        msgpack.packb([1, code, [H[0], [[PEERS[0], True, H[1], H[2]]]]]),  # steps a bool
        msgpack.packb([1, code, [H[0], "x"]]),
        msgpack.packb([1, code, [H[0], [[b"p" * 65, 4, H[1], H[2]]]]]),  # owner too long
        b"\x00" * 10_000,
    ):
        assert RoundClaims.from_bytes(bad) is None
    too_many = {bytes([i]) * 20: _claim(1) for i in range(MAX_CLAIMS + 1)}
    with pytest.raises(ValueError, match="over the limit"):
        RoundClaims(H[0], too_many).to_bytes()


@given(st.binary(max_size=600))
def test_claims_decoder_never_raises(data: bytes) -> None:
    RoundClaims.from_bytes(data)


def test_verdicts_round_trip_and_the_list_stays_under_the_record_limit() -> None:
    verdicts = [
        Verdict(r, PEERS[0], PEERS[1], PEERS[r % 2] if r % 3 else None, 2, 10, "linear", "x" * 500)
        for r in range(200)
    ]
    data = encode_verdicts(verdicts)
    assert len(data) <= MAX_VERDICTS_BYTES
    decoded = decode_verdicts(data)
    assert decoded[-1].round == 199 and decoded[-1].reason == "x" * 200
    assert set(banned(decoded)) == {PEERS[0], PEERS[1]}
    code = VerdictList.TYPE_CODE
    for bad in (
        msgpack.packb([1, code, [[[0, PEERS[0], PEERS[1], 5, 0, 0, "", ""]]]]),  # cheater an int
        msgpack.packb([1, code, [[[-1, PEERS[0], PEERS[1], None, 0, 0, "", ""]]]]),
        msgpack.packb([1, code, [[[0, PEERS[0], PEERS[1], None, 0, 0, ""]]]]),  # 7 fields
        msgpack.packb([2, code, [[]]]),
        b"\x92\x01",
    ):
        with pytest.raises(RemoteProtocolError):
            decode_verdicts(bad)
    assert decode_verdicts(msgpack.packb([1, code, [[]]])) == []


def test_majority_start_and_disputes() -> None:
    a, b, c = PEERS[:3]
    records = {
        a: RoundClaims(H[0], {a: _claim(1), b: _claim(2)}),
        b: RoundClaims(H[0], {b: _claim(3)}),  # b's own claim differs from a's re-execution
        c: RoundClaims(H[5], {}),
    }
    assert majority_start(records.values()) == H[0]
    assert disputes(records) == [(b, a)]
    assert majority_start([]) is None


def _records(
    owner_claim: Commitment | None,
    verifier_claim: Commitment | None,
    owner_root: bytes | None = H[3],
    verifier_root: bytes | None = H[3],
) -> dict[bytes, RoundClaims]:
    """The owner's and its verifier's records, each task claim with its contribution root."""
    owner, verifier = PEERS[0], PEERS[1]
    out = {}

    def roots(root: bytes | None) -> dict[bytes, bytes]:
        return {} if root is None else {owner: root}

    if owner_claim is not None:
        out[owner] = RoundClaims(H[0], {owner: owner_claim}, roots(owner_root))
    if verifier_claim is not None:
        out[verifier] = RoundClaims(H[0], {owner: verifier_claim}, roots(verifier_root))
    return out


@pytest.mark.parametrize(
    ("owner_root", "verifier_root"), [(H[3], H[4]), (None, H[3]), (H[3], None), (None, None)]
)
def test_agreeing_commitments_owing_other_contributions_leave_the_owner_out(
    owner_root: bytes | None, verifier_root: bytes | None
) -> None:
    """Issue 19 point 2: an owner's slices are checked in the round against the contribution
    root it committed; one its verifier did not compute from the same task (or none) would let
    it send anything, so its contribution stays out at once (no verdict will come)."""
    a = Assignment(PEERS[0], PEERS[1])
    records = _records(_claim(1), _claim(1), owner_root, verifier_root)
    decision, reason = decide(a, records, [], 3, timed_out=False)
    assert decision is Decision.EXCLUDE and reason == CONTRIBUTION_DIFFERS
    record = records[PEERS[0]]
    assert RoundClaims.from_bytes(record.to_bytes()) == record


@pytest.mark.parametrize(
    ("owner_claim", "verifier_claim", "timed_out", "expected", "why"),
    [
        (_claim(1), _claim(1), False, Decision.ACCEPT, "agree"),
        (_claim(1), _claim(2), False, Decision.WAIT, "differ"),
        (_claim(1), _claim(2), True, Decision.EXCLUDE, "differ"),
        (None, _claim(1), False, Decision.WAIT, "both"),
        (None, _claim(1), True, Decision.EXCLUDE, "owner published no"),
        (_claim(1), None, True, Decision.ACCEPT, "verifier published no"),
    ],
)
def test_decide_without_a_verdict(
    owner_claim: Commitment | None,
    verifier_claim: Commitment | None,
    timed_out: bool,
    expected: Decision,
    why: str,
) -> None:
    a = Assignment(PEERS[0], PEERS[1])
    decision, reason = decide(a, _records(owner_claim, verifier_claim), [], 3, timed_out=timed_out)
    assert decision is expected and why in reason


def test_a_verdict_settles_the_task_whatever_the_claims_say() -> None:
    a = Assignment(PEERS[0], PEERS[1])
    records = _records(_claim(1), _claim(2))

    def ruling(cheater: bytes | None, round_number: int = 3) -> list[Verdict]:
        return [Verdict(round_number, a.owner, a.verifier, cheater, 1, 7, "linear", "differs")]

    assert decide(a, records, ruling(a.owner), 3, timed_out=False)[0] is Decision.EXCLUDE
    assert decide(a, records, ruling(a.verifier), 3, timed_out=False)[0] is Decision.ACCEPT
    assert decide(a, records, ruling(None), 3, timed_out=False)[0] is Decision.EXCLUDE
    # A verdict about another round does not decide this one.
    assert decide(a, records, ruling(a.owner, 2), 3, timed_out=False)[0] is Decision.WAIT


def test_a_newcomers_first_task_counts_only_verified() -> None:
    """Issue 19 point 3: a peer that was no member of the round gets no benefit of the doubt
    when its verifier stays silent; a member still does (it cannot be blamed for it)."""
    a = Assignment(PEERS[0], PEERS[1])
    alone = _records(_claim(1), None)
    member = decide(a, alone, [], 3, timed_out=True)
    newcomer = decide(a, alone, [], 3, timed_out=True, newcomer=True)
    assert member[0] is Decision.ACCEPT and newcomer[0] is Decision.EXCLUDE, newcomer
    agreed = _records(_claim(1), _claim(1))
    assert decide(a, agreed, [], 3, timed_out=False, newcomer=True)[0] is Decision.ACCEPT
    # A slice verdict is about the all-reduce, after the round's tasks were settled.
    slice_verdict = [Verdict(3, a.owner, a.verifier, a.owner, None, 0, SLICE, "slice")]
    assert decide(a, agreed, slice_verdict, 3, timed_out=False)[0] is Decision.ACCEPT


def test_a_banned_owner_or_verifier_is_not_waited_for() -> None:
    """A peer banned for an earlier round's slice (here round 2's) that left: its own task is
    out at once, and the task it was to verify is decided as at the timeout (a member's goes in
    unverified, a newcomer's stays out). Without it an honest peer of a CI run waited its whole
    verify timeout for the banned peer's claims and missed the next round's matchmaking."""
    cheater, honest, newcomer = PEERS[0], PEERS[1], PEERS[2]
    ban = [Verdict(2, cheater, honest, cheater, None, 0, SLICE, "slice")]
    plan = [Assignment(cheater, honest), Assignment(honest, cheater), Assignment(newcomer, cheater)]
    records = {
        honest: RoundClaims(H[0], {honest: _claim(1)}, {honest: H[3]}),
        newcomer: RoundClaims(H[0], {newcomer: _claim(1)}, {newcomer: H[3]}),
    }
    members = {cheater, honest}
    got = decide_all(plan, records, ban, 3, members, timed_out=False)
    assert [(a.owner, d) for a, d, _ in got] == [
        (cheater, Decision.EXCLUDE), (honest, Decision.ACCEPT), (newcomer, Decision.EXCLUDE)
    ]  # fmt: skip
    assert got[0][2].startswith("banned: round 2") and "verifier published no" in got[1][2]
    # Without the verdict all three wait, as before.
    waiting = decide_all(plan, records, [], 3, members, timed_out=False)
    assert all(d is Decision.WAIT for _, d, _ in waiting), waiting


def test_newcomers_are_claimers_of_their_own_task_outside_the_members_bounded() -> None:
    members = frozenset(PEERS[:2])
    records = {p: RoundClaims(H[0], {p: _claim(1)}) for p in PEERS}
    # A record that claims only others' tasks is no newcomer's (it is a verifier's, or junk).
    records[PEERS[7]] = RoundClaims(H[0], {PEERS[0]: _claim(1)})
    found = newcomers("run", 3, members, records)
    assert found == sorted(PEERS[2:7]) and found == newcomers("run", 3, members, dict(records))
    many = {bytes([i]) * 20: RoundClaims(H[0], {bytes([i]) * 20: _claim(1)}) for i in range(40)}
    picked = [newcomers("run", r, members, many) for r in range(3)]
    assert all(len(p) == MAX_NEWCOMERS for p in picked)
    assert len({tuple(p) for p in picked}) > 1  # a per-round draw, not always the same eight


def test_audit_results_round_trip_and_a_malformed_list_is_refused() -> None:
    results = [
        AuditResult(r, b"g" * 32, r % 3, PEERS[r % 4], [True, False, None][r % 3], "why" * 100)
        for r in range(100)
    ]
    data = encode_audit_results(results)
    assert len(data) <= MAX_VERDICTS_BYTES
    decoded = decode_audit_results(data)
    assert 40 < len(decoded) <= MAX_AUDIT_RESULTS and decoded[-1].round == 99
    assert [d.ok for d in decoded[-3:]] == [False, None, True]  # rounds 97, 98, 99
    assert decoded[-1].reason == ("why" * 100)[:200]
    code = AuditResultList.TYPE_CODE
    for bad in (
        msgpack.packb([1, code, [[[0, b"g", 0, PEERS[0], "yes", "", None]]]]),
        msgpack.packb([1, code, [[[0, b"g", 0, PEERS[0], 1, "", None]]]]),  # ok an int
        msgpack.packb([1, VerdictList.TYPE_CODE, [[]]]),  # another type
        b"\xc1",
    ):
        with pytest.raises(RemoteProtocolError):
            decode_audit_results(bad)


def test_an_aggregation_verdict_does_not_settle_the_reducers_task() -> None:
    a = Assignment(PEERS[0], PEERS[1])
    ruling = Verdict(3, a.owner, a.owner, a.owner, None, 2, AGGREGATION, "sum wrong")
    assert "part 2 of the all-reduce (reduced wrong)" in ruling.describe()
    liar = Verdict(3, a.owner, a.owner, a.verifier, None, 2, AGGREGATION, "other bytes")
    assert "part 2 of the all-reduce (its slice misstated)" in liar.describe()
    agreeing = _records(_claim(1), _claim(1))
    assert decide(a, agreeing, [ruling], 3, timed_out=False)[0] is Decision.ACCEPT
    assert set(banned([ruling])) == {a.owner}  # banned all the same


def test_only_a_reducer_named_by_an_audit_makes_the_sum_wrong() -> None:
    reducer, liar = PEERS[0], PEERS[1]

    def result(ok: bool | None, cheater: bytes | None) -> AuditResult:
        return AuditResult(3, b"g" * 32, 1, reducer, ok, "why", cheater)

    assert result(False, reducer).sum_wrong
    assert not result(False, liar).sum_wrong  # a contributor lied to the referee: sum stands
    assert not result(None, None).sum_wrong and not result(True, None).sum_wrong
    (back,) = decode_audit_results(encode_audit_results([result(False, liar)]))
    assert back.cheater == liar
