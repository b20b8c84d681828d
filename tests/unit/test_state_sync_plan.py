"""RangePlan: range assignment across sources and resume after a source dies (no sockets)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.membership.state_sync_plan import (
    MAX_PIECE_BYTES,
    MIN_PIECE_BYTES,
    Piece,
    RangePlan,
    piece_size,
)


def test_pieces_cover_the_state_exactly_once() -> None:
    plan = RangePlan(10, ["a", "b"], piece_bytes=3)
    assert plan.pieces == [Piece(0, 3), Piece(3, 3), Piece(6, 3), Piece(9, 1)]
    assert RangePlan(0, ["a"]).complete  # nothing to fetch


def test_idle_sources_pull_work_and_a_dead_source_is_resumed_elsewhere() -> None:
    plan = RangePlan(8, ["a", "b"], piece_bytes=2)
    first_a, first_b = plan.next_range("a"), plan.next_range("b")
    assert (first_a, first_b) == (Piece(0, 2), Piece(2, 2))
    plan.completed("a", first_a)
    assert plan.next_range("a") == Piece(4, 2)
    plan.failed("b", first_b, "connection reset")  # b dies mid-piece
    assert not plan.is_live("b") and plan.next_range("b") is None
    plan.completed("a", Piece(4, 2))
    assert plan.next_range("a") == Piece(2, 2)  # the missing range comes first
    plan.completed("a", Piece(2, 2))
    assert plan.next_range("a") == Piece(6, 2)
    plan.completed("a", Piece(6, 2))
    assert (
        plan.complete and plan.missing_bytes() == 0 and plan.failures == {"b": "connection reset"}
    )


def test_no_live_source_left_is_stuck() -> None:
    plan = RangePlan(4, ["a"], piece_bytes=2)
    piece = plan.next_range("a")
    plan.failed("a", piece)
    assert plan.stuck and plan.missing_bytes() == 4


def test_protocol_misuse_raises() -> None:
    plan = RangePlan(4, ["a", "b"], piece_bytes=2)
    piece = plan.next_range("a")
    assert piece is not None
    with pytest.raises(ValueError, match="already has a piece"):
        plan.next_range("a")
    with pytest.raises(ValueError, match="not in flight"):
        plan.completed("b", piece)
    with pytest.raises(ValueError, match="unknown source"):
        plan.next_range("zz")
    with pytest.raises(ValueError, match="distinct"):
        RangePlan(4, ["a", "a"])


def test_piece_size_is_bounded() -> None:
    assert piece_size(1, 1) == MIN_PIECE_BYTES
    assert piece_size(10**12, 1) == MAX_PIECE_BYTES
    assert piece_size(64 << 20, 4) == 4 << 20


# An operation: (source index, what happens to its piece in flight or its next request).
OPS = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from(["take", "done", "fail"])), max_size=200
)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(0, 5000),
    piece=st.integers(1, 700),
    n_sources=st.integers(1, 5),
    ops=OPS,
)
def test_any_interleaving_keeps_the_invariants_and_a_survivor_finishes(
    total: int, piece: int, n_sources: int, ops: list[tuple[int, str]]
) -> None:
    sources = [f"s{i}" for i in range(n_sources)]
    plan = RangePlan(total, sources, piece_bytes=piece)
    busy: dict[str, Piece] = {}
    delivered: list[Piece] = []
    for index, what in ops:
        source = sources[index % n_sources]
        if source == "s0" and what == "fail":
            what = "done"  # s0 never fails, so the download must be able to finish
        if what == "take" and source not in busy:
            got = plan.next_range(source)
            if got is not None:
                assert got not in busy.values()  # never in flight at two sources
                busy[source] = got
        elif what == "done" and source in busy:
            delivered.append(busy[source])
            plan.completed(source, busy.pop(source))
        elif what == "fail" and plan.is_live(source):
            plan.failed(source, busy.pop(source, None), "died")
            assert plan.next_range(source) is None  # a dead source never gets work again
        assert plan.in_flight() == {p: s for s, p in busy.items()}
    # Drain with the survivor(s): whatever happened, the missing ranges are fetched.
    while not plan.complete:
        assert not plan.stuck
        live = [s for s in sources if plan.is_live(s)]
        progressed = False
        for source in live:
            if source in busy:
                delivered.append(busy[source])
                plan.completed(source, busy.pop(source))
                progressed = True
            got = plan.next_range(source)
            if got is not None:
                busy[source] = got
                progressed = True
        assert progressed
    # Every byte is held exactly once and came from one delivered piece.
    assert sorted(delivered) == plan.pieces
    covered = sorted(plan.held_from())
    assert sum(p.length for p in covered) == total
    assert all(a.end == b.offset for a, b in itertools.pairwise(covered))
    assert not covered or (covered[0].offset == 0 and covered[-1].end == total)
