"""Pipeline records and routing without sockets: garbage is refused, wiring is weighted, a failed
hop is retried on another server of its stage, and a route never stalls while its stage lives."""

from __future__ import annotations

import ast
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2p import LocalProtocolError, RemoteProtocolError
from swarm.pipeline.records import (
    ServerAnnouncement,
    ServerRecord,
    decode_announcement,
    decode_announcements,
    encode_announcement,
    param_digest,
    servers_key,
)
from swarm.pipeline.routing import (
    Backward,
    ComputeLoss,
    DeadlineReached,
    Fail,
    Finish,
    Forward,
    HopDone,
    HopFailed,
    LossComputed,
    MicrobatchRoute,
    Router,
    RouteState,
    RoutingConfig,
    Start,
)

ROOT = Path(__file__).resolve().parents[2]
HASH = b"\x00" * 32


def server(i: int, stage: int, throughput: float = 10.0, queue: int = 0, relayed: bool = False):
    return ServerAnnouncement(b"peer-%03d" % i, stage, throughput, queue, relayed, -1, HASH)


@pytest.mark.parametrize(
    "rel", ["swarm/pipeline/records.py", "swarm/pipeline/routing.py", "swarm/pipeline/rebalance.py"]
)
def test_module_is_sans_io(rel: str) -> None:
    names = set()
    for node in ast.walk(ast.parse((ROOT / rel).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"trio", "libp2p", "socket", "time", "random", "asyncio", "threading"}


# -- records -----------------------------------------------------------------------------------


announcements = st.builds(
    ServerAnnouncement,
    peer_id=st.binary(min_size=1, max_size=64),
    stage=st.integers(0, 255),
    throughput=st.floats(0, 1e9),
    queue=st.integers(0, 1 << 20),
    relayed=st.booleans(),
    param_round=st.integers(-1, 2**40),
    param_hash=st.binary(min_size=32, max_size=32),
)


@given(announcements)
def test_announcement_round_trips(a: ServerAnnouncement) -> None:
    assert decode_announcement(a.peer_id, encode_announcement(a)) == a


@given(st.binary(max_size=400))
def test_garbage_announcement_parses_or_raises_remote_protocol_error(data: bytes) -> None:
    try:
        a = decode_announcement(b"peer", data)
    except RemoteProtocolError:
        return
    assert decode_announcement(b"peer", encode_announcement(a)) == a


@given(announcements, st.integers(0, 6), st.sampled_from([-1, 1e10, float("nan"), True, "x"]))
def test_out_of_range_fields_are_refused(a: ServerAnnouncement, index: int, bad: object) -> None:
    wire = [1, ServerRecord.TYPE_CODE, list(a.record().to_wire())]  # the p2p wire envelope
    if index == 0:
        wire[0] = 2  # unknown version
    else:
        wire[2][index - 1] = bad  # type: ignore[index]
    import msgpack

    data = msgpack.packb(wire, use_bin_type=True)
    if (index, bad) in ((5, -1), (4, True)):  # legal: round -1 is the initial parameters
        assert decode_announcement(a.peer_id, data).record().to_wire()[index - 1] == bad
        return
    with pytest.raises(RemoteProtocolError):
        decode_announcement(a.peer_id, data)


def test_decode_announcements_skips_bad_entries_and_foreign_stages() -> None:
    good = server(1, 0)
    entries = [
        (good.peer_id, encode_announcement(good)),
        (b"peer-002", b"\xc1garbage"),
        (b"peer-003", encode_announcement(server(3, 5))),
    ]
    assert decode_announcements(entries, num_stages=2) == [good]


def test_servers_key_and_param_digest() -> None:
    assert servers_key("run1") == "pipeline/run1/servers"
    with pytest.raises(ValueError):
        servers_key("a/b")
    a = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(2, np.float32)]
    b = [x.copy() for x in a]
    assert param_digest(a) == param_digest(b)
    b[1][0] = np.nextafter(np.float32(1), np.float32(2))
    assert param_digest(a) != param_digest(b)
    assert param_digest([a[0].reshape(3, 2)]) != param_digest([a[0]])
    assert param_digest([a[0].T]) == param_digest([np.ascontiguousarray(a[0].T)])


# -- router --------------------------------------------------------------------------------------


def test_wiring_is_weighted_by_effective_throughput() -> None:
    router = Router(RoutingConfig(num_stages=1, relay_factor=0.5), random.Random(1))
    router.update([server(0, 0, 30), server(1, 0, 10), server(2, 0, 20, relayed=True)])
    counts = Counter(router.pick(0, 0.0) for _ in range(20_000))
    # weights 30 : 10 : 10 (relayed counts half)
    assert counts[b"peer-000"] / 20_000 == pytest.approx(0.6, abs=0.02)
    assert counts[b"peer-001"] / 20_000 == pytest.approx(0.2, abs=0.02)
    assert counts[b"peer-002"] / 20_000 == pytest.approx(0.2, abs=0.02)


def test_queue_lowers_the_weight_and_zero_throughput_still_gets_a_sliver() -> None:
    router = Router(RoutingConfig(num_stages=1), random.Random(2))
    router.update([server(0, 0, 10, queue=4), server(1, 0, 10), server(2, 0, 0.0)])
    counts = Counter(router.pick(0, 0.0) for _ in range(20_000))
    assert counts[b"peer-001"] > 3 * counts[b"peer-000"]
    assert 0 < counts[b"peer-002"] < 200


def test_excluded_server_is_avoided_then_forgiven() -> None:
    router = Router(RoutingConfig(num_stages=1, exclude_s=5.0), random.Random(3))
    router.update([server(0, 0, 1000), server(1, 0, 1)])
    router.penalize(b"peer-000", now=0.0)
    assert {router.pick(0, 1.0) for _ in range(200)} == {b"peer-001"}
    assert b"peer-000" in {router.pick(0, 5.5) for _ in range(200)}
    router.succeeded(b"peer-000")
    router.penalize(b"peer-000", now=10.0)
    router.penalize(b"peer-000", now=10.0)  # second failure in a row: excluded twice as long
    assert router.excluded(b"peer-000", 19.0) and not router.excluded(b"peer-000", 20.5)
    router.succeeded(b"peer-000")
    assert not router.excluded(b"peer-000", 11.0)


def test_all_excluded_still_picks_the_longest_waiting() -> None:
    router = Router(RoutingConfig(num_stages=2), random.Random(4))
    router.update([server(0, 0), server(1, 0), server(2, 1)])
    router.penalize(b"peer-001", 0.0)
    router.penalize(b"peer-000", 1.0)
    assert router.pick(0, 2.0, tried=[b"peer-000", b"peer-001"]) == b"peer-001"
    router.update([server(2, 1)])
    assert router.pick(0, 2.0) is None


def _run_to_end(route: MicrobatchRoute, fail: dict[tuple[str, int], int]) -> list[object]:
    """Drive a route; ``fail[(kind, stage)]`` hops of that kind fail before one succeeds."""
    log: list[object] = []
    actions = route.handle(Start(), 0.0)
    while actions:
        (action,) = actions
        log.append(action)
        if isinstance(action, Forward | Backward):
            kind = "f" if isinstance(action, Forward) else "b"
            if fail.get((kind, action.stage), 0):
                fail[(kind, action.stage)] -= 1
                actions = route.handle(HopFailed(action.stage, action.peer_id, "dead"), 0.0)
            else:
                actions = route.handle(HopDone(action.stage, action.peer_id), 0.0)
        elif isinstance(action, ComputeLoss):
            actions = route.handle(LossComputed(), 0.0)
        else:
            break
    return log


def test_backward_follows_the_forward_path() -> None:
    router = Router(RoutingConfig(num_stages=3), random.Random(5))
    router.update([server(i, i % 3) for i in range(9)])
    route = MicrobatchRoute(router, deadline=10.0)
    log = _run_to_end(route, {})
    forwards = [a for a in log if isinstance(a, Forward)]
    backwards = [a for a in log if isinstance(a, Backward)]
    assert [a.stage for a in forwards] == [0, 1, 2] and [a.stage for a in backwards] == [2, 1, 0]
    assert [a.peer_id for a in reversed(backwards)] == [a.peer_id for a in forwards]
    assert not any(a.send_inputs for a in backwards)
    assert log[-1] == Finish(tuple(a.peer_id for a in forwards), 0)
    assert route.state is RouteState.DONE
    with pytest.raises(LocalProtocolError):
        route.handle(LossComputed(), 0.0)


def test_failed_backward_resends_inputs_to_another_server() -> None:
    router = Router(RoutingConfig(num_stages=2), random.Random(6))
    router.update([server(i, i % 2) for i in range(4)])
    log = _run_to_end(MicrobatchRoute(router, deadline=10.0), {("b", 0): 1})
    b0 = [a for a in log if isinstance(a, Backward) and a.stage == 0]
    assert len(b0) == 2 and b0[0].peer_id != b0[1].peer_id and b0[1].send_inputs
    assert isinstance(log[-1], Finish) and log[-1].failovers == 1


def test_a_stage_without_servers_fails_clearly_and_attempts_are_bounded() -> None:
    router = Router(RoutingConfig(num_stages=2, max_attempts_per_hop=3), random.Random(7))
    router.update([server(0, 0)])
    log = _run_to_end(MicrobatchRoute(router, deadline=10.0), {})
    assert log[-1] == Fail("stage 1 has no server")
    router.update([server(0, 0), server(1, 1)])
    log = _run_to_end(MicrobatchRoute(router, deadline=10.0), {("f", 1): 99})
    assert isinstance(log[-1], Fail) and "stage 1: 3 attempts" in log[-1].reason


def test_events_out_of_turn_are_local_errors_and_change_nothing() -> None:
    router = Router(RoutingConfig(num_stages=2), random.Random(8))
    router.update([server(0, 0), server(1, 1)])
    route = MicrobatchRoute(router, deadline=10.0)
    with pytest.raises(LocalProtocolError):
        route.handle(LossComputed(), 0.0)
    (forward,) = route.handle(Start(), 0.0)
    assert isinstance(forward, Forward)
    for wrong in (HopDone(1, forward.peer_id), HopDone(0, b"someone-else"), Start()):
        with pytest.raises(LocalProtocolError):
            route.handle(wrong, 0.0)
    assert route.state is RouteState.FORWARD and route.pending == forward.peer_id
    assert route.handle(DeadlineReached(), 11.0)[0] == Fail(
        "microbatch deadline passed at stage 0 (RouteState.FORWARD)"
    )


class RoutingMachine(RuleBasedStateMachine):
    """Servers die and come back, hops fail or succeed at random: every action names a live-looking
    server of the right stage, a failed hop moves to a server not yet tried when there is one, and
    the route fails only for an empty stage or after its attempt budget."""

    STAGES = 3

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(
            RoutingConfig(num_stages=self.STAGES, max_attempts_per_hop=6), random.Random(0)
        )
        self.alive = {i: i % self.STAGES for i in range(7)}
        self.router.update([server(i, s, 1 + i) for i, s in self.alive.items()])
        self.now = 0.0
        self.route = MicrobatchRoute(self.router, deadline=1e9)
        self.action: object = self.route.handle(Start(), self.now)[0]
        self.tried: list[bytes] = []
        self.finished = 0

    def _apply(self, actions: list[object]) -> None:
        (action,) = actions
        self.action = action
        if isinstance(action, Forward) or (isinstance(action, Backward) and action.send_inputs):
            # A fresh pick (a backward to the forward's holder may name a server since gone).
            assert self.router.stage_of(action.peer_id) == action.stage
            untried = {a.peer_id for a in self.router.servers(action.stage)} - set(self.tried)
            if untried:
                assert action.peer_id in untried, "a retry must go to a server not tried yet"
        if isinstance(action, Fail):
            assert not self.router.servers(self.route.stage) or len(self.tried) >= 6, action

    @precondition(lambda self: isinstance(self.action, Forward | Backward))
    @rule()
    def hop_succeeds(self) -> None:
        a = self.action
        self.tried = []
        self._apply(self.route.handle(HopDone(a.stage, a.peer_id), self.now))  # type: ignore[union-attr]

    @precondition(lambda self: isinstance(self.action, Forward | Backward))
    @rule(penalize=st.booleans())
    def hop_fails(self, penalize: bool) -> None:
        a = self.action
        event = HopFailed(a.stage, a.peer_id, "dead", penalize)  # type: ignore[union-attr]
        self.tried.append(a.peer_id)  # type: ignore[union-attr]
        self._apply(self.route.handle(event, self.now))

    @precondition(lambda self: isinstance(self.action, ComputeLoss))
    @rule()
    def loss(self) -> None:
        self.tried = []
        self._apply(self.route.handle(LossComputed(), self.now))

    @rule(i=st.integers(0, 9), stage=st.integers(0, STAGES - 1), join=st.booleans())
    def churn(self, i: int, stage: int, join: bool) -> None:
        if join:
            self.alive[i] = stage
        else:
            self.alive.pop(i, None)
        self.router.update([server(j, s, 1 + j) for j, s in self.alive.items()])

    @rule(dt=st.floats(0, 30))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: isinstance(self.action, Finish | Fail))
    @rule()
    def next_microbatch(self) -> None:
        self.finished += 1
        self.route = MicrobatchRoute(self.router, deadline=1e9)
        self.tried = []
        self.action = None
        self._apply(self.route.handle(Start(), self.now))

    @invariant()
    def finish_path_has_one_server_per_stage(self) -> None:
        if isinstance(self.action, Finish):
            assert len(self.action.path) == self.STAGES and all(self.action.path)


RoutingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRouting = RoutingMachine.TestCase
