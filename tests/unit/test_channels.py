"""The kept-channel agreement (``swarm.averaging.channels``) on plain tokens: no sockets."""

from __future__ import annotations

from swarm.averaging.channels import (
    Direction,
    KeptChannels,
    Standing,
    Verdict,
    receiver_clean,
    resume_ok,
)

A, B, C = b"A" * 4, b"B" * 4, b"C" * 4
OUT, IN = Direction.OUT, Direction.IN


def standing(succeeded=True, closed=False, good=(A, B, C), pooled=True) -> Standing:
    return Standing(succeeded, closed, frozenset(good), pooled)


def test_the_receiver_resumes_only_the_same_intact_channel_with_as_many_payloads():
    assert resume_ok(b"x", 3, True, b"x", 3)
    assert not resume_ok(b"x", 3, True, b"x", 4)  # a payload sent but never read
    assert not resume_ok(b"x", 3, True, b"y", 3)  # another channel
    assert not resume_ok(b"x", 3, False, b"x", 3)  # broken, or something left unread
    assert not resume_ok(b"x", 0, True, b"", 0)  # the sender proposes none


def test_a_receiver_is_clean_only_after_done_and_between_messages():
    assert receiver_clean(True, True)
    assert not receiver_clean(True, False)  # cut off before Done: items may be unread
    assert not receiver_clean(False, True)


def test_a_proposal_is_taken_once():
    kept: KeptChannels[str] = KeptChannels()
    kept.propose(A, "ch")
    assert kept.take_proposal(A) == "ch"
    assert kept.take_proposal(A) is None


def test_clean_traffic_of_a_round_that_succeeded_with_a_good_peer_is_given_back():
    kept: KeptChannels[str] = KeptChannels()
    assert kept.ended(A, OUT, "a", True, standing()) is Verdict.GIVE_BACK
    assert kept.release(standing()) == []


def test_everything_else_is_retired():
    kept: KeptChannels[str] = KeptChannels()
    assert kept.ended(A, OUT, "a", False, standing()) is Verdict.RETIRE  # cut off
    assert kept.ended(A, OUT, "a", True, standing(closed=True)) is Verdict.RETIRE
    assert kept.ended(A, OUT, "a", True, standing(pooled=False)) is Verdict.RETIRE
    assert not standing(good=(B,)).keeps(A)  # lost or dropped
    assert not standing(succeeded=False).keeps(A)


def test_clean_ends_before_the_outcome_are_held_and_settled_at_release():
    kept: KeptChannels[str] = KeptChannels()
    pending = standing(succeeded=False)
    assert kept.ended(A, OUT, "a-out", True, pending) is Verdict.HOLD
    assert kept.ended(A, IN, "a-in", True, pending) is Verdict.HOLD
    assert kept.ended(B, IN, "b-in", True, pending) is Verdict.HOLD
    # a second clean channel with the same peer and direction this round: one is kept at most
    assert kept.ended(A, OUT, "a-out-2", True, pending) is Verdict.RETIRE
    verdicts = kept.release(standing(good=(A,)))
    assert sorted(verdicts, key=lambda v: v[3]) == [
        (Verdict.GIVE_BACK, A, IN, "a-in"),
        (Verdict.GIVE_BACK, A, OUT, "a-out"),
        (Verdict.RETIRE, B, IN, "b-in"),  # B was lost after its traffic ended
    ]
    assert kept.release(standing()) == []


def test_incoming_ends_are_awaited_only_from_good_peers_of_a_pooled_success():
    receiving = frozenset({A, B})
    assert standing(good=(A, C)).awaiting_ends(receiving) == {A}
    assert standing(succeeded=False).awaiting_ends(receiving) == frozenset()
    assert standing(pooled=False).awaiting_ends(receiving) == frozenset()
