"""``round_figures``'s ``mismatched_groups``: finished members of one group holding different
bytes count, unless the odd one left the swarm before the group's last finish (it finished, then
could not forward its parts, so the others rightly finished over fewer contributors)."""

from __future__ import annotations

import numpy as np

from swarm.sim import PeerRound, round_figures


def finished(peer: bytes, value: float, ended: float, departed: float | None = None) -> PeerRound:
    record = PeerRound(peer, 0, 0.0, matched_at=1.0, group_id=b"g", ended_at=ended)
    record.result = np.full(4, value, np.float32)
    record.departed_at = departed
    return record


def test_a_holder_that_left_before_the_others_finished_is_not_a_mismatch() -> None:
    stayed = [finished(b"a", 1.0, 20.0), finished(b"b", 1.0, 21.0)]
    assert (
        round_figures(0, [*stayed, finished(b"c", 2.0, 10.0, departed=12.0)], []).mismatched_groups
        == 0
    )
    # one that stayed until every member finished is a survivor: different bytes are a mismatch
    assert (
        round_figures(0, [*stayed, finished(b"c", 2.0, 10.0, departed=30.0)], []).mismatched_groups
        == 1
    )
    assert round_figures(0, [*stayed, finished(b"c", 2.0, 10.0)], []).mismatched_groups == 1
