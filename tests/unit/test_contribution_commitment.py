"""Issue 19 point 2: a contribution committed before its round (``swarm.averaging.commitment``)
is checked by every reducer in the round: a slice other than the committed one drops its sender
on every survivor, whichever part it is in, with reducers lost mid-round too (the all-reduce
machine through the fake network of ``test_allreduce``)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.averaging.allreduce import AllReduce, partition
from swarm.averaging.commitment import (
    LEAF_DIGEST_BYTES,
    MAX_LEAVES,
    MIN_LEAF_ELEMENTS,
    check_contribution,
    contribution_leaves,
    contribution_root,
    leaf_size,
)
from tests.unit.test_allreduce import FakeNetwork, assert_agreement, make_vectors, peer_ids

NUMEL = 9 * MIN_LEAF_ELEMENTS + 300  # ten leaves, the last one short


def test_leaves_are_few_and_fixed_by_the_length_alone() -> None:
    assert leaf_size(0) == leaf_size(MIN_LEAF_ELEMENTS * MAX_LEAVES) == MIN_LEAF_ELEMENTS
    for numel in (1, 10**6, 10**8 + 7):
        size = leaf_size(numel)
        assert -(-numel // size) <= MAX_LEAVES and size >= MIN_LEAF_ELEMENTS
    vector = np.arange(NUMEL, dtype=np.float32)
    assert len(contribution_leaves(vector)) == 10 * LEAF_DIGEST_BYTES


def test_a_slice_is_checked_against_the_committed_leaves() -> None:
    vector = np.random.default_rng(1).standard_normal(NUMEL, dtype=np.float32)
    root, leaves = contribution_root(vector), contribution_leaves(vector)
    size = leaf_size(NUMEL)
    for start, stop in [(0, NUMEL), (size, 3 * size), (9 * size, NUMEL), (size, size)]:
        assert check_contribution(root, leaves, NUMEL, start, vector[start:stop]) is None
    other = vector.copy()
    other[2 * size + 5] = np.nextafter(other[2 * size + 5], np.float32(9))  # one ulp
    why = check_contribution(root, leaves, NUMEL, size, other[size : 3 * size])
    assert why == "its slice does not match its commitment"
    # Leaves of what it sends instead of what it committed: the leaves give it away.
    lied = contribution_leaves(other)
    why = check_contribution(root, lied, NUMEL, size, other[size : 3 * size])
    assert why == "its slice digests do not match its commitment"
    assert "digests" in (check_contribution(root, b"", NUMEL, 0, vector) or "")
    assert "not on the committed leaves" in (
        check_contribution(root, leaves, NUMEL, 5, vector[5:size]) or ""
    )


@given(
    st.integers(0, 20_000),
    st.lists(st.integers(1, 10**6), min_size=1, max_size=9),
    st.integers(1, 4),
    st.sampled_from([1, 7, 1024]),
)
def test_aligned_parts_cover_the_vector_on_leaf_boundaries(numel, bandwidths, chunks, align):
    parts = partition(numel, peer_ids(len(bandwidths)), bandwidths, chunks, align)
    assert parts[0][1] == 0 and parts[-1][2] == numel
    for (_, _, stop), (_, start, _) in itertools.pairwise(parts):
        assert stop == start
    for _, start, stop in parts:
        assert start <= stop and start % align == 0 and (stop % align == 0 or stop == numel)
    if align == 1:
        assert parts == partition(numel, peer_ids(len(bandwidths)), bandwidths, chunks)


PEERS, BANDWIDTHS, CHUNKS = 4, [1, 2, 3, 1], 2


def _committed_network(seed: int, liar_part: int | None) -> tuple[FakeNetwork, bytes]:
    """Four peers committed to their vectors; the last sends another value in one element of
    part ``liar_part`` (None: honest). Returns the network and the liar."""
    rng = random.Random(seed)
    net = FakeNetwork(make_vectors(rng, PEERS, NUMEL), [1.0, 2.0, 3.0, 1.0], BANDWIDTHS, rng)
    ids = net.ids
    roots = {p: contribution_root(net.vectors[p]) for p in ids}
    leaves = {p: contribution_leaves(net.vectors[p]) for p in ids}
    liar = ids[-1]
    if liar_part is not None:
        _, start, stop = _parts()[liar_part]
        sent = net.vectors[liar].copy()
        sent[(start + stop) // 2] += np.float32(1.0)  # what it sends; it committed the honest one
        net.vectors[liar] = sent

    def check(sender: bytes, start: int, values: np.ndarray) -> str | None:
        return check_contribution(roots[sender], leaves[sender], NUMEL, start, values)

    net.machines = {
        me: AllReduce(
            me, ids, BANDWIDTHS, net.vectors[me], net.weights[me], 100.0, chunks=CHUNKS,
            check_slice=check, align=leaf_size(NUMEL),
        )
        for me in ids
    }  # fmt: skip
    return net, liar


def _parts() -> list[tuple[bytes, int, int]]:
    return partition(NUMEL, peer_ids(PEERS), BANDWIDTHS, CHUNKS, leaf_size(NUMEL))


# The parts others reduce, with a value of the liar's in them (its own parts' reducer is itself:
# no other peer holds its slice there; that is the lying reducer's case, audited after the round).
OTHERS_PARTS = [i for i, (owner, a, b) in enumerate(_parts()) if b > a and owner != peer_ids(4)[-1]]


@pytest.mark.parametrize("liar_part", OTHERS_PARTS)
@pytest.mark.parametrize("seed", range(3))
def test_a_slice_other_than_the_committed_one_drops_its_sender_on_every_survivor(
    liar_part: int, seed: int
) -> None:
    net, liar = _committed_network(seed, liar_part)
    net.start()
    if seed == 2:  # and a reducer other than the one that refuses it lost mid-round
        for _ in range(7):
            net.step()
        net.crash(next(p for p in net.ids if p not in (liar, _parts()[liar_part][0])))
    net.run()
    net.failed.pop(liar, None)  # it is left waiting (no survivor serves it) or sees itself out
    net.dead.add(liar)
    finish = assert_agreement(net, must_exclude=[liar])  # the honest peers' exact mean
    assert finish is not None
    assert any("does not match its commitment" in drop.reason for _, drop in net.drops), net.drops


@pytest.mark.parametrize("seed", range(3))
def test_honest_committed_contributions_all_count(seed: int) -> None:
    net, _ = _committed_network(seed, None)
    net.start()
    net.run()
    finish = assert_agreement(net)
    assert finish is not None and len(finish.contributors) == PEERS
