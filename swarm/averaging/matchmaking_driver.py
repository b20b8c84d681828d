"""Trio driver of ``swarm.averaging.matchmaking.Matchmaker`` over the signed DHT.

A declaration is stored as the peer's own signed subkey under ``round_key(run, r)``; a record
whose declaration names another peer than its signer is ignored (nobody can declare for someone
else). The driver polls the key until the machine forms the group or its deadline passes, then
answers the machine's re-reads, asking the expected peers it names directly too (``Dht.store``
keeps our own records, so a live declarer always answers with its declaration). Reads ask every
replica (``latest=True``): a single replica may hold a partial set while a store is still
spreading.

A scheduled round (``MatchmakingConfig.schedule``, declarations sharded over
``MatchmakingConfig.shards`` keys) declares under its own shard's key, polls only the round's
clock shard, from one replica (the polls only time the round), every ``schedule.poll_s``
slowing to one a ``schedule.window_s``, and not at all once the machine saw the quorum; its
re-reads read every replica of every shard.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import trio

from p2p import Dht, P2PError, PeerID, RemoteProtocolError, SignedRecord, decode, encode
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
    round_keys,
    shard_of,
)

log = logging.getLogger(__name__)

DECLARATION_TTL_S = 600.0
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.25
REPUBLISH_S = 1.0


class MatchmakingFailed(Exception):
    """No group formed for this peer in this round; the message says why."""


def encode_declaration(declaration: Declaration) -> bytes:
    return encode(declaration)


def decode_declarations(records: dict[bytes, SignedRecord]) -> tuple[Declaration, ...]:
    """Declarations from a read of the round key; malformed or misattributed ones are skipped."""
    found = []
    for record in records.values():
        if len(record.value) > Declaration.MAX_BYTES:  # before any byte is parsed
            continue
        try:
            declaration = decode(record.value, Declaration)
        except RemoteProtocolError as exc:
            log.debug("skipped a malformed declaration: %r", exc)
            continue
        if declaration.peer_id == record.owner:
            found.append(declaration)
    return tuple(found)


async def read_declarations(
    dht: Dht, run_id: str, round_number: int, *, shards: int = 1
) -> tuple[Declaration, ...]:
    """Every declaration of a round, from every replica of each of its ``shards`` keys."""
    found: list[Declaration] = []

    async def read_one(key: str) -> None:
        found.extend(await _read_key(dht, key, latest=True))

    async with trio.open_nursery() as nursery:
        for key in round_keys(run_id, round_number, shards):
            nursery.start_soon(read_one, key.decode())
    return tuple(found)


async def _read_key(dht: Dht, key: str, *, latest: bool) -> tuple[Declaration, ...]:
    try:
        return decode_declarations(await dht.get_records(key, latest=latest))
    except P2PError as exc:
        log.debug("reading %s failed: %s", key, exc)
        return ()


Reach = Callable[[bytes], Awaitable[None]]


async def reread_declarations(
    dht: Dht,
    run_id: str,
    round_number: int,
    ask: Iterable[bytes],
    reach: Reach | None = None,
    *,
    shards: int = 1,
) -> DeclarationsReread:
    """A read of the round's keys merged with what each peer of ``ask`` holds under its own.

    ``reach(peer)`` connects to a peer first (``Node.reach``: its addresses from the DHT, relays,
    hole punching): a peer whose declaration our reads missed may be one we never talked to.
    """
    keys = round_keys(run_id, round_number, shards)
    found: list[Declaration] = []
    unreachable: set[bytes] = set()

    async def ask_one(peer: bytes) -> None:
        records = None
        key = keys[shard_of(peer, shards)].decode()
        # One request's time: a frozen peer must not hold back the key's read beside it.
        with trio.move_on_after(dht.config.request_timeout_s):
            try:
                if reach is not None:
                    await reach(peer)
                records = await dht.get_records_from(PeerID(peer), key)
            except P2PError as exc:
                log.debug("asking %s for its declaration failed: %s", peer.hex()[-8:], exc)
        if records is None:
            unreachable.add(peer)
        else:
            found.extend(decode_declarations(records))

    async with trio.open_nursery() as nursery:
        for peer in ask:
            nursery.start_soon(ask_one, peer)
        found.extend(await read_declarations(dht, run_id, round_number, shards=shards))
    return DeclarationsReread(tuple(found), frozenset(unreachable))


async def form_group(
    dht: Dht,
    run_id: str,
    declaration: Declaration,
    *,
    expected: Iterable[bytes],
    timeout_s: float,
    config: MatchmakingConfig,
    reach: Reach | None = None,
    exclude: frozenset[bytes] = frozenset(),
    admit: Callable[[bytes], bool] | None = None,
) -> Finish:
    """Declare for ``declaration.round`` and return the group this peer belongs to.

    Returns as soon as every expected peer declared, else decides on a re-read after
    ``timeout_s``. Declarations of ``exclude`` (peers the run refuses: banned, or whose
    contribution to this round failed verification) and of peers ``admit`` refuses (not members
    of a permissioned run) are ignored. Raises ``MatchmakingFailed``.
    """

    def admitted(found: tuple[Declaration, ...]) -> tuple[Declaration, ...]:
        return tuple(
            d for d in found if d.peer_id not in exclude and (admit is None or admit(d.peer_id))
        )

    machine = Matchmaker(
        declaration.peer_id,
        declaration.round,
        expected_peers=frozenset(expected) - exclude,
        deadline=declaration.declared_at + timeout_s,
        config=config,
    )
    keys = round_keys(run_id, declaration.round, config.shards)
    key = keys[machine.own_shard].decode()  # where we declare
    poll_key = keys[machine.clock_shard].decode()  # what we poll
    schedule = config.schedule
    queue = deque(machine.handle(LocalRequest(declaration), time.time()))
    poll = POLL_FIRST_S if schedule is None else schedule.poll_s
    published_at = -float("inf")
    rereads = 0
    while True:
        while queue:
            action = queue.popleft()
            if isinstance(action, Finish):
                _log_left_out(machine, action)
                return action
            if isinstance(action, Fail):
                raise MatchmakingFailed(action.reason)
            if isinstance(action, Publish):
                if not await _publish(dht, key, action.declaration):
                    raise MatchmakingFailed("no DHT peer stored our declaration")
                published_at = time.monotonic()
            elif isinstance(action, ReadDeclarations):
                # again: an expected peer answered but had not declared yet (rules 1-2 only)
                if rereads and schedule is None:
                    await trio.sleep(min(POLL_MAX_S, max(0.0, machine.deadline - time.time())))
                rereads += 1
                reread: DeclarationsReread | None = None
                with trio.move_on_after(max(0.0, machine.deadline - time.time())):
                    reread = await reread_declarations(
                        dht, run_id, action.round, action.ask, reach, shards=config.shards
                    )
                if reread is not None:
                    reread = DeclarationsReread(admitted(reread.declarations), reread.unreachable)
                    queue.extend(machine.handle(reread, time.time()))
        now = time.time()
        if now >= machine.deadline:
            missing = machine.expected_peers - machine.view.keys()
            if missing and machine.state is MatchState.WAITING:
                log.info(
                    "round %d: at the deadline %d of %d expected peers had not declared: %s",
                    declaration.round, len(missing), len(machine.expected_peers),
                    sorted(p.hex()[-8:] for p in missing),
                )  # fmt: skip
            queue.extend(machine.handle(DeadlineReached(), now))
            continue
        if schedule is not None and machine.quorum_seen:
            # The close is known: nothing to read until the re-read after it.
            await trio.sleep(max(0.0, machine.deadline - time.time()))
            continue
        if time.monotonic() - published_at > REPUBLISH_S:
            # The replicas that took our first store may have died since (peers leave, and
            # routing tables keep dead ones a while): store again at the closest live ones.
            await _publish(dht, key, declaration)
            published_at = time.monotonic()
        # A scheduled round's polls only time it: one replica of its clock shard will do.
        seen = admitted(await _read_key(dht, poll_key, latest=schedule is None))
        queue.extend(machine.handle(DeclarationsSeen(seen), time.time()))
        if not queue:
            await trio.sleep(min(poll, max(0.0, machine.deadline - time.time())))
            most = POLL_MAX_S if schedule is None else max(schedule.poll_s, schedule.window_s)
            poll = min(most, poll * 1.5)


def _log_left_out(machine: Matchmaker, finish: Finish) -> None:
    members = {peer for group in finish.groups for peer in group.peer_ids}
    left_out = machine.expected_peers - members
    if left_out:
        log.info(
            "round %d: formed without %d expected peer(s): %s",
            machine.round, len(left_out),
            ", ".join(
                f"{peer.hex()[-8:]} ("
                + ("did not answer" if peer in machine.unreachable else "had not declared")
                + ")"
                for peer in sorted(left_out)
            ),
        )  # fmt: skip


async def _publish(dht: Dht, key: str, declaration: Declaration) -> int:
    return await dht.store(key, encode_declaration(declaration), time.time() + DECLARATION_TTL_S)
