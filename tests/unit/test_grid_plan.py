"""The hierarchical all-reduce's layout: a pure function of the members, rows that are runs of
the sorted ids, every row with a peer for every column."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import LocalProtocolError
from swarm.averaging.grid import grid_plan


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 700),
    row_size=st.integers(1, 80),
    numel=st.integers(0, 5000),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_plan_is_a_pure_function_of_the_members(n, row_size, numel, seed) -> None:
    rng = random.Random(seed)
    peers = [rng.randbytes(38) for _ in range(n)]
    weights = [float(rng.randint(1, 4)) for _ in range(n)]
    plan = grid_plan(peers, weights, numel, row_size)
    order = list(range(n))
    rng.shuffle(order)
    shuffled = grid_plan([peers[i] for i in order], [weights[i] for i in order], numel, row_size)
    assert shuffled == plan
    assert list(plan.peers) == sorted(peers)
    declared = dict(zip(peers, weights, strict=True))
    assert dict(zip(plan.peers, plan.weights, strict=True)) == declared
    sizes = [len(plan.row(k)) for k in range(plan.rows)]
    assert max(sizes) <= row_size and max(sizes) - min(sizes) <= 1
    assert plan.columns == min(sizes) and plan.bounds[0] == 0 and plan.bounds[-1] == n
    assert all(plan.row_of(i) == k for k in range(plan.rows) for i in plan.row(k))
    covered = [plan.sub(c, j) for c in range(plan.columns) for j in range(plan.rows)]
    assert covered[0][0] == 0 and covered[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_bad_members_are_one_line_errors() -> None:
    with pytest.raises(LocalProtocolError, match="unique peers"):
        grid_plan([b"a", b"a"], [1.0, 1.0], 8, 4)
    with pytest.raises(LocalProtocolError, match="row_size"):
        grid_plan([b"a"], [1.0], 8, 0)
    with pytest.raises(LocalProtocolError, match="weights"):
        grid_plan([b"a"], [float("nan")], 8, 4)
