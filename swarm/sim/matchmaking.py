"""``form_group`` in virtual time: the real ``Matchmaker`` fed by the simulated DHT.

The same loop as ``swarm.averaging.matchmaking_driver.form_group`` (its constants too): publish
the declaration, then poll the round key (every ``POLL_FIRST_S`` growing 1.5 times to
``POLL_MAX_S``, republishing every ``REPUBLISH_S``) until the machine forms the group or its
deadline passes; answer each ``ReadDeclarations`` with a read of the key plus a direct ask of each
named peer (a present peer answers after one round trip with its declaration for that round, if
it made one; one that left or froze is unreachable after the DHT's request timeout), bounded by
the machine's deadline; hand the machine ``DeadlineReached`` when the deadline passes. Continuation
callbacks take the place of ``await``; a peer that leaves stops at its next step.

A scheduled round (``MatchmakingConfig.schedule``) declares under its own shard's key, polls the
round's clock shard from one replica every ``schedule.poll_s`` growing to ``schedule.window_s``,
stops polling once the machine saw the quorum, and answers a re-read with every replica of
every shard: as the real driver does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

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
    Publish,
    ReadDeclarations,
    round_keys,
)
from swarm.averaging.matchmaking_driver import POLL_FIRST_S, POLL_MAX_S, REPUBLISH_S
from swarm.sim.clock import Clock
from swarm.sim.dht import SimDht, record_bytes
from swarm.sim.network import Network

AskDone = Callable[[bytes, "Declaration | None", bool], None]


@dataclass(frozen=True)
class Directory:
    """What a direct ask needs to know of the other peers: whether ``peer`` answers now, and
    its declaration for a round (None: it made none)."""

    answers: Callable[[bytes], bool]
    declaration: Callable[[bytes, int], Declaration | None]


class SimMatchmaking:
    """One peer's matchmaking for one round; ``done(Finish | Fail)`` is called once, unless the
    peer leaves first (``alive()`` turns false)."""

    def __init__(
        self,
        clock: Clock,
        network: Network,
        dht: SimDht,
        directory: Directory,
        run_id: str,
        declaration: Declaration,
        *,
        expected: Iterable[bytes],
        timeout_s: float,
        config: MatchmakingConfig,
        alive: Callable[[], bool],
        done: Callable[[Finish | Fail], None],
        asked: Callable[[bytes], None],
    ) -> None:
        self.clock, self.network, self.dht, self.directory = clock, network, dht, directory
        self.me = declaration.peer_id
        self.declaration = declaration
        self.machine = Matchmaker(
            self.me,
            declaration.round,
            expected_peers=frozenset(expected),
            deadline=declaration.declared_at + timeout_s,
            config=config,
        )
        self.keys = round_keys(run_id, declaration.round, config.shards)
        self.key = self.keys[self.machine.own_shard]  # where we declare
        # A scheduled round's polls read only the shard that times it.
        self.poll_key = self.keys[self.machine.clock_shard]
        self.schedule = config.schedule
        if self.schedule is not None:
            self.poll = self.schedule.poll_s
        self._alive, self._done, self._asked = alive, done, asked
        self.queue: deque[object] = deque()
        self.poll = POLL_FIRST_S
        self.published_at = -float("inf")
        self.rereads = 0
        self._reread_token = 0

    def start(self) -> None:
        self.queue.extend(self.machine.handle(LocalRequest(self.declaration), self.clock.now))
        self._run_queue()

    def _run_queue(self) -> None:
        if not self._alive():
            return
        while self.queue:
            action = self.queue.popleft()
            if isinstance(action, Finish | Fail):
                self._done(action)
                return
            if isinstance(action, Publish):
                self.dht.write(self.me, self.key, action.declaration, self._published)
                return
            if isinstance(action, ReadDeclarations):
                delay = 0.0
                # again: an expected peer answered but had not declared yet (rules 1-2 only)
                if self.rereads and self.schedule is None:
                    delay = min(POLL_MAX_S, max(0.0, self.machine.deadline - self.clock.now))
                self.rereads += 1
                self.clock.after(delay, self._reread, action)
                return
        self._step()

    def _published(self) -> None:
        self.published_at = self.clock.now
        self._run_queue()

    def _step(self) -> None:
        """One pass of the driver's polling loop (after its queue ran empty)."""
        if not self._alive():
            return
        now = self.clock.now
        if now >= self.machine.deadline:
            self.queue.extend(self.machine.handle(DeadlineReached(), now))
            self._run_queue()
        elif self.schedule is not None and self.machine.quorum_seen:
            # The close is known: nothing to read until the re-read after it.
            self.clock.at(self.machine.deadline, self._step)
        elif now - self.published_at > REPUBLISH_S:
            self.published_at = now
            self.dht.write(self.me, self.key, self.declaration, self._poll)
        else:
            self._poll()

    def _poll(self) -> None:
        if self._alive():
            # A scheduled round's polls only time it (the decision re-reads every replica of
            # every shard): one replica is enough.
            latest = self.schedule is None
            self.dht.read(self.me, self.poll_key, self._seen, latest=latest)

    def _seen(self, declarations: tuple[Declaration, ...]) -> None:
        if not self._alive():
            return
        now = self.clock.now
        self.queue.extend(self.machine.handle(DeclarationsSeen(declarations), now))
        if self.queue:
            self._run_queue()
            return
        if self.schedule is not None:
            # Polls slow down to one a window while the quorum is not in: a peer then still
            # sees the quorum's declaration before the window after it closes.
            wait = min(self.poll, max(0.0, self.machine.deadline - now))
            self.poll = min(max(self.schedule.poll_s, self.schedule.window_s), self.poll * 1.5)
            self.clock.after(wait, self._step)
            return
        self.clock.after(min(self.poll, max(0.0, self.machine.deadline - now)), self._step)
        self.poll = min(POLL_MAX_S, self.poll * 1.5)

    # -- the re-read: the key and a direct ask of each missing expected peer, in parallel ------

    def _reread(self, action: ReadDeclarations) -> None:
        if not self._alive():
            return
        self._reread_token += 1
        token = self._reread_token
        pending = {"left": len(self.keys) + len(action.ask)}
        found: list[Declaration] = []
        unreachable: set[bytes] = set()

        def one_done() -> None:
            pending["left"] -= 1
            if pending["left"] == 0 and token == self._reread_token and self._alive():
                self._reread_token += 1  # the window's timeout below is void now
                reread = DeclarationsReread(tuple(found), frozenset(unreachable))
                self.queue.extend(self.machine.handle(reread, self.clock.now))
                self._run_queue()

        def read_done(declarations: tuple[Declaration, ...]) -> None:
            found.extend(declarations)
            one_done()

        def ask_done(peer: bytes, declaration: Declaration | None, reached: bool) -> None:
            if not reached:
                unreachable.add(peer)
            elif declaration is not None:
                found.append(declaration)
            one_done()

        for peer in sorted(action.ask):
            self._ask(peer, action.round, ask_done)
        for key in self.keys:
            self.dht.read(self.me, key, read_done)
        self.clock.at(max(self.clock.now, self.machine.deadline), self._reread_expired, token)

    def _reread_expired(self, token: int) -> None:
        if token == self._reread_token:  # the re-read did not come back within the window
            self._reread_token += 1
            self._run_queue()

    def _ask(self, peer: bytes, round_number: int, done: AskDone) -> None:
        self._asked(peer)
        timeout = self.dht.model.request_timeout_s
        if peer not in self.network.links or not self.directory.answers(peer):
            self.clock.after(timeout, done, peer, None, False)
            return
        rtt = self.network.latency(self.me, peer) + self.network.latency(peer, self.me)
        declaration = self.directory.declaration(peer, round_number)
        if declaration is not None:
            self.dht.count_read(self.me, self.key, record_bytes(self.key, declaration))
        self.clock.after(min(rtt, timeout), done, peer, declaration, rtt <= timeout)
