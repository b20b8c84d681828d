"""Elastic's decisions with a fake runtime (an in-memory DHT, fetches served from memory):
majority re-sync after a failed or drifted round, catching up at start, the expected set."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

import p2p
from diloco import ByteTransformer, ByteTransformerConfig, DiLoCo, GlobalState
from p2p import PeerID
from swarm import StateAgreement
from swarmtrain.keys import join_key, progress_key
from swarmtrain.membership.elastic import Elastic
from swarmtrain.membership.progress import Progress, announcement, member_list
from swarmtrain.membership.state_sync import StateServer
from swarmtrain.membership.state_sync_plan import Piece

RUN = "r"
SHAPE = ByteTransformerConfig(d_model=8, n_layers=1, n_heads=2, context=8)


def _peer() -> PeerID:
    return PeerID.from_pubkey(create_new_key_pair().public_key)


class FakeRuntime:
    """The slice of PeerRuntime that Elastic uses, over a dict standing in for the DHT."""

    def __init__(self, me: PeerID, dht: dict[str, dict[str, bytes]]) -> None:
        self.peer_id = me
        self.node = None
        self.dht = dht

    def read(self, key: str) -> dict[str, bytes]:
        return dict(self.dht.get(key, {}))

    async def read_async(self, key: str) -> dict[str, bytes]:
        return self.read(key)

    def store(self, key: str, value: bytes, ttl_s: float, *, version: int = 0) -> int:
        self.dht.setdefault(key, {})[str(self.peer_id)] = value
        return 1

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.run(fn, *args)

    def call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def poll(self, probe: Callable[[], Any], done: Callable[[Any], bool], **timing: Any) -> Any:
        return trio.run(functools.partial(p2p.poll, probe, done, **timing))


def _diloco() -> DiLoCo:
    model = ByteTransformer(SHAPE, seed=1)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return DiLoCo(model, inner, lambda *a: None, inner_steps=2, run_id=RUN)  # type: ignore[arg-type,return-value]


def _record(
    peer: PeerID,
    round_number: int,
    ok: bool,
    state_hash: bytes,
    at: float | None = None,
    members: list[PeerID] | None = None,
) -> bytes:
    """A record published ``at`` (wall clock; default now: a live peer's). ``members``: its
    list (a successful round's contributors; a failed one carries the list of the round whose
    state it holds); without it unlisted, of 3 peers (holders then count unchecked)."""
    at = time.time() if at is None else at
    listed = member_list(str(p) for p in members) if members else b""
    count = len(members) if members and ok else 3
    return Progress(str(peer), round_number, ok, state_hash, 3.0, 100.0, count, 0, 0, 1, at,
                    "public", listed).to_bytes()  # fmt: skip


def _world(round_number: int) -> tuple[bytes, bytes]:
    """The majority's state after ``round_number``: bytes and hash."""
    base = _diloco().global_state
    state = GlobalState(round_number + 1, base.params + 0.25, base.momentum + 1.0, base.layout)
    data = state.to_bytes()
    return data, data[-32:]


def _memory_fetcher(
    data: bytes, asked: list[Hashable]
) -> Callable[[Any, str, bytes], Callable[[Hashable, Piece], Any]]:
    def fetcher(node: Any, run_id: str, state_hash: bytes) -> Callable[[Hashable, Piece], Any]:
        async def fetch(source: Hashable, piece: Piece) -> bytes:
            asked.append(source)
            return data[piece.offset : piece.end]

        return fetch

    return fetcher


def _elastic(me: PeerID, dht: dict[str, dict[str, bytes]], data: bytes, asked: list) -> Elastic:
    lines: list[str] = []
    runtime = FakeRuntime(me, dht)
    elastic = Elastic(
        runtime,  # type: ignore[arg-type]
        StateServer(None, RUN),  # type: ignore[arg-type]
        RUN,
        _diloco(),
        lines.append,
        fetcher=_memory_fetcher(data, asked),
    )
    elastic.lines = lines  # type: ignore[attr-defined]
    return elastic


def test_a_peer_whose_round_failed_adopts_the_majority_state_and_announces_itself() -> None:
    me, b, c, d = _peer(), _peer(), _peer(), _peer()
    data, majority = _world(2)
    other = bytes(32)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 2, True, majority),
            str(c): _record(c, 2, True, majority),
            str(d): _record(d, 2, True, other),  # a drifted minority is not a source
            str(me): _record(me, 2, False, other),
        }
    }
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, data, asked)
    elastic.publish(Progress.from_bytes(str(me), dht[progress_key(RUN)][str(me)]))  # type: ignore[arg-type]
    report = elastic.after_round(2, ok=False)
    assert report is not None and report.round == 3 and report.sources == 2
    assert elastic.diloco.state_hash() == majority.hex() and elastic.diloco.round == 3
    assert asked and set(asked) <= {b, c}  # only holders of the majority state, never d
    assert dht[join_key(RUN, 3)] == {str(me): announcement(3)}  # announced for the next round
    assert elastic.fresh and elastic.server._states == {majority: data}  # and serves it
    # ... and says it now holds round 2's agreed state (it counts as a source from now on).
    mine = Progress.from_bytes(str(me), dht[progress_key(RUN)][str(me)])
    assert mine is not None and mine.ok and mine.state_hash == majority
    # Everyone derives the same expected set for round 3: holders of round 2 plus joiners.
    expected = elastic.expected_peers(3)
    assert expected == {p.to_bytes() for p in (me, b, c)}


def test_a_joiners_first_round_expects_the_holders_of_the_quorums_state_not_a_liar() -> None:
    # b holds round 3's state; c and we (d) still show round 2. A liar claims round 3 listing
    # all of us: the old ranking gave it our support, and every member expected the liar
    # instead of b in round 4 (a group without b, or a wait for a peer that never comes).
    me, b, c, liar, joiner = (_peer() for _ in range(5))
    bcd = [b, c, me]
    forged = bytes([9]) * 32
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 3, True, bytes(32), members=bcd),
            str(c): _record(c, 2, True, bytes(32), members=bcd),
            str(me): _record(me, 2, True, bytes(32), members=bcd),
            str(liar): _record(liar, 3, True, forged, members=[*bcd, liar]),
        },
        join_key(RUN, 4): {str(joiner): announcement(4)},
    }
    elastic = _elastic(me, dht, b"", [])
    assert elastic.expected_peers(4) == {p.to_bytes() for p in (b, joiner, me)}


def test_a_peer_in_agreement_downloads_nothing_and_keeps_the_averagers_rule() -> None:
    me, b = _peer(), _peer()
    asked: list[Hashable] = []
    elastic = _elastic(me, {}, b"", asked)
    ours = bytes.fromhex(elastic.diloco.state_hash())
    elastic.runtime.dht[progress_key(RUN)] = {  # type: ignore[attr-defined]
        str(b): _record(b, 0, True, ours),
        str(me): _record(me, 0, True, ours),
    }
    # Our GlobalState.round is 0 here, so the majority's "round 0" state must equal ours by hash.
    assert elastic.after_round(0, ok=True) is None and not asked
    assert elastic.expected_peers(1) is None  # no joiner announced, not fresh


def test_a_node_behind_a_failing_swarm_syncs_at_once_instead_of_waiting() -> None:
    me, b, c = _peer(), _peer(), _peer()
    data, majority = _world(4)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 4, True, majority, members=[b, c]),
            # the swarm's newest round failed; c still holds round 4's state (its list)
            str(c): _record(c, 6, False, bytes(32), members=[b, c]),
        }
    }
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, data, asked)
    report = elastic.catch_up(wait_s=600.0, rounds=100)  # would block 600 s if it waited
    assert report is not None and report.round == 5 and asked == [b]
    assert "syncing now" in elastic.lines[0]  # type: ignore[attr-defined]


def test_a_new_run_needs_no_sync() -> None:
    elastic = _elastic(_peer(), {}, b"", [])
    assert elastic.catch_up(wait_s=600.0, rounds=5) is None


def test_a_failed_peer_waits_for_the_others_still_in_the_round() -> None:
    # Our round failed early (the others looked lost to us) while they were still averaging:
    # their records for the round come later, and we adopt what they agreed.
    me, b, c = _peer(), _peer(), _peer()
    data, majority = _world(2)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 1, True, bytes(32)),
            str(c): _record(c, 1, True, bytes(32)),
        }
    }
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, data, asked)

    def finish_round() -> None:
        dht[progress_key(RUN)][str(b)] = _record(b, 2, True, majority)
        dht[progress_key(RUN)][str(c)] = _record(c, 2, True, majority)

    timer = threading.Timer(2.0, finish_round)  # past the 1 s that the old rule waited
    timer.start()
    try:
        report = elastic.after_round(2, ok=False, wait_s=30.0)
    finally:
        timer.cancel()
    assert report is not None and report.round == 3
    assert elastic.diloco.state_hash() == majority.hex() and set(asked) <= {b, c}


def test_a_failed_peer_whose_swarm_moved_on_adopts_the_newest_agreed_state() -> None:
    # The others finished our failed round and the next one before we looked (their records
    # hold only their newest round): we take the newest agreed state and join after it.
    me, b, c = _peer(), _peer(), _peer()
    data, majority = _world(3)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 3, True, majority),
            str(c): _record(c, 3, True, majority),
        }
    }
    elastic = _elastic(me, dht, data, [])
    started = time.monotonic()
    report = elastic.after_round(2, ok=False, wait_s=30.0)
    assert time.monotonic() - started < 5
    assert report is not None and report.round == 4  # round 3's agreed state
    assert dht[join_key(RUN, 4)] == {str(me): announcement(4)}  # expected by the next round's group


def test_a_failed_peer_does_not_wait_when_everyone_failed_or_left() -> None:
    me, b, c, gone = _peer(), _peer(), _peer(), _peer()
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 2, False, bytes(32)),
            str(c): _record(c, 2, False, bytes(32)),
            # left long ago (its newest record is stale): not waited for
            str(gone): _record(gone, 0, True, bytes(32), at=time.time() - 600),
        }
    }
    elastic = _elastic(me, dht, b"", [])
    started = time.monotonic()
    assert elastic.after_round(2, ok=False, wait_s=30.0) is None
    assert time.monotonic() - started < 5


def test_a_banned_peer_is_neither_waited_for_nor_expected_nor_a_holder() -> None:
    """A verified run's banned peer that left still had a fresh record of a round behind ours:
    both honest peers of a CI run waited a round's budget (94 s) for it, then trained apart.
    Its records, start and join announcement count for nothing once it is ``ignored``."""
    me, b, cheater = _peer(), _peer(), _peer()
    data, _ = _world(1)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 2, False, bytes(32)),
            str(cheater): _record(cheater, 1, False, bytes(32)),
        },
        join_key(RUN, 3): {str(cheater): announcement(3)},
    }
    elastic = _elastic(me, dht, data, [])
    assert elastic.joiners(3) == frozenset({cheater.to_bytes()})
    elastic.ignored = lambda: {str(cheater)}
    started = time.monotonic()
    assert elastic.after_round(2, ok=False, wait_s=30.0) is None  # nobody live behind us
    assert time.monotonic() - started < 5
    assert elastic.joiners(3) == frozenset()
    assert [p.peer_id for p in elastic.records()] == [str(b)]  # nor a holder of any state


def _dead_holder_fetcher(
    dead: PeerID | set[PeerID], data: bytes, asked: list[Hashable]
) -> Callable[[Any, str, bytes], Callable[[Hashable, Piece], Any]]:
    """Serves ``data`` from every source but the ``dead``, whose relays no longer hold it."""
    gone = dead if isinstance(dead, set) else {dead}

    def fetcher(node: Any, run_id: str, state_hash: bytes) -> Callable[[Hashable, Piece], Any]:
        async def fetch(source: Hashable, piece: Piece) -> bytes:
            asked.append(source)
            if source in gone:
                raise ConnectionError("Relay connection failed with status 204")
            return data[piece.offset : piece.end]

        return fetch

    return fetcher


def test_a_holder_that_died_before_the_download_does_not_send_a_joiner_back_to_round_0() -> None:
    # The progress read names b and e as the holders of round 3's state (as many as round 2's,
    # and newer: the first choice); both died before the download. c and d, alive, hold round
    # 2's: the joiner takes that one, not a fresh start.
    me, b, c, d, e = _peer(), _peer(), _peer(), _peer(), _peer()
    _newest, newest_hash = _world(3)
    older, older_hash = _world(2)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 3, True, newest_hash),
            str(e): _record(e, 3, True, newest_hash),
            str(c): _record(c, 2, True, older_hash),
            str(d): _record(d, 2, True, older_hash),
        }
    }
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, b"", [])
    elastic._fetcher = _dead_holder_fetcher({b, e}, older, asked)
    report = elastic.catch_up(wait_s=0.0, rounds=10)
    assert report is not None and report.round == 3, elastic.lines  # type: ignore[attr-defined]
    assert elastic.diloco.round == 3 and elastic.diloco.state_hash() == older_hash.hex()
    assert {b, e} <= set(asked) and set(asked) - {b, e} <= {c, d}
    assert any("did not answer" in line for line in elastic.lines)  # type: ignore[attr-defined]


def test_with_the_only_holder_dead_a_joiner_takes_the_survivors_state_after_its_failed_round() -> (
    None
):
    # Issue 16's NAT-lab run: a and b averaged round 1; b was killed; a's round 2 failed alone,
    # so only b's record names round 1's agreed state. The joiner takes a's state, not round 0.
    me, a, b = _peer(), _peer(), _peer()
    _agreed, agreed_hash = _world(1)
    survivors, survivors_hash = _world(2)
    dht = {
        progress_key(RUN): {
            str(b): _record(b, 1, True, agreed_hash, members=[a, b]),
            # a's failed round carries round 1's list: it vouches for b's state, 2 of 2
            str(a): _record(a, 2, False, survivors_hash, members=[a, b]),
        }
    }
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, b"", [])
    elastic._fetcher = _dead_holder_fetcher(b, survivors, asked)
    report = elastic.catch_up(wait_s=0.0, rounds=10)
    assert report is not None and report.round == 3, elastic.lines  # type: ignore[attr-defined]
    assert elastic.diloco.state_hash() == survivors_hash.hex() and set(asked) == {a, b}
    assert any("live peer" in line for line in elastic.lines)  # type: ignore[attr-defined]


def test_the_last_rounds_holders_linger_for_a_joiner_until_it_holds_the_final_state() -> None:
    # A late joiner waited for the last boundary; the holders must not exit before it downloads.
    me, joiner = _peer(), _peer()
    data, final = _world(4)
    dht = {progress_key(RUN): {str(me): _record(me, 4, True, final, members=[me])}}
    asked: list[Hashable] = []
    holder = _elastic(me, dht, b"", [])
    holder.diloco.load_state(data)
    late = _elastic(joiner, dht, data, asked)
    late.rounds = 5
    dht[join_key(RUN, 5)] = {str(joiner): announcement(5)}  # it announced itself after round 4

    left = threading.Event()
    thread = threading.Thread(target=lambda: (holder.linger(4, 30.0), left.set()))
    started = time.monotonic()
    thread.start()
    time.sleep(0.5)
    assert not left.is_set()  # still serving: the joiner has no record yet
    report = late.catch_up(wait_s=0.0, rounds=5)
    assert report is not None and late.diloco.state_hash() == final.hex() and asked
    thread.join(10)
    assert left.is_set() and time.monotonic() - started < 10  # it left once the joiner held it
    mine = Progress.from_bytes(str(joiner), dht[progress_key(RUN)][str(joiner)])
    assert mine is not None and mine.ok and mine.round == 4 and mine.rounds_contributed == 0


def test_a_peer_whose_sub_group_was_the_smaller_rejoins_the_majoritys_state() -> None:
    """bench.churn's split: a round ran as two sub-groups ({me, x} and {a, b, c}) with two
    results; each heard only its own digests. ``rejoin_majority`` takes the state most members
    support, and does nothing for a peer of the larger sub-group."""
    me, x, a, b, c = (_peer() for _ in range(5))
    data, majority = _world(6)
    _, ours = _world(7)  # any other state
    small, large = [me, x], [a, b, c]

    def record(peer: PeerID, group: list[PeerID], state_hash: bytes) -> bytes:
        members = member_list(str(p) for p in group)
        return Progress(str(peer), 6, True, state_hash, 3.0, 100.0, len(group), 0, 0, 1,
                        time.time(), "public", members).to_bytes()  # fmt: skip

    dht = {
        progress_key(RUN): {
            **{str(p): record(p, small, ours) for p in small},
            **{str(p): record(p, large, majority) for p in large},
        }
    }
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, data, asked)
    elastic.publish(Progress.from_bytes(str(me), dht[progress_key(RUN)][str(me)]))  # type: ignore[arg-type]
    assert elastic.held_list(7) == member_list(str(p) for p in small)
    report = elastic.rejoin_majority()
    assert report is not None and elastic.diloco.state_hash() == majority.hex()
    assert set(asked) <= {a, b, c}
    # A failed round 7 carries no list now: we hold the larger sub-group's state, whose list
    # does not name us, not the state our own sub-group's list stands for.
    assert elastic.held_list(7) == b""
    # A peer of the larger sub-group already holds it.
    member = _elastic(a, dht, data, [])
    member.diloco.load_state(data)
    assert member.rejoin_majority() is None


def test_a_joiner_never_adopts_a_forged_or_minority_state_even_when_the_holders_are_silent() -> (
    None
):
    """Issue 19 point 1: b, c and d hold round 3's state; a liar claims round 8 with a state
    of its own (naming them on its list) and serves it; x, on nobody's list, holds a third
    state of round 3. The holders do not answer: the joiner trains on its own state rather
    than download the liar's or the outsider's (with state_quorum = 0 it took the liar's)."""
    me, b, c, d, liar, x = (_peer() for _ in range(6))
    _, honest_hash = _world(3)
    forged, forged_hash = _world(8)
    members = [b, c, d]
    dht = {
        progress_key(RUN): {
            **{str(p): _record(p, 3, True, honest_hash, members=members) for p in members},
            str(liar): _record(liar, 8, True, forged_hash, members=[*members, liar]),
            str(x): _record(x, 3, True, bytes(32), members=[x]),
        }
    }
    asked: list[Hashable] = []
    joiner = _elastic(me, dht, b"", [])
    joiner._fetcher = _dead_holder_fetcher({b, c, d}, forged, asked)
    assert joiner.catch_up(wait_s=0.0, rounds=10) is None
    assert joiner.diloco.round == 0 and set(asked) == {b, c, d}
    # The old rule: the liar's state is the next choice once the holders fail.
    old = _elastic(me, dht, b"", [])
    old.quorum = 0
    old._fetcher = _dead_holder_fetcher({b, c, d}, forged, [])
    report = old.catch_up(wait_s=0.0, rounds=10)
    assert report is not None and old.diloco.state_hash() == forged_hash.hex()


def _states(round_number: int, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` different states after ``round_number`` (bytes and hash), by hash."""
    base = _diloco().global_state
    found = []
    for k in range(count):
        state = GlobalState(round_number + 1, base.params + k / 8, base.momentum, base.layout)
        data = state.to_bytes()
        found.append((data, data[-32:]))
    return sorted(found, key=lambda s: s[1])


def _per_source_fetcher(
    served: dict[PeerID, bytes], asked: list[Hashable]
) -> Callable[[Any, str, bytes], Callable[[Hashable, Piece], Any]]:
    """Each source serves its own state's bytes."""

    def fetcher(node: Any, run_id: str, state_hash: bytes) -> Callable[[Hashable, Piece], Any]:
        async def fetch(source: Hashable, piece: Piece) -> bytes:
            asked.append(source)
            return served[source][piece.offset : piece.end]  # type: ignore[index]

        return fetch

    return fetcher


def test_two_members_that_diverged_converge_on_their_contributors_hash_never_a_liars() -> None:
    """Two live peers met in round 5 with different states: the records show one holder each
    (no majority's). A liar publishes, under the round's run-wide digest key, the digest of a
    state of its own, larger than both, and a progress record of round 5 holding it (and
    serves it): it won the tie-break, and both members downloaded its state. Only the round's
    contributors' digests decide the drift and the majority, and only their records the
    state's holders: the one off their tie-break adopts the other's, from it alone."""
    me, b, liar = _peer(), _peer(), _peer()
    (ours, ours_hash), (theirs, their_hash), *_, (forged, forged_hash) = _states(5, 4)
    pair = [me, b]
    dht = {
        progress_key(RUN): {
            str(me): _record(me, 5, True, ours_hash, members=pair),
            str(b): _record(b, 5, True, their_hash, members=pair),
            str(liar): _record(liar, 5, True, forged_hash, members=[*pair, liar]),
        }
    }
    digests = {me.to_bytes(): ours_hash.hex(), b.to_bytes(): their_hash.hex(),
               liar.to_bytes(): forged_hash.hex()}  # fmt: skip
    everyone = StateAgreement.of(5, digests, me.to_bytes())
    assert everyone.majority == forged_hash.hex()  # the run-wide key: the liar's tie-break
    group = everyone.among(p.to_bytes() for p in pair)
    assert (group.ours, group.majority, group.peers) == (ours_hash.hex(), their_hash.hex(), 2)
    assert not group.agrees and everyone.among([b.to_bytes()]).ours is None
    asked: list[Hashable] = []
    elastic = _elastic(me, dht, b"", asked)
    elastic._fetcher = _per_source_fetcher({b: theirs, liar: forged}, asked)
    elastic.diloco.load_state(ours)
    elastic.publish(Progress.from_bytes(str(me), dht[progress_key(RUN)][str(me)]))  # type: ignore[arg-type]
    assert elastic.rejoin_majority() is None and not asked  # no majority's state in the records
    contributors = [str(p) for p in pair]
    # The liar's hash, even named as the majority, is no contributor's state.
    assert elastic.after_round(5, True, majority=forged_hash.hex(), contributors=contributors) is (
        None
    )
    assert not asked and elastic.diloco.state_hash() == ours_hash.hex()
    report = elastic.after_round(5, ok=True, majority=group.majority, contributors=contributors)
    assert report is not None and elastic.diloco.state_hash() == their_hash.hex()
    assert set(asked) == {b}
    # We say we hold it now, on our round's list: a failed next round carries that list.
    mine = Progress.from_bytes(str(me), dht[progress_key(RUN)][str(me)])
    assert mine is not None and mine.state_hash == their_hash
    assert elastic.held_list(6) == member_list(contributors)


def test_a_failed_round_carries_the_list_of_the_round_whose_state_it_holds() -> None:
    me, b = _peer(), _peer()
    elastic = _elastic(me, {}, b"", [])
    assert elastic.held_list(3) == b""  # nothing published yet (a joiner's first round)
    listed = member_list([str(me), str(b)])
    ok = Progress(str(me), 2, True, bytes(32), 3.0, 1.0, 2, 0, 0, 1, time.time(), "public", listed)
    elastic.publish(ok)
    assert elastic.held_list(3) == listed and elastic.held_list(4) == b""
    elastic.publish(dataclasses.replace(ok, round=3, ok=False, peers=0, members=listed))
    assert elastic.held_list(4) == listed  # carried on while every round fails
