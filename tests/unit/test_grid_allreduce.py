"""``GridAllReduce`` without a simulator: machines joined by a fake wire that delivers in a random
order; the result equals the flat ``reduce_part`` over the same contributors byte for byte, with
any weights and any delivery order; bad items drop their sender."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import LocalProtocolError
from swarm.averaging.aggregation import reduce_part
from swarm.averaging.allreduce import DropPeer, Finish, PeerLost
from swarm.averaging.grid import grid_plan
from swarm.averaging.hierarchical import GridAllReduce, ItemReceived, RawPart, SendItem


def run(n: int, row: int, numel: int, seed: int, lost: int | None = None):
    rng = random.Random(seed)
    peers = [rng.randbytes(8) for _ in range(n)]
    weights = [rng.uniform(0.1, 10.0) for _ in range(n)]
    vectors = {
        p: np.random.default_rng([seed, i]).standard_normal(numel).astype(np.float32)
        for i, p in enumerate(peers)
    }
    plan = grid_plan(peers, weights, numel, row)
    machines = {p: GridAllReduce(p, plan, vectors[p], deadline=1e9) for p in peers}
    wire: list[tuple[bytes, object]] = []
    results = {}

    def apply(peer: bytes, actions) -> None:
        for action in actions:
            if isinstance(action, SendItem):
                wire.append((action.peer, ItemReceived(peer, action.item)))
            elif isinstance(action, Finish):
                results[peer] = action

    for p in peers:
        if p != lost:
            apply(p, machines[p].start(0.0))
    if lost is not None:  # it never sent anything: every peer watching it sees it gone
        for p in peers:
            if p != lost:
                apply(p, machines[p].handle(PeerLost(lost), 0.0))
    while wire:
        dst, event = wire.pop(rng.randrange(len(wire)))
        if dst != lost:
            apply(dst, machines[dst].handle(event, 0.0))
    return peers, weights, vectors, plan, results


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(2, 40),
    row=st.integers(2, 9),
    numel=st.integers(0, 90),
    seed=st.integers(0, 10**6),
)
def test_any_delivery_order_gives_the_flat_reduce_part_bit_for_bit(n, row, numel, seed) -> None:
    peers, weights, vectors, _, results = run(n, row, numel, seed)
    assert len(results) == n
    flat = reduce_part({p: (vectors[p], w) for p, w in zip(peers, weights, strict=True)})
    assert {r.result.tobytes() for r in results.values()} == {flat.tobytes()}
    assert {r.contributors for r in results.values()} == {
        tuple(sorted(zip(peers, weights, strict=True)))
    }


def test_a_peer_lost_before_sending_is_excluded_everywhere() -> None:
    peers, weights, vectors, _, results = run(30, 6, 50, seed=3, lost=None)
    lost = sorted(peers)[7]
    peers, weights, vectors, _, results = run(30, 6, 50, seed=3, lost=lost)
    assert len(results) == 29
    kept = {p: (vectors[p], w) for p, w in zip(peers, weights, strict=True) if p != lost}
    assert {r.result.tobytes() for r in results.values()} == {reduce_part(kept).tobytes()}


def test_bad_items_drop_their_sender_and_bad_setup_is_refused() -> None:
    peers = [b"a", b"b", b"c", b"d"]
    plan = grid_plan(peers, [1.0] * 4, 8, 2)
    machine = GridAllReduce(b"a", plan, np.zeros(8, np.float32), deadline=10.0)
    machine.start(0.0)
    bad = RawPart(0, np.full(4, np.nan, np.float32), 1.0)
    actions = machine.handle(ItemReceived(b"b", bad), 1.0)
    assert DropPeer(b"b", "NaN or inf values") in actions and b"b" not in machine.alive
    with pytest.raises(LocalProtocolError, match=r"plan\.numel"):
        GridAllReduce(b"a", plan, np.zeros(7, np.float32), deadline=10.0)
