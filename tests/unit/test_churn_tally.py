"""bench.churn_tally: a node's round lines parsed into events, and the soak's figures (rounds,
longest stall, hash disagreements, lost rounds, syncs) computed from a list of them."""

from __future__ import annotations

from bench.churn_tally import Event, Kind, figures, parse_line, round_rows

# Lines as swarmtrain.training.loop and swarmtrain.membership.elastic print them (a real soak's).
AVERAGED_LINE = (
    "round 20 loss 3.223 3144 tok/s peers 2 sent 3.34 MiB recv 3.34 MiB allreduce 1.24 s "
    "state cb8e14c26e52 agree yes (2/2) 6.9 s"
)
FAILED_LINE = (
    "round 23 loss 3.118 5393 tok/s FAILED (every other peer of the round was lost); "
    "state d64a02806ecf 2.1 s"
)
SYNCED_LINE = (
    "synced to round 25 from 2 peers (pieces 4/4): 6.68 MiB in 0.29 s, state 00e89f892a06 "
    "(the majority's)"
)


def test_the_three_round_lines_parse_and_others_do_not() -> None:
    assert parse_line(AVERAGED_LINE, 1.5, 3) == Event(
        1.5, 3, Kind.AVERAGED, 20, "cb8e14c26e52", peers=2
    )
    assert parse_line(FAILED_LINE, 2.0, 4) == Event(
        2.0, 4, Kind.FAILED, 23, "d64a02806ecf", why="every other peer of the round was lost"
    )
    assert parse_line(SYNCED_LINE, 3.0, 5) == Event(
        3.0, 5, Kind.SYNCED, 25, "00e89f892a06", peers=2
    )
    for other in (
        "waiting for 4 peers to start (at most 120 s)",
        "round 3 loss 3.1 900 tok/s: inner phase done, averaging while round 4 trains",
        "the swarm's agreed state is round 20's, ours is round 0's: syncing now",
    ):
        assert parse_line(other, 0.0, 0) is None


def avg(t: float, node: int, r: int, state: str) -> Event:
    return Event(t, node, Kind.AVERAGED, r, state, peers=2)


def failed(t: float, node: int, r: int) -> Event:
    return Event(t, node, Kind.FAILED, r, "ffffffffffff", why="lost")


def test_rounds_and_the_longest_stall_use_each_rounds_first_line() -> None:
    events = [
        avg(10.0, 0, 0, "a"), avg(10.4, 1, 0, "a"),
        avg(12.0, 1, 1, "b"), avg(11.5, 0, 1, "b"),  # lines arrive out of order
        avg(20.0, 0, 2, "c"), avg(20.1, 1, 2, "c"),
    ]  # fmt: skip
    found = figures(events, end_t=22.0)
    assert (found.rounds, found.first_round, found.last_round) == (3, 0, 2)
    # 10.0 -> 11.5 -> 20.0: the longest gap is 8.5 s, after round 1; the tail 2.0 s.
    assert found.max_stall_s == 8.5 and found.stall_after_round == 1
    rows = round_rows(events)
    assert [r.gap_s for r in rows] == [None, 1.5, 8.5]
    assert rows[0].hashes == {"a": 2}


def test_a_swarm_that_stops_averaging_stalls_until_the_end() -> None:
    found = figures([avg(5.0, 0, 0, "a"), avg(6.0, 0, 1, "b")], end_t=60.0)
    assert found.max_stall_s == 54.0 and found.stall_after_round == 1
    nothing = figures([failed(5.0, 0, 0)], end_t=30.0)
    assert nothing.rounds == 0 and nothing.max_stall_s == 30.0 and nothing.lost_rounds == 1


def test_a_lost_round_is_failed_everywhere_and_spanned_by_the_stall() -> None:
    events = [
        avg(1.0, 0, 3, "a"), avg(1.0, 1, 3, "a"),
        failed(2.0, 0, 4), failed(2.2, 1, 4),
        avg(9.0, 0, 5, "b"), avg(9.1, 1, 5, "b"),
        failed(10.0, 2, 5),  # a peer that failed a round the others averaged: not lost
    ]  # fmt: skip
    found = figures(events, end_t=9.5)
    assert found.rounds == 2 and found.lost_rounds == 1 and found.failed_rounds == 3
    assert found.max_stall_s == 8.0 and found.stall_after_round == 3


def test_a_split_repaired_by_the_next_round_is_no_disagreement_but_one_that_persists_is() -> None:
    repaired = [
        avg(1.0, 0, 0, "a"), avg(1.0, 1, 0, "a"), avg(1.0, 2, 0, "x"),  # node 2 drifted...
        avg(2.0, 0, 1, "b"), avg(2.0, 1, 1, "b"), avg(2.0, 2, 1, "b"),  # ...and re-synced
    ]  # fmt: skip
    found = figures(repaired, end_t=2.0)
    assert found.hash_disagreements == 0 and found.split_rounds == 1

    persisting = [
        *repaired[:3],
        avg(2.0, 0, 1, "b"), avg(2.0, 1, 1, "b"), avg(2.0, 2, 1, "y"),  # still apart
        avg(3.0, 0, 2, "c"), avg(3.0, 1, 2, "c"), avg(3.0, 2, 2, "z"),
    ]  # fmt: skip
    found = figures(persisting, end_t=3.0)
    # Rounds 0 and 1 each differed and still did one round later; round 2 has no later round.
    assert found.hash_disagreements == 2 and found.disagreeing_rounds == [0, 1]
    assert found.split_rounds == 3


def test_a_sync_to_a_state_no_averaging_peer_printed_is_counted() -> None:
    events = [
        avg(1.0, 0, 4, "a"), avg(1.0, 1, 4, "a"),
        Event(2.0, 2, Kind.SYNCED, 5, "a", peers=2),  # round 5's state is round 4's average
        Event(2.5, 3, Kind.SYNCED, 5, "q", peers=1),  # not one round 4's peers held
        Event(3.0, 4, Kind.SYNCED, 9, "r", peers=1),  # round 8 was never printed: unknown
    ]  # fmt: skip
    found = figures(events, end_t=3.0)
    assert found.syncs == 3 and found.foreign_syncs == 1
