"""Elastic membership for a volunteer: join a running swarm, serve our state, re-sync on drift.

What a node does around its DiLoCo rounds (``swarmtrain.training.loop`` calls these in its main
thread):

* **Serve**: after every successful round, before telling anyone, hand the new state's bytes to
  the ``StateServer`` (so a joiner that reads our progress record can already fetch it), then
  publish our ``Progress`` record.
* **Catch up at start**: read the run's progress records. If the swarm's agreed state is ahead
  of ours (a fresh joiner at round 0, or a restart from an old checkpoint), wait for the next
  round boundary -- a new agreed round appearing -- so that we start an inner phase together with
  everyone else, then download that state from its holders (several sources, byte ranges split
  between them, resumed elsewhere if one dies), verify it against the majority hash, adopt it,
  and contribute from the next round, announced under ``join_key`` (while waiting and before
  the download, so that round expects us however soon it opens).
* **Re-sync after a round**: when our round failed while the majority's succeeded, or our hash
  differs from the majority of our round's contributors' digests (nobody else's count: the
  digest key is run-wide), download the agreed state the same way and announce again (after a
  drifted round: only the contributors' hash, from contributors that hold it).
* **Meet again** (``swarmtrain.membership.plan``): a round that cannot meet anyone because the
  others already averaged it is failed before matchmaking and their state adopted at once
  (``behind``); after a failed round, a peer ahead of live members waits for them (bounded by
  a round's time per round of gap) instead of running on alone, and records claiming rounds past
  the run's schedule are ignored. A state is taken from live holders: a download that fails at
  every holder of the newest state tries the next newest state held by others.
* **Announce the start**: once caught up, a node stores when it started and the round it trains
  first (``announce_start``), so that a peer whose round fails before any record of ours exists
  waits for us instead of running ahead alone (``plan.positions``).
* **Expected peers**: when a round has announced joiners (or we just joined), every member passes
  the same expected set to matchmaking: the holders of the previous round's agreed state (the
  quorum's, ``plan.best_state``, as a joiner adopts it) plus the announced joiners. Everyone
  derives it from the same DHT records, so everyone forms the same group and the joiner
  contributes in its first round; without joiners the averager's own rule (the previous
  round's survivors) applies unchanged.

A joiner never trains on bytes that do not match the published majority hash
(``download_state`` verifies; ``DiLoCo.load_state`` verifies again). Whatever a peer sends, the
others apply one average to one state, so their states stay identical; a peer that could not get
the agreed state (no holder answered) trains on its own and is re-synced after its first round,
when its hash disagrees.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from diloco import DiLoCo
from p2p import PeerID
from swarmtrain.keys import join_key, progress_key, starts_key
from swarmtrain.membership.plan import (
    Quorum,
    Rejoin,
    Verdict,
    after_failed_round,
    best_state,
    candidates,
    in_schedule,
    past_round,
    states_best_first,
    swarm_ahead,
    wait_budget_s,
)
from swarmtrain.membership.progress import (
    MAJORITY,
    PROGRESS_TTL_S,
    AgreedState,
    Progress,
    Start,
    agreed_states,
    announced_joiners,
    announcement,
    decode_all,
    decode_starts,
    on_list,
)
from swarmtrain.membership.state_sync import (
    Downloaded,
    Fetch,
    StateServer,
    StateSyncFailed,
    StoredState,
    download_state,
    node_fetcher,
)
from swarmtrain.runtime import PeerRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.2
SETTLE_S = 1.0  # a round's peers publish within milliseconds; this covers a loaded machine
SYNC_TIMEOUT_S = 120.0
SYNC_ATTEMPTS = 3
# After the last round, a peer behind us whose newest record is older than this counts as gone
# (not lingered for); after a failed round the bound is the round's own wait (``_outcome``).
LIVE_S = 60.0


class RunOver(Exception):
    """We joined a run whose last round is averaged and could not fetch its final state."""


@dataclass(frozen=True)
class SyncReport:
    round: int  # the state's round (the next round this node contributes to)
    state_hash: str
    sources: int
    bytes: int
    seconds: float
    pieces: list[int]  # ranges each source delivered, largest first


class Elastic:
    def __init__(
        self,
        runtime: PeerRuntime,
        server: StateServer,
        run_id: str,
        diloco: DiLoCo,
        emit: Callable[[str], None],
        fetcher: Callable[[Any, str, bytes], Fetch] = node_fetcher,
        rounds: int = 2**31,  # the run's schedule: records of later rounds are ignored
        quorum: Quorum = MAJORITY,  # [swarm] state_quorum: which states may be adopted
    ) -> None:
        self.runtime = runtime
        self._fetcher = fetcher  # how to fetch ranges from a source (injected by tests)
        self.server = server
        self.run_id = run_id
        self.rounds = rounds
        self.quorum = quorum
        self.diloco = diloco
        self.emit = emit
        self.me = str(runtime.peer_id)
        self.fresh = False  # adopted a downloaded state and has not averaged since
        self.syncs = 0
        # A round whose group formed larger than the peers that averaged in it: it may have run
        # as sub-groups (members that read other expected sets formed other groups), so the
        # training loop looks at its state digests again after the next round (``rejoin_majority``).
        self.suspect_round: int | None = None
        self._last_progress: Progress | None = None
        # The round whose state we hold and its member list, as a failed record carries it on.
        self._held: tuple[int, bytes] | None = None
        self._adopted: AgreedState | None = None  # the state the last download adopted
        self._state_bytes = diloco.state_size()
        # Peers whose records count for nothing (a verified run's banned ones: the training loop
        # sets it): a banned peer that leaves looked like a live member behind us, and both
        # honest peers of a run waited a round's budget for it and then trained apart.
        self.ignored: Callable[[], Collection[str]] = frozenset

    # -- records -------------------------------------------------------------------------------

    def records(self) -> list[Progress]:
        return self.runtime.call(self._records)

    async def _records(self) -> list[Progress]:
        """``records`` in the node's loop, for the probes ``_poll`` awaits there; those of
        ``ignored`` peers left out."""
        try:
            found = decode_all(await self.runtime.read_async(progress_key(self.run_id)))
        except Exception as exc:
            log.warning("could not read the run's progress records: %s", exc)
            return []
        ignored = self.ignored()
        return [p for p in found if p.peer_id not in ignored] if ignored else found

    def _poll(
        self,
        probe: Callable[[list[Progress]], T | None],
        timeout_s: float,
        *,
        wait_first: bool = False,
    ) -> T | None:
        """Read the progress records every ``POLL_S`` until ``probe(records)`` returns a value
        (returned) or ``timeout_s`` passed (None): a trio wait in the node's loop
        (``p2p.poll``), not sleeps on this thread. ``wait_first``: the first read after one
        interval (when the records were just read)."""
        found: list[T] = []

        async def read() -> bool:
            value = probe(await self._records())
            if value is not None:
                found.append(value)
            return value is not None

        self.runtime.poll(read, bool, interval_s=POLL_S, timeout_s=timeout_s, wait_first=wait_first)
        return found[0] if found else None

    def held_list(self, round_number: int) -> bytes:
        """The member list a failed round ``round_number``'s record carries: that of the round
        whose state we still hold (our record of the round before, successful or carrying it
        on), so that a joiner counts us as a member of that round (``progress._vouchers``).
        After an adoption, the adopted state's list when we are on it, else none (``_adopt``):
        never the list of a state we no longer hold."""
        held = self._held
        return held[1] if held is not None and held[0] == round_number - 1 else b""

    def publish(self, progress: Progress) -> None:
        self._last_progress = progress
        self._held = (progress.round, progress.members)
        try:
            self.runtime.store(
                progress_key(self.run_id),
                progress.to_bytes(),
                PROGRESS_TTL_S,
                version=progress.round + 1,
            )
        except Exception as exc:
            log.warning("round %d: could not publish progress: %s", progress.round, exc)

    def announce_start(self) -> None:
        """Say that we started and train ``diloco.round`` first (after ``catch_up``: a joiner's
        first round is the swarm's next one, not its fresh round 0)."""
        start = Start(self.me, self.diloco.round, time.time())
        try:
            self.runtime.store(starts_key(self.run_id), start.to_bytes(), PROGRESS_TTL_S)
        except Exception as exc:
            log.warning("could not announce our start: %s", exc)

    def wait_for_start(self, min_peers: int, timeout_s: float) -> int:
        """Before a fresh run's round 0: wait until ``min_peers`` peers (us included) announced
        they start at round 0, or a progress record shows the run under way, at most
        ``timeout_s``. Returns how many had announced. Each node leaves within a poll of the
        last announcement, so their round-0 declarations fall in one matchmaking window."""
        started = {self.me}

        async def count() -> int:
            try:
                values = await self.runtime.read_async(starts_key(self.run_id))
                started.update(s.peer_id for s in decode_starts(values) if s.first_round == 0)
                under_way = bool(
                    decode_all(await self.runtime.read_async(progress_key(self.run_id)))
                )
            except Exception as exc:
                log.warning("could not read the run's start announcements: %s", exc)
                under_way = False
            return min_peers if under_way else len(started)

        self.runtime.poll(count, lambda n: n >= min_peers, interval_s=POLL_S, timeout_s=timeout_s)
        return len(started)

    def starts(self) -> list[Start]:
        try:
            found = decode_starts(self.runtime.read(starts_key(self.run_id)))
        except Exception as exc:
            log.warning("could not read the run's start announcements: %s", exc)
            return []
        ignored = self.ignored()
        return [s for s in found if s.peer_id not in ignored]

    def serve_current(self) -> None:
        """Offer the current state to joiners (call after every round, failed or not): from its
        checkpoint file when there is one (a range is read when a joiner asks for it), else
        from a copy in memory."""
        state_hash = bytes.fromhex(self.diloco.state_hash())
        saved = self.diloco.state_file()
        data: bytes | StoredState | None = None
        if saved is not None:
            try:
                data = StoredState(saved.path, saved.offset, saved.length, state_hash)
            except (OSError, ValueError) as exc:
                log.warning("serving the state from memory: %s", exc)
        if data is None:
            data = self.diloco.state_bytes()
        self.runtime.call_sync(self.server.offer, state_hash, data)

    # -- matchmaking ---------------------------------------------------------------------------

    def _announced(self, round_number: int) -> set[str]:
        try:
            found = announced_joiners(
                self.runtime.read(join_key(self.run_id, round_number)), round_number
            )
        except Exception as exc:
            log.warning("round %d: could not read announced joiners: %s", round_number, exc)
            return set()
        return found - set(self.ignored())

    def joiners(self, round_number: int) -> frozenset[bytes]:
        """The peers that announced they join at ``round_number`` (a verified run waits for
        their first task's claims)."""
        return frozenset(PeerID.from_base58(p).to_bytes() for p in self._announced(round_number))

    def expected_peers(self, round_number: int) -> set[bytes] | None:
        """The expected set for ``round_number``'s matchmaking, or None for the averager's own
        rule (no joiner announced and we did not just join)."""
        joiners = self._announced(round_number)
        if not joiners and not self.fresh:
            return None
        # The quorum's state, as a joiner adopts it: a forged record of round r - 1 (or one
        # claiming its state with other members) never makes its owner expected by everyone.
        agreed = best_state(self.records(), self.rounds, self.quorum, round_number - 1)
        if agreed is None:
            # No agreed previous round (round 0, or it failed everywhere): each member would
            # expect only itself and the joiners, a different set on each, and rule 1 would
            # form different groups. The averager's own rule (the deadline) is the same for all.
            return None
        members = set(agreed.holders) | joiners | {self.me}
        if len(members) < 2:
            return None  # nobody to expect: the averager's own rule (wait for the deadline)
        log.info("round %d: %d joiner(s) announced; expecting %d peers", round_number,
                 len(joiners), len(members))  # fmt: skip
        return {PeerID.from_base58(p).to_bytes() for p in members}

    def behind(self, round_number: int) -> str | None:
        """Why our round ``round_number`` cannot meet anyone (others already averaged it), or
        None; ``SwarmAverage`` fails the round before matchmaking then, and ``after_round``
        adopts their state."""
        ahead = swarm_ahead(self.records(), self.me, round_number, self.rounds, self.quorum)
        if ahead is None:
            return None
        return f"the swarm already averaged round {ahead.round}; catching up"

    def past_peers(self, round_number: int) -> set[bytes]:
        """Peers already done with ``round_number`` (their records say so): matchmaking leaves
        out their stale declarations for it."""
        done = past_round(self.records(), self.me, round_number, self.rounds)
        found: set[bytes] = set()
        for peer in done:
            try:
                found.add(PeerID.from_base58(peer).to_bytes())
            except Exception:
                continue  # a malformed key in the DHT: nobody to leave out
        return found

    # -- syncing -------------------------------------------------------------------------------

    def catch_up(self, wait_s: float, rounds: int) -> SyncReport | None:
        """At start: if the swarm's agreed state is ahead of (or differs from) ours, wait up to
        ``wait_s`` for the next round boundary (not when the run's last round, ``rounds``, is
        already agreed), then adopt that round's agreed state. Returns what was synced, or None
        when we already hold the agreed state, the run is new, or no holder could send it (then
        we train on our own state and re-sync after a round). Raises ``RunOver`` when the run's
        last round is averaged and no holder sent its final state: nothing is left to train."""
        records = self.records()
        # An agreed state to start from; the states of peers whose rounds failed are only a
        # fallback of ``_adopt_from_live`` (a peer alone waits for us instead: ``_outcome``).
        choices = [
            s for s in states_best_first(records, self.rounds, quorum=self.quorum) if s.published
        ]
        agreed = choices[0] if choices else None
        if agreed is None or not self._behind(agreed):
            return None
        # Wait for a boundary only while the swarm makes progress: if the newest record is a
        # failed round past the agreed one, no new agreed round may ever come.
        progressing = _progressing(records, agreed)
        over = agreed.round + 1 >= rounds
        if over:
            progressing = False  # the run is over: take the final state, nothing to wait for
        self.emit(
            f"the swarm's agreed state is round {agreed.round + 1}'s, ours is round "
            f"{self.diloco.round}'s: "
            + ("waiting for the next round boundary to join" if progressing else "syncing now")
        )
        if progressing:
            # We will adopt the state after the round in progress, agreed.round + 1, and
            # contribute to the one after it: say so now, well before that round opens.
            self._announce(agreed.round + 2)
        elif over:
            # The holders of the final state linger while an announced joiner lacks it.
            self._announce(agreed.round + 1)
        previous = agreed

        def boundary(records: list[Progress]) -> AgreedState | None:
            newer = best_state(records, self.rounds, self.quorum)
            if newer is not None and newer.round > previous.round:
                return newer
            # The swarm stopped while we waited (a survivor alone failed the round past the
            # agreed one, and waits for us, its announced joiner): no boundary will come, so
            # take the agreed state now instead of waiting out ``wait_s`` (a deadlock until then).
            return None if _progressing(records, previous) else previous

        newer = self._poll(boundary, wait_s if progressing else 0.0, wait_first=True)
        if newer is not None:
            agreed = self._settled(newer.round) or newer
        report = self._adopt_from_live(agreed)
        if report is not None:
            if self.diloco.round >= rounds:
                self._hold_final(records)
            return report
        if over:
            raise RunOver(
                f"run {self.run_id} is over (its last round, {agreed.round}, was averaged) and "
                f"none of the {len(agreed.holders)} holder(s) of its final state answered: "
                "nothing is left to train"
            )
        # Training on our own state is safe for the others (they apply the same average to the
        # same state whatever we send); our first round's hash check then re-syncs us.
        self.emit(
            f"could not download the agreed state of round {agreed.round + 1} from its "
            f"{len(agreed.holders)} holder(s); continuing from our own state"
        )
        return None

    def _adopt_from_live(self, agreed: AgreedState) -> SyncReport | None:
        """Adopt ``agreed``, or when none of its holders can send it, the next newest state
        still held by peers that did not fail us (never a fresh start while one lives)."""
        dead: set[str] = set()
        for attempt in range(2 * SYNC_ATTEMPTS):
            try:
                return self._adopt(agreed)
            except StateSyncFailed as exc:
                log.warning("state download %d failed: %s", attempt + 1, exc)
                # The download gives up only once every source failed: all of them are gone.
                dead.update(agreed.holders)
                records = self.records()
                choices = [
                    s
                    for s in states_best_first(records, self.rounds, dead, self.me, self.quorum)
                    if self._behind(s)
                ]
                if not choices:
                    return None
                if not choices[0].published:
                    self.emit(
                        f"the holders of round {agreed.round + 1}'s state did not answer; "
                        f"taking live peer {choices[0].holders[0][-8:]}'s state of round "
                        f"{choices[0].round + 1} (its last round failed, nobody else holds "
                        "an agreed state)"
                    )
                elif choices[0].round < agreed.round:
                    self.emit(
                        f"the holders of round {agreed.round + 1}'s state did not answer; "
                        f"taking round {choices[0].round + 1}'s from {len(choices[0].holders)} "
                        "live peer(s)"
                    )
                agreed = choices[0]
        return None

    def rejoin_majority(self) -> SyncReport | None:
        """Our state is a minority's (a round ran as sub-groups and ours was the smaller): adopt
        the run's agreed state (``plan.best_state``: the one most members support) if it is not
        ours. A failed download is logged; the next round's checks try again."""
        target = best_state(self.records(), self.rounds, self.quorum)
        if target is None or target.state_hash.hex() == self.diloco.state_hash():
            return None
        report = self._adopt_from_live(target)
        if report is None:
            log.warning("could not re-sync to the majority's state from any live holder")
        return report

    def after_round(
        self,
        round_number: int,
        ok: bool,
        wait_s: float = 0.0,
        majority: str | None = None,
        contributors: Collection[str] = (),
    ) -> SyncReport | None:
        """After our round ``round_number`` (failed, or its hash disagreed with the majority):
        adopt the majority's state if it differs from ours. For a failed round, wait up to
        ``wait_s`` for the others' outcome (``_outcome``). ``majority``: the state hash (hex)
        most of our round's ``contributors`` (peer ids, us included) published
        (``StateAgreement.among``); only that state of that round, as those contributors'
        records hold it, is adopted then (we were a member: the round's contributors are our
        quorum, and nobody else's record or digest counts). Returns what was synced, or None.
        A failed download is logged (the next round's check tries again)."""
        if ok:
            agreed = self._settled(round_number, majority, frozenset(contributors))
        else:
            agreed = self._outcome(round_number, wait_s)
        if agreed is None or agreed.state_hash.hex() == self.diloco.state_hash():
            return None
        report = self._adopt_from_live(agreed)
        if report is None:
            log.warning("round %d: could not re-sync from any live holder", round_number)
            return None
        # A fallback may have adopted another state than ``agreed`` (its holders failed us).
        agreed = self._adopted or agreed
        last = self._last_progress
        if last is not None and last.round == round_number == agreed.round and agreed.published:
            # We now hold the round's agreed state: say so, so that we count as a holder (a
            # joiner's source) and the peers lingering after the last round can leave.
            self.publish(
                dataclasses.replace(
                    last,
                    ok=True,
                    state_hash=agreed.state_hash,
                    published_at=time.time(),
                    peers=agreed.members,
                    members=agreed.member_list,
                )
            )
        return report

    def _hold_final(self, records: list[Progress]) -> None:
        """We joined at the run's end and adopted its final state without training a round:
        publish that we hold it (a holder's record with our id and no contribution), so the
        peers lingering for us (``linger``: we announced ourselves) can leave."""
        ours = bytes.fromhex(self.diloco.state_hash())
        final = self.diloco.round - 1
        for p in records:
            if p.ok and p.round == final and p.state_hash == ours:
                self.publish(
                    dataclasses.replace(
                        p, peer_id=self.me, peers=0, bytes_sent=0, bytes_received=0,
                        rounds_contributed=0, published_at=time.time(),
                    )
                )  # fmt: skip
                return

    def linger(self, round_number: int, max_s: float) -> None:
        """After the run's last round: keep serving our state while a peer of that round does
        not hold the agreed state yet (its round failed and it is re-syncing from us), or a live
        peer is still behind (a late starter catching up), at most ``max_s``; without this, the
        holders would all exit and leave it with nothing to fetch. A joiner that announced
        itself after the last round (it waits for this boundary, then downloads the final
        state) counts as behind until its record shows it holds the state (``_hold_final``)."""
        ours = bytes.fromhex(self.diloco.state_hash())
        announcements = join_key(self.run_id, round_number + 1)

        async def settled() -> bool:
            records = await self._records()
            at_last = [p for p in records if p.round == round_number]
            now = time.time()
            live = [p for p in records if now - p.published_at < LIVE_S]
            behind = [p for p in live if p.round < round_number]
            try:
                announced = announced_joiners(
                    await self.runtime.read_async(announcements), round_number + 1
                )
            except Exception:
                announced = set()
            waiting = announced - {p.peer_id for p in at_last} - {self.me}
            return all(p.ok and p.state_hash == ours for p in at_last) and not (behind or waiting)

        if self.runtime.poll(settled, bool, interval_s=POLL_S, timeout_s=max_s):
            return
        log.info("left after %.0f s with peers of round %d still out of sync", max_s, round_number)

    def _announce(self, round_number: int) -> None:
        try:
            value = announcement(round_number)
            self.runtime.store(join_key(self.run_id, round_number), value, PROGRESS_TTL_S)
        except Exception as exc:
            log.warning("could not announce ourselves for round %d: %s", round_number, exc)

    def _behind(self, agreed: AgreedState) -> bool:
        ours = self.diloco.round
        if agreed.round + 1 > ours:
            return True
        return agreed.round + 1 == ours and agreed.state_hash.hex() != self.diloco.state_hash()

    def _outcome(self, round_number: int, wait_s: float) -> AgreedState | None:
        """The state to adopt after our failed round ``round_number``, or None to train on.

        Our round can fail long before the others' ends (every other peer looked lost to us on a
        loaded machine), long after (a frozen process), or because we ran ahead of them (a fast
        start on a busy box): running on alone then split the run for good. So follow
        ``membership_plan.after_failed_round``: adopt the others' newest agreed state if they
        averaged this round or a later one; wait while a live member is behind us (at most
        ``wait_s`` per round of gap, see ``wait_budget_s``; one whose newest record, or start when
        it has none since, is older than ``wait_s`` counts as gone), so that we open the next
        round together; else train on."""
        started = time.monotonic()
        # Read once: a start that comes later than our failure is a joiner's, met at a boundary.
        starts = self.starts()

        def plan_of(records: list[Progress]) -> Rejoin:
            return after_failed_round(
                records, self.me, round_number, self.rounds, time.time(), wait_s, starts,
                self.quorum,
            )  # fmt: skip

        def decided(records: list[Progress]) -> Rejoin | None:
            plan = plan_of(records)
            return None if plan.verdict is Verdict.WAIT else plan

        records = self.records()
        plan = plan_of(records)
        if plan.verdict is Verdict.WAIT:
            budget_s = wait_budget_s(records, self.me, round_number, wait_s, starts)
            log.info("round %d failed: %s; waiting up to %.0f s for them",
                     round_number, plan.reason, budget_s)  # fmt: skip
            left_s = budget_s - (time.monotonic() - started)
            plan = self._poll(decided, left_s, wait_first=True) or plan
        if plan.verdict is not Verdict.ADOPT:
            return None
        assert plan.target is not None
        if plan.target.round == round_number:
            return self._settled(round_number) or plan.target
        return plan.target

    def _settled(
        self, round_number: int, majority: str | None = None, group: frozenset[str] = frozenset()
    ) -> AgreedState | None:
        """The agreed state of ``round_number`` once its successful records stop arriving: the
        best the quorum accepts, or with ``majority`` (our round's contributors' agreed hash)
        the state of that hash as the records of ``group`` (those contributors) hold it: its
        holders, the download's sources, are contributors of the round, never a stranger."""

        def state_at(records: list[Progress]) -> AgreedState | None:
            if majority is None:
                found = candidates(records, self.rounds, self.quorum)
                return next((s for s in found if s.round == round_number), None)
            ours = [p for p in in_schedule(records, self.rounds) if p.peer_id in group]
            agreed = agreed_states(ours, round_number)
            return next((s for s in agreed if s.state_hash.hex() == majority), None)

        seen = state_at(self.records())

        def stable(records: list[Progress]) -> AgreedState | None:
            nonlocal seen
            now = state_at(records)
            if seen is not None and now is not None and now.published == seen.published:
                return now
            seen = now or seen
            return None

        return self._poll(stable, SETTLE_S, wait_first=True) or seen

    def _adopt(self, agreed: AgreedState) -> SyncReport:
        sources = [PeerID.from_base58(p) for p in agreed.holders if p != self.me]
        if not sources:
            raise StateSyncFailed("no other peer holds the agreed state")
        # Announce first: the others read announcements when the next round opens, and that may
        # come soon after a round boundary (a short inner phase); if the download then fails,
        # they lose at most the matchmaking deadline waiting for us.
        next_round = agreed.round + 1
        self._announce(next_round)
        fetch = self._fetcher(self.runtime.node, self.run_id, agreed.state_hash)
        started = time.monotonic()

        async def download() -> Downloaded:
            with trio.fail_after(SYNC_TIMEOUT_S):
                return await download_state(fetch, agreed.state_hash, self._state_bytes, sources)

        try:
            got = self.runtime.call(download)
        except trio.TooSlowError:
            raise StateSyncFailed(f"download took over {SYNC_TIMEOUT_S:.0f} s") from None
        data = got.data
        self.diloco.load_state(data)
        seconds = time.monotonic() - started
        # We hold this state now: a failed round's record carries its list only when we are on
        # it (the round we held before, and its list, are gone).
        self._adopted = agreed
        listed = agreed.member_list if on_list(agreed.member_list, self.me) else b""
        self._held = (agreed.round, listed)
        self.fresh = True
        self.syncs += 1
        self.serve_current()
        assert self.diloco.round == next_round  # the state's own round, verified by load_state
        pieces = sorted(got.pieces_by_source.values(), reverse=True)
        report = SyncReport(
            next_round, self.diloco.state_hash(), len(sources), len(data), seconds, pieces
        )
        self.emit(
            f"synced to round {report.round} from {report.sources} peers "
            f"(pieces {'/'.join(map(str, pieces))}): {report.bytes / 2**20:.2f} MiB in "
            f"{report.seconds:.2f} s, state {report.state_hash[:12]} "
            + ("(the majority's)" if agreed.published else "(a live member's)")
        )
        return report


def _progressing(records: list[Progress], agreed: AgreedState) -> bool:
    """Whether a new agreed round may still come after ``agreed``: the newest record (a
    successful one first among a round's) is a success, or no newer than the agreed round."""
    if not records:
        return True  # a read that found nothing says nothing
    newest = max(records, key=lambda p: (p.round, p.ok))
    return newest.ok or newest.round <= agreed.round
