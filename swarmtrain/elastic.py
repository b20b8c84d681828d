"""Elastic membership for a volunteer: join a running swarm, serve our state, re-sync on drift.

What a node does around its DiLoCo rounds (``swarmtrain.node`` calls these in its main thread):

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
  differs from the majority's, download the agreed state the same way and announce again.
* **Expected peers**: when a round has announced joiners (or we just joined), every member passes
  the same expected set to matchmaking: the holders of the previous round's agreed state plus the
  announced joiners. Everyone derives it from the same DHT records, so everyone forms the same
  group and the joiner contributes in its first round; without joiners the averager's own rule
  (the previous round's survivors) applies unchanged.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from diloco import DiLoCo
from p2p import PeerID
from swarmtrain.progress import (
    PROGRESS_TTL_S,
    AgreedState,
    Progress,
    agreed_state,
    decode_all,
    join_key,
    progress_key,
)
from swarmtrain.runtime import PeerRuntime
from swarmtrain.state_sync import (
    Downloaded,
    Fetch,
    StateServer,
    StateSyncFailed,
    download_state,
    node_fetcher,
)

log = logging.getLogger(__name__)

POLL_S = 0.2
SETTLE_S = 1.0  # a round's peers publish within milliseconds; this covers a loaded machine
SYNC_TIMEOUT_S = 120.0
SYNC_ATTEMPTS = 3


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
    ) -> None:
        self.runtime = runtime
        self._fetcher = fetcher  # how to fetch ranges from a source (injected by tests)
        self.server = server
        self.run_id = run_id
        self.diloco = diloco
        self.emit = emit
        self.me = str(runtime.peer_id)
        self.fresh = False  # adopted a downloaded state and has not averaged since
        self.syncs = 0
        self._last_progress: Progress | None = None
        self._state_bytes = len(diloco.state_bytes())

    # -- records -------------------------------------------------------------------------------

    def records(self) -> list[Progress]:
        try:
            return decode_all(self.runtime.read(progress_key(self.run_id)))
        except Exception as exc:
            log.warning("could not read the run's progress records: %s", exc)
            return []

    def publish(self, progress: Progress) -> None:
        self._last_progress = progress
        try:
            self.runtime.store(
                progress_key(self.run_id),
                progress.to_bytes(),
                PROGRESS_TTL_S,
                version=progress.round + 1,
            )
        except Exception as exc:
            log.warning("round %d: could not publish progress: %s", progress.round, exc)

    def serve_current(self) -> None:
        """Offer the current state to joiners (call after a successful round)."""
        data = self.diloco.state_bytes()
        self.runtime.call_sync(self.server.offer, data[-32:], data)

    # -- matchmaking ---------------------------------------------------------------------------

    def expected_peers(self, round_number: int) -> set[bytes] | None:
        """The expected set for ``round_number``'s matchmaking, or None for the averager's own
        rule (no joiner announced and we did not just join)."""
        try:
            joiners = set(self.runtime.read(join_key(self.run_id, round_number)))
        except Exception as exc:
            log.warning("round %d: could not read announced joiners: %s", round_number, exc)
            joiners = set()
        if not joiners and not self.fresh:
            return None
        agreed = agreed_state(self.records(), round_number - 1)
        members = set(agreed.holders if agreed else ()) | joiners | {self.me}
        if len(members) < 2:
            return None  # nobody to expect: the averager's own rule (wait for the deadline)
        log.info("round %d: %d joiner(s) announced; expecting %d peers", round_number,
                 len(joiners), len(members))  # fmt: skip
        return {PeerID.from_base58(p).to_bytes() for p in members}

    # -- syncing -------------------------------------------------------------------------------

    def catch_up(self, wait_s: float, rounds: int) -> SyncReport | None:
        """At start: if the swarm's agreed state is ahead of (or differs from) ours, wait up to
        ``wait_s`` for the next round boundary (not when the run's last round, ``rounds``, is
        already agreed), then adopt that round's agreed state. Returns what was synced, or None
        when we already hold the agreed state, the run is new, or no holder could send it (then
        we train on our own state and re-sync after a round)."""
        records = self.records()
        agreed = agreed_state(records)
        if agreed is None or not self._behind(agreed):
            return None
        # Wait for a boundary only while the swarm makes progress: if the newest record is a
        # failed round past the agreed one, no new agreed round may ever come.
        newest = max(records, key=lambda p: (p.round, p.ok))
        progressing = newest.ok or newest.round <= agreed.round
        if agreed.round + 1 >= rounds:
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
        deadline = time.monotonic() + (wait_s if progressing else 0.0)
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            newer = agreed_state(self.records())
            if newer is not None and newer.round > agreed.round:
                agreed = self._settled(newer.round) or newer
                break
        for attempt in range(SYNC_ATTEMPTS):
            try:
                return self._adopt(agreed)
            except StateSyncFailed as exc:
                log.warning("state download %d failed: %s", attempt + 1, exc)
                fresh = agreed_state(self.records())
                agreed = fresh if fresh is not None else agreed
        # Training on our own state is safe for the others (they apply the same average to the
        # same state whatever we send); our first round's hash check then re-syncs us.
        self.emit(
            f"could not download the agreed state of round {agreed.round + 1} from its "
            f"{len(agreed.holders)} holder(s); continuing from our own state"
        )
        return None

    def after_round(self, round_number: int, ok: bool, wait_s: float = 0.0) -> SyncReport | None:
        """After our round ``round_number`` (failed, or its hash disagreed with the majority):
        adopt the majority's state if it differs from ours. For a failed round, wait up to
        ``wait_s`` for the others' outcome (``_outcome``). Returns what was synced, or None. A
        failed download is logged (the next round's check tries again)."""
        agreed = self._settled(round_number) if ok else self._outcome(round_number, wait_s)
        if agreed is None or agreed.state_hash.hex() == self.diloco.state_hash():
            return None
        try:
            report = self._adopt(agreed)
        except StateSyncFailed as exc:
            log.warning("round %d: could not re-sync: %s", round_number, exc)
            return None
        last = self._last_progress
        if last is not None and last.round == round_number == agreed.round:
            # We now hold the round's agreed state: say so, so that we count as a holder (a
            # joiner's source) and the peers lingering after the last round can leave.
            self.publish(
                dataclasses.replace(
                    last, ok=True, state_hash=agreed.state_hash, published_at=time.time()
                )
            )
        return report

    def linger(self, round_number: int, max_s: float) -> None:
        """After the run's last round: keep serving our state while a peer of that round does
        not hold the agreed state yet (its round failed and it is re-syncing from us), at most
        ``max_s``; without this, the holders would all exit and leave it with nothing to fetch."""
        ours = bytes.fromhex(self.diloco.state_hash())
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            at_last = [p for p in self.records() if p.round == round_number]
            if all(p.ok and p.state_hash == ours for p in at_last):
                return
            time.sleep(POLL_S)
        log.info("left after %.0f s with peers of round %d still out of sync", max_s, round_number)

    def _announce(self, round_number: int) -> None:
        try:
            self.runtime.store(join_key(self.run_id, round_number), b"\x01", PROGRESS_TTL_S)
        except Exception as exc:
            log.warning("could not announce ourselves for round %d: %s", round_number, exc)

    def _behind(self, agreed: AgreedState) -> bool:
        ours = self.diloco.round
        if agreed.round + 1 > ours:
            return True
        return agreed.round + 1 == ours and agreed.state_hash.hex() != self.diloco.state_hash()

    def _outcome(self, round_number: int, wait_s: float) -> AgreedState | None:
        """The state to adopt after our failed round ``round_number``, or None if nobody's
        round succeeded.

        Our round can fail long before the others' ends (every other peer looked lost to us on a
        loaded machine) or long after (a frozen process): waiting only a moment for their
        records then found none, we kept training alone a round behind, were not expected by
        the next round's group, failed it too, and never came back. So wait, at most ``wait_s``,
        until the peers of the previous round have all published this one; if they have moved
        on already (their records are per peer, the newest only), adopt their newest agreed
        state: ours is as stale, and we join at the next boundary like any joiner."""
        deadline = time.monotonic() + wait_s
        while True:
            records = self.records()
            if agreed_state(records, round_number) is not None:
                return self._settled(round_number)
            newest = agreed_state(records)
            if newest is not None and newest.round > round_number:
                return newest
            # peers of the previous round (a peer whose newest record is older left earlier)
            others = [p for p in records if p.peer_id != self.me and p.round >= round_number - 1]
            if all(p.round >= round_number for p in others) or time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def _settled(self, round_number: int) -> AgreedState | None:
        """The agreed state of ``round_number`` once its successful records stop arriving."""
        deadline = time.monotonic() + SETTLE_S
        seen = agreed_state(self.records(), round_number)
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            now = agreed_state(self.records(), round_number)
            if seen is not None and now is not None and now.published == seen.published:
                return now
            seen = now or seen
        return seen

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
        self.diloco.load_state(bytes(data))
        seconds = time.monotonic() - started
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
            f"{report.seconds:.2f} s, state {report.state_hash[:12]} (the majority's)"
        )
        return report
