"""Sparse rounds through the all-reduce machine and the round's wire values (``RoundValues``),
no sockets: slices travel as sparse payloads, reduced parts as their contributors' slices
(``Layout.gathers``), and survivors of a kill or a freeze hold bit-identical means."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allreduce import FakeNetwork, expected_mean, make_vectors, peer_ids, round_setup

from p2p import RemoteProtocolError
from swarm.averaging.allreduce import (
    AllReduceState,
    Fail,
    PartReceived,
    PeerLost,
    ReducedPartReceived,
    SendPart,
    SendReduced,
)
from swarm.averaging.averager import AveragerConfig
from swarm.averaging.payload import Layout
from swarm.averaging.session_wire import KIND_REDUCED, Item, RoundValues, check_item
from swarm.averaging.sparse_codec import SparseCodec

CODEC = SparseCodec(chunk=16, keep=3, bits=2)
# The same density pooled over each part (one segment across the tensors' boundaries).
POOLED = SparseCodec(chunk=16, keep=3, bits=2, select="part")


@dataclass(frozen=True)
class Payload:
    """What a link carries: an order's bytes, decoded by the receiver when delivered."""

    order: SendPart | SendReduced
    sender: bytes
    data: bytes
    weight: float


class SparseNetwork(FakeNetwork):
    """``FakeNetwork`` with the session's wire: each peer's ``RoundValues`` makes its payloads
    (its slices encoded, a reduced part as its contributors' slices) and keeps what it
    receives; a frozen peer neither sends nor receives until it thaws."""

    def __init__(self, originals, weights, bandwidths, rng, chunks, layout: Layout) -> None:
        ids = tuple(peer_ids(len(originals)))
        self.layout = layout
        self.wire = {
            me: RoundValues("run", None, me, layout, vector, None)  # type: ignore[arg-type]
            for me, vector in zip(ids, originals, strict=True)
        }
        decoded = [self.wire[me].wire_values(ids, bandwidths, chunks) for me in ids]
        super().__init__(decoded, weights, bandwidths, rng, chunks=chunks)
        for me in ids:
            self.wire[me].parts = self.machines[me].parts
            assert self.wire[me].finalizer(None) is None  # receivers recompute the mean
        self.frozen: set[bytes] = set()
        self.bytes_sent = dict.fromkeys(ids, 0)

    def apply(self, me: bytes, actions) -> None:
        for action in actions:
            if isinstance(action, SendPart | SendReduced):
                data = bytes(self.wire[me].payload(action))
                self.bytes_sent[me] += len(data)
                payload = Payload(action, me, data, self.weights[me])
                self.links[(me, action.peer)].append(payload)
            else:
                super().apply(me, [action])

    def step(self) -> bool:
        blocked = self.dead | self.frozen
        busy = [
            key
            for key, queue in self.links.items()
            if queue and key[1] not in blocked and key[0] not in self.frozen
        ]
        if not busy:
            return False
        sender, to = self.rng.choice(sorted(busy))
        event = self.links[(sender, to)].popleft()
        if to in self.failed:
            return True
        if isinstance(event, Payload):
            event = self.receive(to, event)
        self.apply(to, self.machines[to].handle(event, 1.0))
        return True

    def receive(self, me: bytes, payload: Payload) -> PartReceived | ReducedPartReceived:
        order, p = payload.order, payload.order.part_index
        _, start, stop = self.machines[me].parts[p]
        if isinstance(order, SendPart):
            self.wire[me].remember_slice(p, payload.sender, payload.data)
            values = self.layout.decode(payload.data, start, stop)
            return PartReceived(payload.sender, p, values, payload.weight)
        contributors = order.contributors
        assert len(payload.data) == self.layout.reduced_bytes(start, stop, len(contributors))
        values = self.layout.decode_reduced(payload.data, start, stop, contributors)
        self.wire[me].remember(values, payload.data)
        return ReducedPartReceived(payload.sender, p, values, contributors)

    def freeze(self, peer: bytes) -> None:
        """SIGSTOP: nothing moves to or from ``peer``; the others' liveness loses it."""
        self.frozen.add(peer)
        for other in self.ids:
            if other != peer and other not in self.failed and other not in self.dead:
                self.apply(other, self.machines[other].handle(PeerLost(peer), 1.0))

    def survivors(self) -> list[bytes]:
        return [p for p in self.ids if p not in self.dead and p not in self.frozen]


def build_sparse(setup) -> SparseNetwork:
    n, numel, rng = setup
    bandwidths = [rng.randint(1, 1000) for _ in range(n)]
    weights = [rng.choice([1.0, 0.5, 3.0, rng.uniform(0.1, 10)]) for _ in range(n)]
    cut = sorted(rng.randint(0, numel) for _ in range(rng.randint(0, 2)))
    sizes = [b - a for a, b in zip([0, *cut], [*cut, numel], strict=True)]
    layout = Layout.for_sizes(sizes, rng.choice([CODEC, POOLED]))
    chunks = rng.choice([1, 1, 2, 3])
    return SparseNetwork(make_vectors(rng, n, numel), weights, bandwidths, rng, chunks, layout)


def assert_survivors_agree(net: SparseNetwork) -> np.ndarray | None:
    """Every survivor finished with the same bytes: the weighted mean of the decoded sparse
    contributions over the contributors they report. A lone survivor fails (rule 7)."""
    survivors = net.survivors()
    if len(survivors) == 1 and survivors[0] not in net.finished:
        assert net.failed.get(survivors[0]) == Fail("every other peer of the round was lost")
        return None
    assert not set(net.failed) & set(survivors), net.failed
    first = net.finished[survivors[0]]
    for peer in survivors:
        assert net.machines[peer].state is AllReduceState.DONE
        assert net.finished[peer].result.tobytes() == first.result.tobytes()
        assert net.finished[peer].contributors == first.contributors
    assert set(survivors) <= dict(first.contributors).keys()
    assert first.result.tobytes() == expected_mean(net, first.contributors).tobytes()
    return first.result


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup)
def test_sparse_rounds_finish_bit_identical_on_the_mean_of_what_was_sent(setup):
    net = build_sparse(setup)
    net.start()
    net.run()
    result = assert_survivors_agree(net)
    assert result is not None and not net.drops
    # A reduced part's payload is its contributors' slices: N slices out, one part's N slices
    # back per other peer, so each peer sends far less than the dense vector when it is long.
    n, numel = len(net.ids), setup[1]
    sparse = sum(net.layout.wire_bytes(a, b) for _, a, b in net.machines[net.ids[0]].parts)
    assert sum(net.bytes_sent.values()) == (n - 1) * sparse + (n - 1) * n * sparse or numel == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup, st.integers(0, 400), st.integers(0, 7))
def test_a_peer_killed_at_any_moment_leaves_sparse_survivors_agreeing(setup, crash_after, victim):
    net = build_sparse(setup)
    net.start()
    for _ in range(crash_after):
        if not net.step():
            break
    net.crash(net.ids[victim % len(net.ids)])
    net.run()
    assert_survivors_agree(net)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup, st.integers(0, 400), st.integers(0, 7))
def test_a_peer_frozen_at_any_moment_is_refused_or_agrees_when_it_thaws(setup, freeze_at, victim):
    """Frozen (SIGSTOP) mid-round and lost by the others' liveness: survivors agree without its
    late messages; thawed, it either fails (it was excluded), or holds the survivors' bytes, or
    (when every message it needed was already on its way before the others dropped it: lost is
    not excluded) finishes over the contributor set it saw, holding exactly that set's mean: its
    round report names another set than the survivors', and its state hash then disagrees with
    theirs, so it re-syncs (``swarmtrain.membership``)."""
    net = build_sparse(setup)
    frozen = net.ids[victim % len(net.ids)]
    net.start()
    for _ in range(freeze_at):
        if not net.step():
            break
    net.freeze(frozen)
    net.run()
    result = assert_survivors_agree(net)
    before_thaw = net.survivors()
    net.frozen.clear()
    net.run()  # it thaws: its queued messages go out, the others' come in
    if frozen in net.finished and result is not None:
        thawed = net.finished[frozen]
        survivors = net.finished[before_thaw[0]]
        if thawed.contributors == survivors.contributors:
            assert thawed.result.tobytes() == result.tobytes()
        else:
            assert thawed.result.tobytes() == expected_mean(net, thawed.contributors).tobytes()
    elif result is not None:
        assert frozen in net.failed or net.machines[frozen].state is not AllReduceState.DONE


def test_a_reduced_part_names_its_slices_and_a_malformed_one_is_refused() -> None:
    layout = Layout.for_sizes([40], CODEC)
    peers = peer_ids(3)
    vectors = make_vectors(random.Random(1), 3, 40)
    data = b"".join(layout.encode(v, 0) for v in vectors)
    contributors = tuple((p, 1.0 + i) for i, p in enumerate(peers))
    mean = layout.decode_reduced(data, 0, 40, contributors)
    decoded = [layout.decode(layout.encode(v, 0), 0, 40) for v in vectors]
    expected = sum(
        d.astype(np.float64) * w for d, (_, w) in zip(decoded, contributors, strict=True)
    )
    np.testing.assert_allclose(mean, expected / 6.0, rtol=1e-6)
    for bad, why in [
        ((data[:-1], contributors), "bytes"),
        ((data, ((peers[0], 1.0), (peers[1], 0.0), (peers[2], 1.0))), "weight"),
        ((data, ((peers[0], 1.0), (peers[0], 1.0), (peers[2], 1.0))), "twice"),
        ((b"", ()), "bytes"),
    ]:
        with pytest.raises(RemoteProtocolError, match=why):
            layout.decode_reduced(bad[0], 0, 40, bad[1])
    # The item's size is checked against its contributors before its payload is read.
    parts = [(p, 0, 40) for p in peers]
    size = layout.wire_bytes(0, 40)

    def reduced(names: tuple[bytes, ...], nbytes: int) -> Item:
        weights = (1.0,) * len(names)
        return Item(KIND_REDUCED, 0, 0.0, names, weights, nbytes, b"\0" * nbytes)

    assert check_item(reduced(tuple(peers), 3 * size), parts, layout)[2] == 3 * size
    with pytest.raises(RemoteProtocolError, match="4 contributors"):
        check_item(reduced((peers[0],) * 4, 4 * size), parts, layout)
    with pytest.raises(RemoteProtocolError, match="expected"):
        check_item(reduced(tuple(peers), size), parts, layout)


def test_sparse_compression_refuses_a_robust_rule_and_a_tampered_part() -> None:
    with pytest.raises(ValueError, match='sparse compression needs aggregation="mean"'):
        AveragerConfig("run", compression=CODEC, aggregation="trimmed_mean")
    values = RoundValues("run", None, b"a", Layout.for_sizes([4], CODEC), np.zeros(4, np.float32),
                         None)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ValueError, match="tampered"):
        values.finalizer(lambda p, x: x)
    # The codec's parameters are in the layout's digest: peers must agree on every one.
    digests = {Layout.for_sizes([4], c).digest for c in (CODEC, SparseCodec(16, 4, 2),
               SparseCodec(16, 3, 3), SparseCodec(32, 3, 2), POOLED)}  # fmt: skip
    assert len(digests) == 5
