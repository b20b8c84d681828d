"""Matchmaking: derive_groups is a pure, balanced, mixing partition; no split brain."""

from __future__ import annotations

import ast
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2p import LocalProtocolError, RemoteProtocolError, decode, encode
from swarm.averaging.matchmaking import (
    DeadlineReached,
    Declaration,
    DeclarationsReread,
    DeclarationsSeen,
    Fail,
    Finish,
    LocalRequest,
    Matchmaker,
    MatchmakingConfig,
    MatchState,
    Publish,
    ReadDeclarations,
    derive_groups,
    round_key,
    target_round,
)

SEED = b"run-seed"


def decl(i: int, round_number: int = 0, at: float = 0.0) -> Declaration:
    return Declaration(b"peer-%03d" % i, round_number, 1.0, 1e9, at, 0)


peer_sets = st.sets(st.integers(0, 500), min_size=1, max_size=60)


def partition(groups) -> set[frozenset[bytes]]:
    return {frozenset(g.peer_ids) for g in groups}


def test_module_is_sans_io() -> None:
    path = Path(__file__).resolve().parents[2] / "swarm" / "averaging" / "matchmaking.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"trio", "libp2p", "socket", "time", "random", "asyncio"}


@given(peer_sets, st.integers(0, 50), st.integers(1, 9), st.randoms(use_true_random=False))
def test_derive_groups_is_an_order_independent_balanced_partition(ids, round_number, size, rnd):
    declarations = [decl(i, round_number) for i in ids] + [decl(7, round_number + 1)]
    shuffled = declarations + rnd.sample(declarations, k=len(declarations) // 2)
    rnd.shuffle(shuffled)
    groups = derive_groups(declarations, round_number, max_group_size=size, run_seed=SEED)
    assert groups == derive_groups(shuffled, round_number, max_group_size=size, run_seed=SEED)
    members = [p for g in groups for p in g.peer_ids]
    assert len(members) == len(set(members))
    assert set(members) == {b"peer-%03d" % i for i in ids}
    sizes = [len(g.members) for g in groups]
    assert max(sizes) <= size and max(sizes) - min(sizes) <= 1
    assert [g.index for g in groups] == list(range(len(groups)))
    assert all(list(g.peer_ids) == sorted(g.peer_ids) for g in groups)


def test_a_peer_declared_twice_keeps_its_latest_declaration_in_any_order() -> None:
    old, new = decl(1, at=1.0), decl(1, at=2.0)
    for declarations in ([old, new], [new, old]):
        (group,) = derive_groups(declarations, 0, max_group_size=4, run_seed=SEED)
        assert group.members == (new,)


@given(peer_sets, st.integers(0, 1000), st.integers(2, 9), st.binary(max_size=8))
def test_split_swarms_change_membership_every_round(ids, round_number, size, seed):
    declarations = [decl(i, round_number) for i in ids]
    next_round = [decl(i, round_number + 1) for i in ids]
    now = derive_groups(declarations, round_number, max_group_size=size, run_seed=seed)
    later = derive_groups(next_round, round_number + 1, max_group_size=size, run_seed=seed)
    if len(ids) > size:
        assert partition(now) != partition(later)
    else:
        assert partition(now) == partition(later) == {frozenset(b"peer-%03d" % i for i in ids)}


def test_two_rounds_of_a_full_grid_mix_every_column() -> None:
    """16 peers in 4 groups: each round-1 group holds one peer of every round-0 group."""
    declarations = [decl(i) for i in range(16)]
    first = derive_groups(declarations, 0, max_group_size=4, run_seed=SEED)
    second = derive_groups([decl(i, 1) for i in range(16)], 1, max_group_size=4, run_seed=SEED)
    for group in second:
        assert sorted(next(g.index for g in first if p in g.peer_ids) for p in group.peer_ids) == [
            0,
            1,
            2,
            3,
        ]


def test_declaration_wire_round_trip_and_rejects() -> None:
    d = decl(3, 5, 12.5)
    assert decode(encode(d), Declaration) == d
    assert Declaration.from_wire(d.to_wire()) == d
    assert round_key("abc", 7) == b"run/abc/round/7"
    code = Declaration.TYPE_CODE
    for bad in (
        None,
        [],
        [b"", 0, 1.0, 1.0, 0.0, 0],
        [b"x", -1, 1, 1, 0, 0],
        [b"x", 0, float("nan"), 1.0, 0.0, 0],
    ):
        with pytest.raises(RemoteProtocolError):
            Declaration.from_wire(bad)
        with pytest.raises(RemoteProtocolError):
            decode(msgpack.packb([1, code, bad]), Declaration)
    with pytest.raises(RemoteProtocolError):  # another version of the envelope
        decode(msgpack.packb([2, code, d.to_wire()]), Declaration)


wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.binary(max_size=70)
    | st.text(max_size=4),
    lambda children: st.lists(children, max_size=8),
    max_leaves=20,
)


@given(wire_values)
def test_garbage_declarations_decode_or_raise_remote_protocol_error(obj) -> None:
    try:
        d = Declaration.from_wire(obj)
    except RemoteProtocolError:
        return
    assert Declaration.from_wire(d.to_wire()) == d


def test_target_round() -> None:
    assert target_round(4, now=1.0, round_deadline=2.0, expected=True) == 4
    assert target_round(4, now=2.0, round_deadline=2.0, expected=True) == 5
    assert target_round(4, now=1.0, round_deadline=2.0, expected=False) == 5


def machine(i: int, expected, deadline: float = 10.0, size: int = 4) -> Matchmaker:
    config = MatchmakingConfig(max_group_size=size, run_seed=SEED, confirm_timeout_s=1.0)
    return Matchmaker(
        b"peer-%03d" % i,
        0,
        expected_peers=[b"peer-%03d" % e for e in expected],
        deadline=deadline,
        config=config,
    )


def test_finishes_as_soon_as_every_expected_peer_declared_and_ignores_late_ones() -> None:
    m = machine(0, [0, 1, 2])
    assert m.handle(LocalRequest(decl(0)), 0.0) == [Publish(decl(0))]
    assert (
        m.handle(DeclarationsSeen((decl(1), decl(9, round_number=0), decl(5, round_number=1))), 0.1)
        == []
    )
    (finish,) = m.handle(DeclarationsSeen((decl(2),)), 0.2)
    assert isinstance(finish, Finish) and m.state is MatchState.FORMED
    # peer 9 was not expected: it is deferred, not in any group
    assert finish.group.peer_ids == (b"peer-000", b"peer-001", b"peer-002")
    assert m.handle(DeclarationsSeen((decl(3),)), 0.3) == []
    assert m.handle(DeadlineReached(), 10.0) == []
    assert m.group == finish.group


def test_deadline_rereads_then_forms_with_whoever_declared() -> None:
    m = machine(0, [0, 1, 2])
    m.handle(LocalRequest(decl(0)), 0.0)
    m.handle(DeclarationsSeen((decl(1),)), 1.0)
    # the missing expected peer is asked directly, besides the read of the key
    assert m.handle(DeadlineReached(), 10.0) == [ReadDeclarations(0, frozenset({b"peer-002"}))]
    assert m.state is MatchState.CONFIRMING and m.deadline == 11.0
    late = decl(4, at=10.5)  # stamped after the deadline: joins the next round
    reread = DeclarationsReread((decl(3, at=9.0), late), frozenset({b"peer-002"}))
    (finish,) = m.handle(reread, 10.1)  # peer 2 did not answer: no need to wait for it
    assert finish.group.peer_ids == (b"peer-000", b"peer-001", b"peer-003")


def test_an_expected_peer_that_answers_is_waited_for_until_the_confirm_deadline() -> None:
    m = machine(0, [0, 1, 2])
    m.handle(LocalRequest(decl(0)), 0.0)
    m.handle(DeclarationsSeen((decl(1),)), 1.0)
    m.handle(DeadlineReached(), 10.0)
    # peer 2 is alive but had not declared: read again (the others may have seen it)
    again = m.handle(DeclarationsReread((decl(3, at=9.0),)), 10.1)
    assert again == [ReadDeclarations(0, frozenset({b"peer-002"}))]
    # it declared late by our clock, in time by its own: rule 1, as the peers that saw it early
    (finish,) = m.handle(DeclarationsReread((decl(2, at=10.2),)), 10.3)
    assert finish.group.peer_ids == (b"peer-000", b"peer-001", b"peer-002")


def test_rereads_stop_at_the_confirm_deadline_with_rule_two() -> None:
    m = machine(0, [0, 1, 2])
    m.handle(LocalRequest(decl(0)), 0.0)
    m.handle(DeclarationsSeen((decl(1), decl(3, at=10.4))), 1.0)  # 3: unexpected and late
    m.handle(DeadlineReached(), 10.0)
    assert m.handle(DeclarationsReread(()), 10.5) == [ReadDeclarations(0, frozenset({b"peer-002"}))]
    (finish,) = m.handle(DeclarationsReread(()), 11.0)
    assert finish.group.peer_ids == (b"peer-000", b"peer-001")
    # the extra wait is one declaration window (0.5 s here), not the whole confirm timeout
    m = machine(0, [0, 1, 2])
    m.handle(LocalRequest(decl(0, at=9.5)), 9.5)
    m.handle(DeadlineReached(), 10.0)
    assert m.handle(DeclarationsReread((decl(1, at=9.6),)), 10.2) == [
        ReadDeclarations(0, frozenset({b"peer-002"}))
    ]
    (finish,) = m.handle(DeclarationsReread(()), 10.6)
    assert finish.group.peer_ids == (b"peer-000", b"peer-001")
    # a read that is still out at the confirm deadline: decide on the re-reads that came back
    m = machine(0, [0, 1, 2])
    m.handle(LocalRequest(decl(0)), 0.0)
    m.handle(DeadlineReached(), 10.0)
    m.handle(DeclarationsReread((decl(1, at=2.0),)), 10.2)
    (finish,) = m.handle(DeadlineReached(), 11.0)
    assert isinstance(finish, Finish) and finish.group.peer_ids == (b"peer-000", b"peer-001")


def test_lost_reread_fails_and_an_unexpected_peer_is_deferred() -> None:
    m = machine(0, [0, 1])
    m.handle(LocalRequest(decl(0)), 0.0)
    m.handle(DeadlineReached(), 10.0)
    assert m.handle(DeadlineReached(), 11.0) == [
        Fail("the re-read of the round key did not come back")
    ]
    newcomer = machine(5, [0, 1])
    newcomer.handle(LocalRequest(decl(5)), 0.0)
    (fail,) = newcomer.handle(DeclarationsSeen((decl(0), decl(1))), 1.0)
    assert isinstance(fail, Fail) and "declare for 1" in fail.reason


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ([LocalRequest(decl(0)), LocalRequest(decl(0))], LocalProtocolError),
        ([LocalRequest(decl(1))], LocalProtocolError),
        ([LocalRequest(decl(0, round_number=3))], LocalProtocolError),
        ([LocalRequest(decl(0)), DeclarationsSeen((decl(0, at=5.0),))], RemoteProtocolError),
        ([LocalRequest(decl(0)), DeclarationsReread(())], LocalProtocolError),
    ],
)
def test_illegal_events_raise_and_latch_failed(events, error) -> None:
    m = machine(0, [0, 1])
    with pytest.raises(error):
        for event in events:
            m.handle(event, 0.0)
    assert m.state is MatchState.FAILED
    with pytest.raises(LocalProtocolError):
        m.handle(DeclarationsSeen(()), 0.0)


def test_early_deadline_event_is_a_local_error() -> None:
    m = machine(0, [0, 1])
    with pytest.raises(LocalProtocolError):
        m.handle(DeadlineReached(), 1.0)
    assert m.state is MatchState.FAILED


DEADLINE = 10.0


class Swarm(RuleBasedStateMachine):
    """N matchmakers over a fake DHT: partial, duplicated, reordered reads; a clock; crashes."""

    @initialize(n=st.integers(2, 9), expected=st.integers(1, 9), size=st.integers(1, 4))
    def start(self, n, expected, size):
        self.now = 0.0
        self.dht: set[Declaration] = set()
        self.alive = set(range(n))
        self.rereads: dict[int, frozenset[bytes]] = {}
        self.finished: dict[int, Finish] = {}
        expected_ids = range(min(expected, n))
        self.machines = [machine(i, expected_ids, DEADLINE, size) for i in range(n)]

    def _handle(self, i, event):
        for action in self.machines[i].handle(event, self.now):
            if isinstance(action, Publish):
                self.dht.add(action.declaration)
            elif isinstance(action, ReadDeclarations):
                self.rereads[i] = action.ask
            elif isinstance(action, Finish):
                self.finished[i] = action

    @rule(data=st.data())
    def declare(self, data):
        i = data.draw(st.sampled_from(sorted(self.alive)))
        # honest peers declare for this round only before its deadline (target_round)
        if self.machines[i].state is MatchState.DECLARING and self.now < DEADLINE:
            self._handle(i, LocalRequest(decl(i, at=self.now)))

    @rule(data=st.data())
    def deliver_partial_view(self, data):
        i = data.draw(st.sampled_from(sorted(self.alive)))
        stored = sorted(self.dht, key=lambda d: d.peer_id)
        seen = data.draw(st.lists(st.sampled_from(stored), max_size=12)) if stored else []
        stale = data.draw(st.booleans())
        extra = (decl(99, round_number=1),) if stale else ()
        if self.machines[i].state is not MatchState.FAILED:
            self._handle(i, DeclarationsSeen((*seen, *extra)))

    @rule(data=st.data())
    def answer_reread(self, data):
        waiting = {
            i
            for i in self.rereads.keys() & self.alive
            if self.machines[i].state is MatchState.CONFIRMING
        }
        if waiting:
            i = data.draw(st.sampled_from(sorted(waiting)))
            asked = self.rereads.pop(i)
            full = sorted(self.dht, key=lambda d: d.peer_id, reverse=data.draw(st.booleans()))
            dead = frozenset(p for p in asked if int(p[-3:]) not in self.alive)
            self._handle(i, DeclarationsReread(tuple(full), dead))

    @rule(dt=st.floats(0.0, 4.0))
    def advance_clock(self, dt):
        self.now += dt
        for i in sorted(self.alive):
            m = self.machines[i]
            if m.state not in (MatchState.FORMED, MatchState.FAILED) and self.now >= m.deadline:
                self._handle(i, DeadlineReached())

    @precondition(lambda self: len(self.alive) > 1)
    @rule(data=st.data())
    def kill(self, data):
        self.alive.discard(data.draw(st.sampled_from(sorted(self.alive))))

    @invariant()
    def no_peer_in_two_groups(self):
        group_of: dict[bytes, bytes] = {}
        for finish in self.finished.values():
            for group in finish.groups:
                for peer in group.peer_ids:
                    assert group_of.setdefault(peer, group.group_id) == group.group_id

    @invariant()
    def finished_peers_agree(self):
        results = {finish.groups for finish in self.finished.values()}
        assert len(results) <= 1
        for i, finish in self.finished.items():
            assert self.machines[i].peer_id in finish.group.peer_ids
            assert len(finish.group.members) <= self.machines[i].config.max_group_size


TestSwarm = Swarm.TestCase
TestSwarm.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_one_group_takes_every_declarer_above_max_group_size_in_any_order() -> None:
    config = MatchmakingConfig(
        max_group_size=4, run_seed=SEED, confirm_timeout_s=1.0, one_group=True
    )
    groups = []
    for me, order in ((0, range(10)), (7, reversed(range(10)))):
        m = Matchmaker(b"peer-%03d" % me, 0, expected_peers=[], deadline=1.0, config=config)
        m.handle(LocalRequest(decl(me)), 0.0)
        m.handle(DeclarationsSeen(tuple(decl(i) for i in order)), 0.5)
        m.handle(DeadlineReached(), 1.0)
        (finish,) = m.handle(DeclarationsReread(()), 1.1)
        assert len(finish.groups) == 1
        groups.append(finish.group)
    assert groups[0] == groups[1] and len(groups[0].members) == 10
