"""The rejection log counts every rejection and logs one line per peer and kind per interval."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from p2p.rejections import MAX_DETAIL_CHARS, RejectionLog, shorten
from p2p.stream_deadlines import DATA_IDLE_S, _Clock, policy_for


def test_one_line_per_peer_and_kind_per_interval_with_the_count_of_the_rest() -> None:
    rejections = RejectionLog(interval_s=60)
    assert rejections.record("A", "/p/1", "bad", now=0.0) is not None
    assert all(rejections.record("A", "/p/1", "bad", now=t) is None for t in range(1, 60))
    assert rejections.record("B", "/p/1", "bad", now=1.0) is not None  # another peer
    assert rejections.record("A", "/q/1", "bad", now=1.0) is not None  # another kind
    line = rejections.record("A", "/p/1", "bad", now=60.0)
    assert line is not None and "59 more from this peer" in line
    assert rejections.counts == {"/p/1": 62, "/q/1": 1}
    assert rejections.total == 63


def test_the_number_of_peers_remembered_is_capped() -> None:
    rejections = RejectionLog(interval_s=60, max_tracked=10)
    for peer in range(1000):
        rejections.record(str(peer), "/p/1", "bad", now=0.0)
    assert len(rejections._windows) == 10
    assert rejections.counts["/p/1"] == 1000


@given(st.text(), st.binary(max_size=20_000))
def test_a_line_never_echoes_more_than_a_few_bytes(text: str, raw: bytes) -> None:
    for detail in (text, repr(raw)):
        line = RejectionLog().record("peer", "kind", detail, now=0.0)
        assert line is not None and "\n" not in line
        assert len(line) <= len("rejected kind from peer: ") + MAX_DETAIL_CHARS
    assert shorten("a  b\n c") == "a b c"


def test_read_deadlines_by_protocol() -> None:
    control = policy_for("/swarmtrain/ping/1", 10)
    assert (control.idle_s, control.message_s) == (10, 10)
    assert policy_for("/ipfs/kad/1.0.0", 3).message_s == 3
    assert policy_for(None, 10) == control  # negotiation
    data = policy_for("/swarmtrain/allreduce/2", 10)
    assert data.idle_s == DATA_IDLE_S and data.message_s == math.inf
    assert policy_for("/libp2p/circuit/relay/0.2.0/hop", 10).handshake_only


def test_a_trickle_does_not_move_the_message_deadline() -> None:
    clock = _Clock(now=0.0)
    control = policy_for("/swarmtrain/ping/1", 10)
    assert clock.deadline(control) == 10  # idle: the first byte within 10 s
    clock.message_started = clock.last_activity = 5.0
    clock.last_activity = 14.0  # more bytes came, a byte at a time
    assert clock.deadline(control) == 15  # still 10 s from the message's first byte
    data = policy_for("/swarmtrain/state/1", 10)
    assert clock.deadline(data) == 14 + DATA_IDLE_S  # data: silence since the last byte
    hop = policy_for("/libp2p/circuit/relay/0.2.0/hop", 10)
    clock.wrote = True
    assert clock.deadline(hop) == math.inf  # past its handshake, a relay pipe
