"""Liveness rules of one all-reduce round, driven with explicit ``now`` values: no clock."""

from __future__ import annotations

import math

from swarm.averaging.liveness import Liveness, LivenessConfig

A, B, C = b"A" * 4, b"B" * 4, b"C" * 4


def started(now: float = 100.0, timeout: float = 10.0) -> Liveness:
    live = Liveness(LivenessConfig(peer_timeout_s=timeout, heartbeat_s=0.5))
    live.start(now)
    return live


def test_dials_keep_trying_for_the_peer_timeout_from_the_start():
    live = Liveness(LivenessConfig(peer_timeout_s=10.0, heartbeat_s=0.5))
    assert live.keep_trying_s(5.0) == math.inf  # not started: no window yet
    live.start(100.0)
    assert live.keep_trying_s(100.0) == 10.0
    assert live.keep_trying_s(107.5) == 2.5
    assert live.keep_trying_s(130.0) == 0.0


def test_a_member_that_opens_no_stream_is_lost_after_two_timeouts_and_a_second():
    live = started(100.0, timeout=10.0)
    live.stream_opened(B)
    assert live.overdue(120.99, [B, C]) == []
    assert live.overdue(121.0, [B, C]) == [(C, "opened no stream to us within 21 s")]
    live.stream_opened(C)
    assert live.overdue(200.0, [B, C]) == []


def test_quiet_members_are_pinged_unless_busy_done_or_lost():
    live = started(100.0)
    others = [A, B, C]
    assert live.to_ping(100.0, others) == [A, B, C]  # never heard
    for peer in others:
        live.heard(peer, 100.0)
    assert live.to_ping(100.4, others) == []  # heard within the heartbeat
    assert live.to_ping(100.6, others) == [A, B, C]
    live.transfer_started(A)  # its transfer's own deadline watches it
    live.said_done(B)  # it owes us nothing more
    assert live.report(C, alive=True, closed=False, finished=False)
    assert live.to_ping(100.6, others) == []
    live.transfer_ended(A)
    assert live.to_ping(100.6, others) == [A]


def test_a_peer_is_reported_lost_once_and_only_while_it_matters():
    live = started()
    assert not live.report(A, alive=False, closed=False, finished=False)  # already out
    assert not live.report(A, alive=True, closed=True, finished=False)  # session over
    live.said_done(B)
    assert not live.report(B, alive=True, closed=False, finished=True)  # it finished, closed
    assert live.report(B, alive=True, closed=False, finished=False)  # Done, but we still wait
    assert live.report(A, alive=True, closed=False, finished=False)
    assert not live.report(A, alive=True, closed=False, finished=False)
    assert live.lost == {A, B}


def test_a_transfer_may_stall_at_least_five_seconds():
    assert started(timeout=1.0).transfer_idle_s(30.0) == 5.0
    assert started(timeout=10.0).transfer_idle_s(30.0) == 10.0
    assert started(timeout=60.0).transfer_idle_s(30.0) == 30.0
