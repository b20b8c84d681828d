"""The pure membership rules (``swarmtrain.membership.plan``): whom a peer whose round failed
alone waits for, what it adopts, the schedule bound, and the live-holder choice."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from p2p import decode
from swarmtrain.membership.plan import (
    Verdict,
    after_failed_round,
    positions,
    states_best_first,
    swarm_ahead,
    wait_budget_s,
)
from swarmtrain.membership.progress import (
    Progress,
    Start,
    StartAnnouncement,
    agreed_state,
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
    records = [rec("b", 4, h=B), rec("c", 3), rec("d", 3)]
    assert [s.round for s in states_best_first(records, ROUNDS)] == [3, 4]
    live = states_best_first(records, ROUNDS, dead={"c", "d"})
    assert [(s.round, s.holders) for s in live] == [(4, ("b",))]
    assert states_best_first(records, ROUNDS, dead={"b", "c", "d"}) == []


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
    best = agreed_state(records)
    assert best is not None and (best.round, best.state_hash) == (3, A)
    assert len(best.holders) > best.members // 2  # a quorum of its round's members
    assert [s.state_hash for s in states_best_first(records, ROUNDS)] == [A, FORGED]
    assert states_best_first(records, ROUNDS, min_holders=2)[0].state_hash == A
    assert [s.state_hash for s in states_best_first(records, ROUNDS, min_holders=2)] == [A]
    # A member about to run round 4 is not "behind" the liar; one that failed round 4 waits
    # or trains on, it never adopts the forged state.
    assert swarm_ahead([*records, honest("me", 3)], "me", 4, ROUNDS) is None
    plan = after_failed_round([*records, rec("me", 4, ok=False)], "me", 4, ROUNDS, NOW, 30.0)
    assert plan.verdict is not Verdict.ADOPT
    # Two liars (or two forged records) against three holders: still the holders'.
    second = dataclasses.replace(liar, peer_id="liar2")
    assert agreed_state([*records, second]).state_hash == A  # type: ignore[union-attr]


def test_a_minority_state_of_a_round_is_never_a_choice() -> None:
    # Round 3's members were b, c and d; d's hash drifted (or d lies about it).
    records = [honest("b", 3), honest("c", 3), honest("d", 3, h=B)]
    choices = states_best_first(records, ROUNDS, me="me")
    assert [(s.state_hash, s.holders) for s in choices] == [(A, ("b", "c"))]
    assert len(choices[0].holders) > choices[0].members // 2 and choices[0].members == 3
    # Holders count per claimed membership: a claim of other members is its own group.
    outsider = dataclasses.replace(honest("e", 3, h=B), members=member_list(["e"]), peers=1)
    assert [s.state_hash for s in states_best_first([*records, outsider], ROUNDS)] == [A]


def test_with_a_state_quorum_a_lone_holder_is_never_adopted() -> None:
    # b survived a round of three and holds its state alone; a failed-round survivor too.
    records = [honest("b", 3), rec("a", 4, ok=False, h=B)]
    assert [s.holders for s in states_best_first(records, ROUNDS, me="me")] == [("b",), ("a",)]
    assert states_best_first(records, ROUNDS, me="me", min_holders=2) == []
    assert after_failed_round(records, "me", 3, ROUNDS, NOW, 30.0).verdict is Verdict.ADOPT
    plan = after_failed_round(records, "me", 3, ROUNDS, NOW, 30.0, min_holders=2)
    assert plan.verdict is not Verdict.ADOPT
    assert swarm_ahead(records, "me", 3, ROUNDS, min_holders=2) is None


def test_with_every_agreed_holder_dead_a_live_members_own_state_is_the_last_resort() -> None:
    # Issue 16's NAT-lab run: a and b averaged round 1; b died; a's round 2 failed alone, so
    # the only record of round 1's agreed state is b's. A joiner takes a's state, not round 0.
    records = [rec("b", 1, h=B), rec("a", 2, ok=False, h=A), rec("me", 0, ok=False)]
    choices = states_best_first(records, ROUNDS, me="me")
    assert [(s.round, s.holders, s.published) for s in choices] == [(1, ("b",), 1), (2, ("a",), 0)]
    (survivor,) = states_best_first(records, ROUNDS, dead={"b"}, me="me")
    assert (survivor.round, survivor.state_hash, survivor.holders) == (2, A, ("a",))
    assert states_best_first(records, ROUNDS, dead={"a", "b"}, me="me") == []


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
