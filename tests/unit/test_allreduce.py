"""The all-reduce machine, driven through a fake network: no sockets, no clocks, no sleeps."""

from __future__ import annotations

import itertools
import math
import random
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p import LocalProtocolError, RemoteProtocolError
from swarm.averaging.aggregation import aggregate
from swarm.averaging.allreduce import (
    AllReduce,
    AllReduceState,
    DeadlineReached,
    DropPeer,
    Fail,
    Finish,
    PartReceived,
    PeerLost,
    PeerMisbehaved,
    ReducedPartReceived,
    SendPart,
    SendReduced,
    all_finite,
    partition,
    reduce_part,
)
from swarm.averaging.buffers import BufferPool


def peer_ids(n: int) -> list[bytes]:
    return [bytes([65 + i]) * 4 for i in range(n)]


class FakeNetwork:
    """N machines joined by FIFO links (h11's ConnectionPair, for N peers).

    Each directed link is a queue; ``step`` delivers the head of one link chosen by ``rng``, so
    links interleave in any order while each stays in order, as one stream per pair does. A
    crash cuts the crashed peer's outgoing links after a random prefix and then tells each
    survivor ``PeerLost`` on that link: the loss is noticed after whatever got through.
    """

    def __init__(
        self, vectors, weights, bandwidths, rng: random.Random, finalize=None, chunks=1,
        pooled=False, aggregation="mean",
    ) -> None:  # fmt: skip
        self.ids = peer_ids(len(vectors))
        self.aggregation = aggregation
        self.vectors = dict(zip(self.ids, vectors, strict=True))
        self.weights = dict(zip(self.ids, weights, strict=True))
        self.machines = {
            me: AllReduce(
                me,
                self.ids,
                bandwidths,
                self.vectors[me],
                self.weights[me],
                100.0,
                finalize,
                chunks,
                # Reduced parts written into a pool's buffers, reused once nothing holds them.
                allocate=BufferPool().take if pooled else None,
                aggregation=aggregation,
            )
            for me in self.ids
        }
        self.links: dict[tuple[bytes, bytes], deque] = {
            (a, b): deque() for a in self.ids for b in self.ids if a != b
        }
        self.rng = rng
        self.dead: set[bytes] = set()
        self.finished: dict[bytes, Finish] = {}
        self.failed: dict[bytes, Fail] = {}
        self.drops: list[tuple[bytes, DropPeer]] = []
        self.orders: dict[tuple[bytes, bytes], int] = {}  # (from, to) -> sends ordered

    def start(self, peers=None) -> None:
        for me in peers or self.ids:
            self.apply(me, self.machines[me].start(0.0))

    def apply(self, me: bytes, actions) -> None:
        for action in actions:
            if isinstance(action, SendPart | SendReduced):
                count = self.orders[(me, action.peer)] = self.orders.get((me, action.peer), 0) + 1
                assert count <= self.machines[me].max_orders_per_peer, "a driver queue overflows"
            if isinstance(action, SendPart):
                data = self.vectors[me][action.start : action.stop].copy()
                event = PartReceived(me, action.part_index, data, self.weights[me])
                self.links[(me, action.peer)].append(event)
            elif isinstance(action, SendReduced):
                event = ReducedPartReceived(
                    me, action.part_index, action.data.copy(), action.contributors
                )
                self.links[(me, action.peer)].append(event)
            elif isinstance(action, Finish):
                assert me not in self.finished, "finished twice"
                self.finished[me] = action
            elif isinstance(action, Fail):
                self.failed[me] = action
            else:
                assert isinstance(action, DropPeer)
                self.drops.append((me, action))

    def crash(self, peer: bytes) -> None:
        self.dead.add(peer)
        for (a, b), queue in self.links.items():
            if b == peer:
                queue.clear()
            elif a == peer:
                keep = self.rng.randint(0, len(queue))
                while len(queue) > keep:
                    queue.pop()
                queue.append(PeerLost(peer))

    def inject(self, sender: bytes, to: bytes, event) -> None:
        self.links[(sender, to)].append(event)

    def step(self) -> bool:
        busy = [key for key, queue in self.links.items() if queue and key[1] not in self.dead]
        if not busy:
            return False
        sender, to = self.rng.choice(sorted(busy))
        event = self.links[(sender, to)].popleft()
        if to in self.failed:
            return True
        self.apply(to, self.machines[to].handle(event, 1.0))
        return True

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("network did not go quiet")

    def survivors(self) -> list[bytes]:
        return [p for p in self.ids if p not in self.dead]


def expected_mean(net: FakeNetwork, contributors) -> np.ndarray:
    if net.aggregation == "mean":
        return reduce_part({p: (net.vectors[p], w) for p, w in contributors})
    # A robust rule is computed part by part (centered clipping's norms are a part's).
    parts = next(iter(net.machines.values())).parts
    return np.concatenate(
        [np.empty(0, np.float32)]
        + [
            aggregate(net.aggregation, {p: (net.vectors[p][a:b], w) for p, w in contributors})
            for _, a, b in parts
        ]
    )


def assert_agreement(net: FakeNetwork, must_include=(), must_exclude=()) -> Finish | None:
    survivors = net.survivors()
    if len(survivors) == 1 and len(net.ids) > 1 and survivors[0] not in net.finished:
        # rule 7: a lone survivor's own vector back is no average (unless it finished before
        # the others went)
        assert net.failed == {survivors[0]: Fail("every other peer of the round was lost")}
        return None
    assert not net.failed, net.failed
    assert set(net.finished) >= set(survivors)
    finishes = [net.finished[p] for p in survivors]
    first = finishes[0]
    for finish in finishes[1:]:
        assert finish.result.tobytes() == first.result.tobytes()
        assert finish.contributors == first.contributors
    for p in survivors:
        assert net.machines[p].state is AllReduceState.DONE
    contributors = dict(first.contributors)
    assert set(must_include) <= contributors.keys()
    assert not set(must_exclude) & contributors.keys()
    assert all(contributors[p] == net.weights[p] for p in contributors)
    assert first.result.dtype == np.float32
    assert first.result.tobytes() == expected_mean(net, first.contributors).tobytes()
    return first


def make_vectors(rng: random.Random, n: int, numel: int) -> list[np.ndarray]:
    gen = np.random.default_rng(rng.randrange(2**32))
    return [gen.standard_normal(numel).astype(np.float32) * 10 for _ in range(n)]


round_setup = st.tuples(
    st.integers(2, 8),  # peers
    st.integers(0, 300),  # numel
    st.randoms(use_true_random=False),
)


def build(setup, weights=None, aggregation="mean") -> FakeNetwork:
    n, numel, rng = setup
    bandwidths = [rng.randint(1, 1000) for _ in range(n)]
    weights = weights or [rng.choice([1.0, 0.5, 3.0, rng.uniform(0.1, 10)]) for _ in range(n)]
    # Several chunks per peer: the reducer of part p is then the owner of chunk group p // chunks.
    chunks = rng.choice([1, 1, 2, 3])
    pooled = rng.random() < 0.5
    vectors = make_vectors(rng, n, numel)
    return FakeNetwork(
        vectors, weights, bandwidths, rng, chunks=chunks, pooled=pooled, aggregation=aggregation
    )


# ---- partition and reducer ---------------------------------------------------------------------


@given(st.integers(0, 10_000), st.lists(st.integers(1, 10**9), min_size=1, max_size=16))
def test_partition_covers_every_element_once_in_peer_order(numel, bandwidths):
    peers = peer_ids(len(bandwidths))
    parts = partition(numel, peers, bandwidths)
    assert [p for p, _, _ in parts] == peers
    assert parts[0][1] == 0 and parts[-1][2] == numel
    for (_, _, stop), (_, start, _) in itertools.pairwise(parts):
        assert stop == start
    total = sum(bandwidths)
    for (_, start, stop), bandwidth in zip(parts, bandwidths, strict=True):
        assert abs((stop - start) - numel * bandwidth / total) <= 1
    assert partition(numel, peers, bandwidths) == parts


@given(
    st.integers(0, 10_000),
    st.lists(st.integers(1, 1000), min_size=1, max_size=8),
    st.integers(1, 5),
)
def test_partition_chunks_split_each_peers_range(numel, bandwidths, chunks):
    peers = peer_ids(len(bandwidths))
    whole = partition(numel, peers, bandwidths)
    parts = partition(numel, peers, bandwidths, chunks)
    assert len(parts) == len(peers) * chunks
    for i, (peer, start, stop) in enumerate(whole):
        mine = parts[i * chunks : (i + 1) * chunks]
        assert {p for p, _, _ in mine} == {peer}
        assert mine[0][1] == start and mine[-1][2] == stop
        assert all(a[2] == b[1] for a, b in itertools.pairwise(mine))
        assert max(b - a for _, a, b in mine) - min(b - a for _, a, b in mine) <= 1


@pytest.mark.parametrize(
    ("peers", "bandwidths"),
    [([b"b", b"a"], [1, 1]), ([b"a", b"a"], [1, 1]), ([b"a"], [0]), ([b"a"], [1.5]), ([], [])],
)
def test_partition_refuses_bad_input(peers, bandwidths):
    with pytest.raises(LocalProtocolError):
        partition(10, peers, bandwidths)


@given(st.integers(1, 8), st.integers(0, 50), st.randoms(use_true_random=False))
def test_reduce_part_is_order_free_and_a_weighted_mean(n, numel, rng):
    vectors = make_vectors(rng, n, numel)
    weights = [rng.uniform(0.1, 5) for _ in range(n)]
    items = list(zip(peer_ids(n), zip(vectors, weights, strict=True), strict=True))
    forward = reduce_part(dict(items))
    rng.shuffle(items)
    assert reduce_part(dict(items)).tobytes() == forward.tobytes()
    reference = sum(v.astype(np.float64) * w for v, w in zip(vectors, weights, strict=True))
    np.testing.assert_allclose(forward, reference / sum(weights), rtol=1e-5, atol=1e-5)
    assert forward.dtype == np.float32


# ---- the round ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup)
def test_every_peer_finishes_with_identical_bytes(setup):
    net = build(setup)
    net.start()
    net.run()
    finish = assert_agreement(net, must_include=net.ids)
    assert len(finish.result) == setup[1]
    assert not net.drops


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup, st.integers(0, 400), st.integers(0, 7))
def test_one_crash_at_any_moment_leaves_survivors_agreeing(setup, crash_after, victim):
    net = build(setup)
    dead = net.ids[victim % len(net.ids)]
    net.start()
    for _ in range(crash_after):
        if not net.step():
            break
    net.crash(dead)
    net.run()
    finish = assert_agreement(net, must_include=net.survivors())
    assert finish is None or len(finish.result) == setup[1]


@pytest.mark.parametrize("rule", ["centered_clip", "trimmed_mean"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=round_setup, crash_after=st.integers(0, 400), victim=st.integers(0, 7))
def test_a_robust_rule_leaves_survivors_of_a_crash_agreeing_on_its_result(
    rule, setup, crash_after, victim
):
    """The fault matrix under a robust rule: whoever reduces a part (its reducer, or the next
    one after a crash) produces the rule's bytes over the contributor set."""
    net = build(setup, aggregation=rule)
    net.start()
    for _ in range(crash_after):
        if not net.step():
            break
    net.crash(net.ids[victim % len(net.ids)])
    net.run()
    assert_agreement(net, must_include=net.survivors())


def test_the_machine_refuses_an_unknown_aggregation():
    with pytest.raises(LocalProtocolError, match="aggregation"):
        AllReduce(b"a", [b"a"], [1], np.zeros(3, np.float32), 1.0, 1.0, aggregation="median")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup, st.lists(st.tuples(st.integers(0, 300), st.integers(0, 7)), max_size=3))
def test_several_crashes_leave_survivors_agreeing(setup, crashes):
    net = build(setup)
    net.start()
    for steps, victim in crashes:
        for _ in range(steps):
            net.step()
        candidate = net.ids[victim % len(net.ids)]
        if candidate not in net.dead and len(net.survivors()) > 1:
            net.crash(candidate)
    net.run()
    assert_agreement(net, must_include=net.survivors())


def test_peer_gone_before_the_round_is_excluded():
    net = build((4, 101, random.Random(1)))
    dead = net.ids[2]
    net.start([p for p in net.ids if p != dead])
    net.crash(dead)
    net.run()
    finish = assert_agreement(net, must_include=net.survivors(), must_exclude=[dead])
    assert len(finish.result) == 101
    assert all(action.peer == dead for _, action in net.drops)


@pytest.mark.parametrize("seed", range(20))
def test_a_misbehaving_peer_seen_by_one_peer_is_excluded_by_all(seed):
    """The driver caught garbage from C at A only: A drops C, and the exclusion spreads."""
    net = build((4, 101, random.Random(seed)))
    liar, witness = net.ids[3], net.ids[seed % 3]
    net.start()
    net.apply(witness, net.machines[witness].handle(PeerMisbehaved(liar, "NaN values"), 0.5))
    net.dead.add(liar)  # it is still running, but whatever it does is ignored from now on
    for queue in (q for (a, b), q in net.links.items() if b == liar):
        queue.clear()
    net.run()
    assert_agreement(net, must_include=net.survivors(), must_exclude=[liar])
    assert (witness, DropPeer(liar, "NaN values")) in net.drops


def test_reducer_lost_while_reducing_is_replaced_and_excluded():
    net = build((5, 97, random.Random(2)))
    reducer = net.ids[1]
    net.start()
    # deliver every raw slice, but nothing the reducer sends after that
    for (sender, to), queue in net.links.items():
        while queue and isinstance(queue[0], PartReceived):
            net.apply(to, net.machines[to].handle(queue.popleft(), 1.0))
        assert sender != reducer or not queue or isinstance(queue[0], ReducedPartReceived)
    for queue in (q for (a, _), q in net.links.items() if a == reducer):
        queue.clear()
    net.crash(reducer)
    net.run()
    finish = assert_agreement(net, must_include=net.survivors(), must_exclude=[reducer])
    assert len(finish.result) == 97


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lambda data: data[:-1], "length"),
        (lambda data: np.where(np.arange(len(data)) == 0, np.nan, data).astype(np.float32), "NaN"),
        (lambda data: np.full_like(data, np.inf), "NaN or inf"),
        (lambda data: data.astype(np.float64), "float32"),
    ],
)
def test_bad_contribution_drops_the_sender(bad, reason):
    net = build((4, 80, random.Random(3)))
    liar = net.ids[3]
    for me in net.ids:
        actions = net.machines[me].start(0.0)
        for action in actions:
            if me == liar and isinstance(action, SendPart) and action.part_index == 0:
                data = bad(net.vectors[me][action.start : action.stop])
                net.inject(me, action.peer, PartReceived(me, 0, data, net.weights[me]))
            else:
                net.apply(me, [action])
    net.run()
    first_drop = next(a for who, a in net.drops if who == net.ids[0])
    assert first_drop.peer == liar and reason in first_drop.reason
    # nobody sends to the liar any more, so it never finishes; its deadline fails its round
    assert liar not in net.finished
    assert net.machines[liar].handle(DeadlineReached(), 100.0)[0].reason.startswith("deadline")
    net.dead.add(liar)
    assert_agreement(net, must_include=net.survivors(), must_exclude=[liar])


def test_duplicate_slice_and_changed_weight_drop_the_sender():
    net = build((3, 30, random.Random(4)))
    a, b, _ = net.ids
    machine = net.machines[a]
    machine.start(0.0)
    data = net.vectors[b][: machine.parts[0][2]]
    assert machine.handle(PartReceived(b, 0, data, net.weights[b]), 1.0) == []
    actions = machine.handle(PartReceived(b, 0, data, net.weights[b]), 1.0)
    assert DropPeer(b, "duplicate slice of part 0") in actions
    assert b not in machine.members and b not in machine.alive
    # a message from the dropped peer afterwards is ignored
    assert machine.handle(PartReceived(b, 0, data, net.weights[b]), 1.0) == []


def test_a_weight_outside_the_runs_bounds_drops_the_sender():
    me, honest, liar = b"a", b"b", b"c"
    peers = [me, honest, liar]
    local = np.ones(30, dtype=np.float32)
    machine = AllReduce(me, peers, [1, 1, 1], local, 2.0, math.inf, weight_bounds=(0.0, 10.0))
    machine.start(0.0)
    _, start, stop = machine.parts[0]
    data = np.ones(stop - start, dtype=np.float32)
    assert machine.handle(PartReceived(honest, 0, data, 10.0), 1.0) == []  # the bound itself
    actions = machine.handle(PartReceived(liar, 0, data, 1e6), 1.0)
    assert DropPeer(liar, "weight 1e+06 outside the run's bounds [0, 10]") in actions
    assert liar not in machine.members
    with pytest.raises(LocalProtocolError):  # ours must be inside as well
        AllReduce(me, peers, [1, 1, 1], local, 11.0, math.inf, weight_bounds=(0.0, 10.0))
    # A verified run fixes the weight: anything else is dropped.
    fixed = AllReduce(me, peers, [1, 1, 1], local, 5.0, math.inf, weight_bounds=(5.0, 5.0))
    fixed.start(0.0)
    assert any(
        isinstance(a, DropPeer) for a in fixed.handle(PartReceived(honest, 0, data, 4.0), 1.0)
    )


def test_a_slice_the_check_refuses_drops_its_sender():
    me, owner, other = b"a", b"b", b"c"
    local = np.ones(30, dtype=np.float32)
    expected = np.full(30, 2.0, dtype=np.float32)  # what ``owner`` must send (a verified task)

    def check(sender: bytes, start: int, values: np.ndarray) -> str | None:
        if sender == owner and not np.array_equal(values, expected[start : start + len(values)]):
            return "not its committed task"
        return None

    machine = AllReduce(me, [me, owner, other], [1, 1, 1], local, 1.0, math.inf, check_slice=check)
    machine.start(0.0)
    _, start, stop = machine.parts[0]
    assert machine.handle(PartReceived(other, 0, np.ones(stop - start, np.float32), 1.0), 1.0) == []
    honest = machine.handle(PartReceived(owner, 0, expected[start:stop].copy(), 1.0), 1.0)
    assert not any(isinstance(a, DropPeer) for a in honest)
    again = AllReduce(me, [me, owner, other], [1, 1, 1], local, 1.0, math.inf, check_slice=check)
    again.start(0.0)
    lied = again.handle(PartReceived(owner, 0, np.ones(stop - start, np.float32), 1.0), 1.0)
    assert DropPeer(owner, "part 0: not its committed task") in lied


def test_deadline_fails_an_unfinished_round_and_is_ignored_after_done():
    net = build((3, 12, random.Random(5)))
    net.start()
    machine = net.machines[net.ids[0]]
    assert machine.handle(DeadlineReached(), 100.0)[0].reason.startswith("deadline reached")
    assert machine.state is AllReduceState.FAILED
    with pytest.raises(LocalProtocolError):
        machine.handle(DeadlineReached(), 101.0)
    other = build((3, 12, random.Random(5)))
    other.start()
    other.run()
    assert other.machines[other.ids[0]].handle(DeadlineReached(), 100.0) == []


def test_calls_out_of_order_raise():
    net = build((2, 4, random.Random(6)))
    machine = net.machines[net.ids[0]]
    with pytest.raises(LocalProtocolError):
        machine.handle(PeerLost(net.ids[1]), 0.0)
    machine.start(0.0)
    with pytest.raises(LocalProtocolError):
        machine.start(0.0)
    with pytest.raises(LocalProtocolError):
        machine.handle(object(), 0.0)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError):
        machine.handle(PeerLost(b"stranger"), 0.0)


arrays = st.one_of(
    st.integers(0, 40).map(lambda n: np.arange(n, dtype=np.float32)),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=40).map(
        lambda xs: np.array(xs, dtype=np.float32)
    ),
    st.integers(0, 40).map(lambda n: np.zeros(n, dtype=np.float64)),
    st.just(np.zeros((2, 2), dtype=np.float32)),
    st.just(b"not an array"),
)
senders = st.sampled_from([*peer_ids(4), b"stranger", b""])
weights = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 3), st.none())
contributor_lists = st.one_of(
    st.lists(st.tuples(senders, weights), max_size=5).map(tuple),
    st.just(()),
    st.just("garbage"),
)
garbage_events = st.one_of(
    st.builds(PartReceived, senders, st.integers(-2, 6), arrays, weights),
    st.builds(ReducedPartReceived, senders, st.integers(-2, 6), arrays, contributor_lists),
    st.builds(PeerLost, senders),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(garbage_events, max_size=12))
def test_garbage_is_rejected_or_dropped_never_crashes(events):
    net = build((4, 40, random.Random(7)))
    machine = net.machines[net.ids[0]]
    machine.start(0.0)
    for event in events:
        try:
            actions = machine.handle(event, 1.0)
        except RemoteProtocolError:
            continue
        except LocalProtocolError:
            assert machine.state is AllReduceState.FAILED
            break
        assert all(
            isinstance(a, SendPart | SendReduced | DropPeer | Finish | Fail) for a in actions
        )
        for held, (_, start, stop) in zip(machine.held, machine.parts, strict=True):
            assert held is None or (len(held[0]) == stop - start and np.isfinite(held[0]).all())
        assert machine.me in machine.alive or machine.state is AllReduceState.FAILED


def test_reducer_lost_mid_broadcast_is_forwarded_by_a_peer_that_already_finished():
    net = build((4, 64, random.Random(8)))
    reducer, early = net.ids[3], net.ids[0]
    net.start()
    # everything flows except the reducer's reduced part to anyone but `early`
    held_back = []
    while net.step():
        for (sender, to), queue in net.links.items():
            if sender == reducer and to != early:
                held_back += [e for e in queue if isinstance(e, ReducedPartReceived)]
                kept = [e for e in queue if not isinstance(e, ReducedPartReceived)]
                queue.clear()
                queue.extend(kept)
    assert early in net.finished and held_back
    assert not set(net.finished) - {early, reducer}
    net.crash(reducer)
    net.run()
    # the others got the lost reducer's part from `early`, so all agree with what it returned
    assert_agreement(net, must_include=net.ids)


def _to_fp16(part_index: int, reduced: np.ndarray) -> np.ndarray:
    return reduced.astype(np.float16).astype(np.float32)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_setup, st.integers(0, 400), st.integers(0, 7))
def test_finalize_is_what_every_survivor_holds(setup, crash_after, victim):
    """A lossy codec's encode-then-decode, applied by the reducer, is what survivors hold."""
    n, numel, rng = setup
    bandwidths = [rng.randint(1, 1000) for _ in range(n)]
    net = FakeNetwork(make_vectors(rng, n, numel), [1.0] * n, bandwidths, rng, _to_fp16)
    net.start()
    for _ in range(crash_after):
        if not net.step():
            break
    net.crash(net.ids[victim % n])
    net.run()
    survivors = net.survivors()
    if net.failed:  # rule 7 only: a lone survivor that had not finished
        assert len(survivors) == 1 and set(net.failed) == set(survivors), net.failed
        return
    results = {net.finished[p].result.tobytes() for p in survivors}
    assert len(results) == 1
    first = net.finished[survivors[0]]
    exact = expected_mean(net, first.contributors)
    assert first.result.tobytes() == _to_fp16(0, exact).tobytes()


@pytest.mark.parametrize("index", [0, 65535, 65536, 199_999])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_finds_a_bad_value_in_any_block(index: int, bad: float) -> None:
    data = np.random.default_rng(index).standard_normal(200_000).astype(np.float32)
    assert all_finite(data) and all_finite(data[:0])
    data[index] = bad
    assert not all_finite(data)


def test_a_lone_survivor_fails_instead_of_returning_its_own_vector():
    """Rule 7: in a group of two, the other lost before its slice came leaves nothing to average."""
    net = build((2, 10, random.Random(3)))
    me, other = net.ids
    net.start([me])
    net.crash(other)
    net.run()
    assert net.failed == {me: Fail("every other peer of the round was lost")}
    assert net.machines[me].state is AllReduceState.FAILED
    # a group of one is a round of its own: its vector back is its average
    alone = AllReduce(me, [me], [1], np.ones(4, np.float32), 1.0, 100.0)
    (finish,) = [a for a in alone.start(0.0) if isinstance(a, Finish)]
    assert finish.result.tolist() == [1.0] * 4 and finish.contributors == ((me, 1.0),)


def test_the_machine_reads_its_deadline_from_now():
    """Rule 8: any call at or past the deadline fails an unfinished round; a timer that fires
    early changes nothing; a round started past its deadline fails at once."""
    net = build((3, 12, random.Random(5)))
    net.start()
    me, sender = net.ids[0], net.ids[1]
    machine = net.machines[me]
    assert machine.handle(DeadlineReached(), 99.9) == []
    late = PartReceived(sender, 0, np.zeros(1, np.float32), 1.0)
    (fail,) = machine.handle(late, 100.0)
    assert isinstance(fail, Fail) and fail.reason.startswith("deadline reached")
    assert machine.state is AllReduceState.FAILED
    fresh = build((3, 12, random.Random(5))).machines[me]
    assert fresh.start(100.0) == [Fail("deadline reached before the round started")]
