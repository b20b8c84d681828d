"""The pure membership rules (``swarmtrain.membership.plan``): whom a peer whose round failed
alone waits for, what it adopts, the schedule bound, and the live-holder choice."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from p2p import decode
from swarmtrain.membership.plan import (
    Claim,
    Verdict,
    after_failed_round,
    best_state,
    candidates,
    positions,
    states_best_first,
    swarm_ahead,
    unagreed_claims,
    wait_budget_s,
)
from swarmtrain.membership.progress import (
    Progress,
    Start,
    StartAnnouncement,
    decode_starts,
    member_list,
)

ROUNDS = 10
NOW = 1000.0
A, B = bytes([1]) * 32, bytes([2]) * 32


def rec(peer: str, rnd: int, ok: bool = True, h: bytes = A, at: float = NOW) -> Progress:
    return Progress(peer, rnd, ok, h, 3.0, 1.0, 2, 0, 0, 1, at)


def test_a_peer_ahead_of_a_live_peer_waits_for_it() -> None:
    plan = after_failed_round([rec("me", 5, False), rec("b", 3)], "me", 5, ROUNDS, NOW, 30.0)
    assert plan.verdict is Verdict.WAIT


def test_a_peer_behind_never_waits_for_one_ahead() -> None:
    # Only the peer ahead waits: two peers never wait for each other.
    plan = after_failed_round([rec("me", 3, False), rec("b", 5, False)], "me", 3, ROUNDS, NOW, 30.0)
    assert plan.verdict is Verdict.ALONE


def test_a_stale_peer_behind_is_not_waited_for() -> None:
    records = [rec("me", 5, False), rec("b", 3, at=NOW - 31)]
    assert after_failed_round(records, "me", 5, ROUNDS, NOW, 30.0).verdict is Verdict.ALONE


def test_the_others_averaged_our_round_or_later_so_we_adopt_the_newest() -> None:
    records = [rec("me", 4, False), rec("b", 4), rec("c", 6, h=B), rec("d", 6, h=B)]
    plan = after_failed_round(records, "me", 4, ROUNDS, NOW, 30.0)
    assert plan.verdict is Verdict.ADOPT and plan.target is not None
    assert plan.target.round == 6 and plan.target.holders == ("c", "d")


def test_a_round_past_the_schedule_is_ignored() -> None:
    # A liar claiming a huge (or the run's end-plus-one) round pulls nobody forward.
    records = [rec("me", 4, False), rec("liar", ROUNDS), rec("liar2", 10**9)]
    assert after_failed_round(records, "me", 4, ROUNDS, NOW, 30.0).verdict is Verdict.ALONE
    assert swarm_ahead(records, "me", 4, ROUNDS) is None


def test_a_lone_peer_with_nobody_to_meet_trains_on() -> None:
    assert after_failed_round([], "me", 0, ROUNDS, NOW, 30.0).verdict is Verdict.ALONE


def test_a_peer_that_started_but_has_no_record_yet_is_waited_for() -> None:
    # CI's starved run: our round 0 failed alone before the others declared; they had announced
    # their starts but published no record, and we ran ahead of them to the end.
    starts = [Start("b", 0, NOW - 5), Start("c", 0, NOW - 4)]
    assert after_failed_round([], "me", 0, ROUNDS, NOW, 30.0).verdict is Verdict.ALONE
    plan = after_failed_round([], "me", 0, ROUNDS, NOW, 30.0, starts)
    assert plan.verdict is Verdict.WAIT and plan.reason == "2 live peer(s) behind us"
    assert wait_budget_s([], "me", 0, 10.0, starts) == 20.0  # one round of gap
    # A start older than the liveness bound is a peer that died warming up: not waited for.
    stale = [Start("b", 0, NOW - 31)]
    assert after_failed_round([], "me", 0, ROUNDS, NOW, 30.0, stale).verdict is Verdict.ALONE
    # Our own start is nobody to wait for.
    assert after_failed_round([], "me", 0, ROUNDS, NOW, 30.0, [Start("me", 0, NOW)]).verdict is (
        Verdict.ALONE
    )


def test_a_record_newer_than_the_start_says_where_the_peer_is() -> None:
    # b started, then finished round 3: its record governs; a restart after it governs again.
    assert positions([rec("b", 3)], [Start("b", 0, NOW - 50)], "me", ROUNDS) == {"b": (3, NOW)}
    restarted = positions([rec("b", 3, at=NOW - 50)], [Start("b", 4, NOW)], "me", ROUNDS)
    assert restarted == {"b": (3, NOW)}
    failed = [rec("b", 3, ok=False)]
    plan = after_failed_round(failed, "me", 3, ROUNDS, NOW, 30.0, [Start("b", 0, NOW - 50)])
    assert plan.verdict is Verdict.ALONE  # b finished round 3 (failed): not behind us
    # A start past the schedule (a forged first round) is ignored like a record past it.
    assert positions([], [Start("x", 10**6, NOW)], "me", ROUNDS) == {}


def test_start_announcements_decode_and_malformed_ones_are_skipped() -> None:
    good = Start("b", 2, NOW).to_bytes()
    assert decode(good, StartAnnouncement) == StartAnnouncement(2, NOW)
    values = {"b": good, "c": b"garbage", "d": Start("d", 0, NOW).to_bytes()[:-1]}
    assert decode_starts(values) == [Start("b", 2, NOW)]


def test_swarm_ahead_names_the_newest_agreed_state_of_others() -> None:
    records = [rec("me", 0, False), rec("b", 2), rec("c", 3), rec("d", 3)]
    ahead = swarm_ahead(records, "me", 0, ROUNDS)
    assert ahead is not None and ahead.round == 3 and ahead.holders == ("c", "d")
    assert swarm_ahead(records, "me", 4, ROUNDS) is None  # nobody averaged round 4 yet


def test_wait_budget_grows_with_the_gap_and_is_capped() -> None:
    assert wait_budget_s([rec("b", 3)], "me", 5, 10.0) == 30.0
    assert wait_budget_s([rec("b", 0)], "me", 100, 10.0) == 90.0
    assert wait_budget_s([], "me", 0, 10.0) == 20.0


def test_the_state_most_peers_hold_comes_first_and_a_dead_holder_hands_on_the_choice() -> None:
    # A round boundary: b published round 4 of {b, c, d}, c and d not yet. Both rounds' states
    # are vouched for by all three (c and d were b's fellow members in round 4; b in round 3).
    records = [honest("b", 4, h=B), honest("c", 3), honest("d", 3)]
    choices = states_best_first(records, ROUNDS)
    assert [(s.round, s.support) for s in choices] == [(3, 3), (4, 3)]
    live = states_best_first(records, ROUNDS, dead={"c", "d"})
    assert [(s.round, s.holders) for s in live] == [(4, ("b",))]
    assert states_best_first(records, ROUNDS, dead={"b", "c", "d"}) == []
    # Unlisted records (a round of more than 128) vouch only as holders: b alone of 2 is not
    # a majority, c and d are; with quorum 0 (the old rule) b's is the second choice.
    flat = [rec("b", 4, h=B), rec("c", 3), rec("d", 3)]
    assert [s.round for s in states_best_first(flat, ROUNDS)] == [3]
    assert [s.round for s in states_best_first(flat, ROUNDS, quorum=0)] == [3, 4]


def honest(
    peer: str, rnd: int, h: bytes = A, members: tuple[str, ...] = ("b", "c", "d")
) -> Progress:
    """A record of a round whose contributors were ``members``, as the node publishes it."""
    return Progress(peer, rnd, True, h, 3.0, 1.0, len(members), 0, 0, 1, NOW, "public",
                    member_list(members))  # fmt: skip


FORGED = bytes([9]) * 32


def test_a_forged_later_round_never_outweighs_the_state_the_rounds_members_hold() -> None:
    """Issue 19 point 1: one signed record claiming a round far ahead (within the schedule)
    with a made-up hash made every joiner adopt it; now the state its round's members hold wins
    in every rule that picks a state."""
    swarm = [honest("b", 3), honest("c", 3), honest("d", 3)]
    liar = Progress("liar", ROUNDS - 1, True, FORGED, 0.1, 1.0, 1, 0, 0, 1, NOW, "public",
                    member_list(["liar"]))  # fmt: skip
    records = [*swarm, liar]
    best = best_state(records, ROUNDS)
    assert best is not None and (best.round, best.state_hash) == (3, A)
    assert best_state(records, ROUNDS, quorum=0) == best
    assert len(best.holders) > best.members // 2  # a quorum of its round's members
    assert [s.state_hash for s in states_best_first(records, ROUNDS)] == [A]
    # ... also when the honest holders fail to serve: no state rather than the liar's.
    assert states_best_first(records, ROUNDS, dead={"b", "c", "d"}, me="me") == []
    assert best_state([liar], ROUNDS) is not None  # alone it would be "the swarm's" state,
    assert best_state([liar, honest("b", 3)], ROUNDS) is None  # not next to one member's record
    # The old rule (state_quorum = 0) kept it as a second choice: unsafe with liars.
    assert [s.state_hash for s in states_best_first(records, ROUNDS, quorum=0)] == [A, FORGED]
    assert [s.state_hash for s in states_best_first(records, ROUNDS, quorum=2)] == [A]
    # A member about to run round 4 is not "behind" the liar; one that failed round 4 waits
    # or trains on, it never adopts the forged state.
    assert swarm_ahead([*records, honest("me", 3)], "me", 4, ROUNDS) is None
    plan = after_failed_round([*records, rec("me", 4, ok=False)], "me", 4, ROUNDS, NOW, 30.0)
    assert plan.verdict is not Verdict.ADOPT
    # Two liars (or two forged records) against three holders: still the holders'.
    second = dataclasses.replace(liar, peer_id="liar2")
    for quorum in ("majority", 0):
        two = best_state([*records, second], ROUNDS, quorum)
        assert two is not None and two.state_hash == A


def test_what_status_and_the_dashboard_show_is_the_joiners_state_and_a_forgery_a_claim() -> None:
    """Issue 19: ``swarmtrain status``, the dashboard and the coordinator's log named the
    newest round any record claimed as the run's. They now name ``best_state`` (the state a
    joiner adopts) and list the newer claims nobody adopts (``unagreed_claims``)."""
    swarm = [honest("b", 3), honest("c", 3), honest("d", 3)]
    ahead = Progress("liar", ROUNDS - 1, True, FORGED, 0.1, 1.0, 1, 0, 0, 1, NOW, "public",
                     member_list(["liar"]))  # fmt: skip
    far = dataclasses.replace(ahead, peer_id="liar2", round=10**6)  # past the schedule
    records = [*swarm, ahead, far]
    accepted = candidates(records, ROUNDS)
    assert [(s.round, s.state_hash) for s in accepted] == [(3, A)]
    assert best_state(records, ROUNDS) == accepted[0]
    assert unagreed_claims(records, accepted) == [Claim(10**6, 1), Claim(ROUNDS - 1, 1)]
    # Of one round: the expected set of a joiner's first round asks for round r - 1's state.
    assert best_state(records, ROUNDS, round_number=3) == accepted[0]
    assert best_state(records, ROUNDS, round_number=ROUNDS - 1) is None
    # A round whose honest records are arriving is agreed as soon as its members vouch (c and
    # d's round 3 lists name b): no claim to note, and the newer round's state is a candidate.
    moving = [honest("b", 4, h=B), honest("c", 3), honest("d", 3)]
    accepted = candidates(moving, ROUNDS)
    assert {s.round for s in accepted} == {3, 4} and unagreed_claims(moving, accepted) == []
    # No state at all: every successful record's round is a bare claim.
    assert unagreed_claims([ahead], candidates([ahead, honest("b", 3)], ROUNDS)) == [
        Claim(ROUNDS - 1, 1)
    ]


def test_the_previous_rounds_state_of_a_joiners_first_round_is_the_quorums() -> None:
    # b holds round 3's state; c and d, its other members, still show round 2. A liar claims
    # round 3 listing b, c, d and itself: the old ranking gave it their support (4 > 3), so
    # every member expected the liar, not b, in round 4 with a joiner (``Elastic``).
    bcd = ("b", "c", "d")
    records = [honest("b", 3), honest("c", 2, members=bcd), honest("d", 2, members=bcd)]
    liar = honest("liar", 3, h=FORGED, members=("b", "c", "d", "liar"))
    old = best_state([*records, liar], ROUNDS, quorum=0, round_number=3)
    assert old is not None and old.holders == ("liar",)
    new = best_state([*records, liar], ROUNDS, round_number=3)
    assert new is not None and new.holders == ("b",)


def test_a_minority_state_of_a_round_is_never_a_choice() -> None:
    # Round 3's members were b, c and d; d's hash drifted (or d lies about it).
    records = [honest("b", 3), honest("c", 3), honest("d", 3, h=B)]
    choices = states_best_first(records, ROUNDS, me="me")
    assert [(s.state_hash, s.holders) for s in choices] == [(A, ("b", "c"))]
    assert len(choices[0].holders) > choices[0].members // 2 and choices[0].members == 3
    # Holders count per claimed membership: a claim of other members is its own group.
    outsider = dataclasses.replace(honest("e", 3, h=B), members=member_list(["e"]), peers=1)
    assert [s.state_hash for s in states_best_first([*records, outsider], ROUNDS)] == [A]


def test_a_lone_holder_of_a_larger_round_or_a_strangers_failed_state_is_never_adopted() -> None:
    # b holds round 3's state of {b, c, d} alone (c and d are gone, or never said so); a, on
    # no list, failed round 4. Neither is a majority's: the default adopts neither.
    records = [honest("b", 3), rec("a", 4, ok=False, h=B)]
    for quorum in ("majority", 2):
        assert states_best_first(records, ROUNDS, me="me", quorum=quorum) == []
        plan = after_failed_round(records, "me", 3, ROUNDS, NOW, 30.0, quorum=quorum)
        assert plan.verdict is not Verdict.ADOPT
        assert swarm_ahead(records, "me", 3, ROUNDS, quorum=quorum) is None
    # state_quorum = 0 (the old rule) took both.
    choices = states_best_first(records, ROUNDS, me="me", quorum=0)
    assert [s.holders for s in choices] == [("b",), ("a",)]
    assert after_failed_round(records, "me", 3, ROUNDS, NOW, 30.0, quorum=0).verdict is (
        Verdict.ADOPT
    )


def failed(peer: str, rnd: int, h: bytes, members: tuple[str, ...]) -> Progress:
    """A failed round's record, carrying the list of the round whose state its peer holds."""
    return dataclasses.replace(rec(peer, rnd, ok=False, h=h), members=member_list(members))


def test_with_every_agreed_holder_dead_a_live_members_own_state_is_the_last_resort() -> None:
    # Issue 16's NAT-lab run: a and b averaged round 1; b died; a's round 2 failed alone, so
    # the only record of round 1's agreed state is b's (1 holder of 2). a's failed record
    # carries round 1's list: it vouches for b's state (2 of 2) and a joiner takes a's, not
    # a fresh round 0; a's state is taken only while no agreed state of round 1 on lives.
    pair = ("a", "b")
    records = [honest("b", 1, h=B, members=pair), failed("a", 2, A, pair), rec("me", 0, ok=False)]
    choices = states_best_first(records, ROUNDS, me="me")
    assert [(s.round, s.holders, s.support) for s in choices] == [(1, ("b",), 2)]
    (survivor,) = states_best_first(records, ROUNDS, dead={"b"}, me="me")
    assert (survivor.round, survivor.state_hash, survivor.holders) == (2, A, ("a",))
    assert states_best_first(records, ROUNDS, dead={"a", "b"}, me="me") == []
    # a failed round 3 too (it trained on alone): it still carries round 1's list.
    later = [records[0], failed("a", 3, A, pair)]
    assert [s.holders for s in states_best_first(later, ROUNDS, dead={"b"})] == [("a",)]
    # Old records (no list on a failed round) vouch for nothing: no state at all, then.
    assert states_best_first([records[0], rec("a", 2, ok=False)], ROUNDS, dead={"b"}) == []
    # A liar's record naming both for round 1 changes nothing: it is no majority's (a's list
    # is not its list, b's hash not its hash), and b's state keeps its support.
    liar = honest("liar", 1, h=FORGED, members=("a", "b", "liar"))
    with_liar = [*records, liar]
    assert [s.state_hash for s in states_best_first(with_liar, ROUNDS, me="me")] == [B]
    (survivor,) = states_best_first(with_liar, ROUNDS, dead={"b"}, me="me")
    assert survivor.holders == ("a",)
    assert all(
        s.state_hash != FORGED for s in states_best_first(with_liar, ROUNDS, dead={"b", "a"})
    )


def test_a_liar_naming_the_honest_members_never_gets_their_support() -> None:
    # Round 3's members b, c, d hold A. A liar claims round 4 (nobody published it yet) of
    # {b, c, d, liar}; another claims round 3 itself. Neither is vouched for: b, c and d's
    # lists do not name the liar, and a state of round 3 with another hash contradicts theirs.
    swarm = [honest("b", 3), honest("c", 3), honest("d", 3)]
    named = ("b", "c", "d", "liar")
    ahead = honest("liar", 4, h=FORGED, members=named)
    beside = honest("liar2", 3, h=FORGED, members=("b", "c", "d", "liar2"))
    for lie in (ahead, beside):
        records = [*swarm, lie]
        choices = states_best_first(records, ROUNDS, dead={"b", "c", "d"})
        assert choices == [], lie
        best = best_state(records, ROUNDS)
        assert best is not None and best.state_hash == A and best.support == 3
    # With the old rule the liar of the next round was a choice (and first once b, c, d died).
    old = states_best_first([*swarm, ahead], ROUNDS, dead={"b", "c", "d"}, quorum=0)
    assert [s.state_hash for s in old] == [FORGED]


def test_at_a_round_boundary_both_rounds_states_stay_adoptable() -> None:
    # Five members; two already published round 6, three still show round 5, and one of them
    # failed round 6 (it holds round 5's state). Neither round has a majority of holders, but
    # each has a majority of its members vouching: a joiner finds a state all along.
    five, four = ("a", "b", "c", "d", "e"), ("a", "b", "c", "d")
    records = [
        honest("a", 6, h=B, members=four), honest("b", 6, h=B, members=four),
        honest("c", 5, members=five), honest("d", 5, members=five),
        failed("e", 6, bytes([3]) * 32, five),
    ]  # fmt: skip
    choices = states_best_first(records, ROUNDS, me="me")
    # Round 6's: a, b hold it, c and d ran it (their round 5 lists name a): 4 of 5 (the
    # largest list of rounds 5-7). Round 5's: c, d, and a, b (round 6 lists name c), e.
    assert [(s.round, len(s.holders), s.support) for s in choices] == [(5, 2, 5), (6, 2, 4)]
    # A late starter is behind; c, about to publish round 6, is not pulled back.
    ahead = swarm_ahead(records, "me", 0, ROUNDS)
    assert ahead is not None and ahead.round == 5
    assert swarm_ahead(records, "c", 6, ROUNDS) is None


def test_divergent_states_of_one_round_are_no_majority_s_until_the_round_says_so() -> None:
    # Two live peers met in round 4 with different states (they started apart): each holds
    # its own, vouched for by itself alone. No joiner adopts either from the records; the
    # members' own hash check (StateAgreement's tie-break) picks one, ``Elastic.after_round``.
    pair = ("a", "b")
    records = [honest("a", 4, h=A, members=pair), honest("b", 4, h=B, members=pair)]
    assert states_best_first(records, ROUNDS) == []
    # Once the one off the tie-break adopted the other's state and said so, it is the state.
    settled = [honest("a", 4, h=B, members=pair), honest("b", 4, h=B, members=pair)]
    assert [s.state_hash for s in states_best_first(settled, ROUNDS)] == [B]


records_st = st.lists(
    st.builds(
        rec,
        st.sampled_from(["me", "b", "c", "d", "e"]),
        st.integers(0, 2 * ROUNDS),
        st.booleans(),
        st.sampled_from([A, B]),
        st.floats(NOW - 100, NOW),
    ),
    max_size=12,
    unique_by=lambda p: p.peer_id,  # the DHT key holds each peer's newest record only
)


@given(records_st, st.integers(0, ROUNDS - 1))
def test_decisions_stay_in_the_schedule_and_waits_are_for_live_peers_behind(
    records: list[Progress], rnd: int
) -> None:
    plan = after_failed_round(records, "me", rnd, ROUNDS, NOW, 30.0)
    if plan.verdict is Verdict.ADOPT:
        assert plan.target is not None and rnd <= plan.target.round < ROUNDS
    elif plan.verdict is Verdict.WAIT:
        behind = [
            p for p in records if p.peer_id != "me" and p.round < rnd and NOW - p.published_at <= 30
        ]
        assert behind
    choices = states_best_first(records, ROUNDS, dead={"b"}, me="me")
    for state in choices:
        assert state.round < ROUNDS and state.holders and "b" not in state.holders
        assert state.published or state.holders != ("me",)  # never our own failed state
    # Agreed states first; a failed round's state only after all of them.
    published = [bool(s.published) for s in choices]
    assert published == sorted(published, reverse=True)
