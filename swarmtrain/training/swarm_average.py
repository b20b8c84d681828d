"""``SwarmAverage``: diloco's ``Average`` protocol on top of the swarm's ``Averager``.

DiLoCo calls ``average(round, tensors, weight)`` once per outer round and treats any raise as a
failed round (no outer update, local progress kept). So this adapter only translates: DiLoCo's
round number becomes the swarm round number (every peer of a run derives it from the same
checkpointed counter, which is what lines up matchmaking keys across processes), the result's
contributors pass through, and ``AveragingFailed`` (one class: diloco re-exports swarm's) passes
through.

The state hash only exists after DiLoCo applied the outer step, i.e. after ``__call__`` returned,
so publishing it is a separate call the training loop makes (``publish_state``); ``agreement``
reads back what the round's peers published.

The averager runs in the node's trio loop (``swarmtrain.runtime.PeerRuntime``); DiLoCo calls from
the torch thread. ``expected`` (optional) names the peers matchmaking should wait for in a round,
which is how an announced joiner gets into its first round (``swarmtrain.membership.elastic``);
``exclude`` (optional) names the peers a round must leave out (banned, or whose task failed
verification: ``swarmtrain.verified.volunteer``); ``behind`` (optional) returns why a round cannot
meet anyone (the swarm already averaged it: ``swarmtrain.membership.elastic``), failing it before
matchmaking; ``check`` (optional) may still fail a finished all-reduce by raising
``AveragingFailed`` before DiLoCo applies it (a verified run's aggregation audit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

import swarm
from diloco import AverageOutcome, AveragingFailed
from swarmtrain.runtime import PeerRuntime

log = logging.getLogger(__name__)

AGREEMENT_POLL_S = 0.1


@dataclass(frozen=True)
class RoundReport:
    """What the swarm said about one round on this peer (success or failure)."""

    round: int
    ok: bool
    peers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    error: str = ""


class SwarmAverage:
    """Callable as diloco's ``Average``; keeps a ``RoundReport`` of the last call in ``last``."""

    def __init__(
        self,
        runtime: PeerRuntime,
        averager: swarm.Averager,
        expected: Callable[[int], Iterable[bytes] | None] | None = None,
        exclude: Callable[[int], Iterable[bytes]] | None = None,
        check: Callable[[swarm.AveragingResult], None] | None = None,
        behind: Callable[[int], str | None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._averager = averager
        self._expected = expected
        self._exclude = exclude
        self._check = check
        self._behind = behind
        self.last: RoundReport | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    def __call__(self, round: int, tensors: list[torch.Tensor], weight: float) -> AverageOutcome:
        """Average with the peers of ``round``. Raises diloco's ``AveragingFailed`` when the swarm
        round fails; ``ValueError`` (NaN/inf input, bad weight) and ``RuntimeError`` (the node
        stopped) pass through, and DiLoCo counts them as a failed round as well."""
        self.last = RoundReport(round, ok=False, error="in progress")
        why = self._behind(round) if self._behind is not None else None
        if why is not None:
            self.last = RoundReport(round, ok=False, error=why)
            raise AveragingFailed(why)
        expected = self._expected(round) if self._expected is not None else None
        exclude = frozenset(self._exclude(round)) if self._exclude is not None else frozenset()
        averager = self._averager

        async def average() -> swarm.AveragingResult:
            return await averager.average(
                tensors, weight, round_number=round, expected_peers=expected, exclude=exclude
            )

        try:
            result = self._runtime.call(average)
        except AveragingFailed as exc:
            self.last = RoundReport(round, ok=False, error=str(exc))
            raise
        except Exception as exc:
            self.last = RoundReport(round, ok=False, error=f"{type(exc).__name__}: {exc}")
            raise
        if self._check is not None:
            try:
                self._check(result)
            except AveragingFailed as exc:
                self.last = RoundReport(round, ok=False, error=str(exc))
                raise
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self.last = RoundReport(
            round,
            ok=True,
            peers=len(result.contributors),
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            matchmaking_s=result.matchmaking_s,
            allreduce_s=result.allreduce_s,
        )
        return AverageOutcome(list(result.tensors), dict(result.contributors))

    def publish_state(self, round: int, state_hash_hex: str) -> None:
        """Publish our state digest after round ``round``; a DHT failure is logged, not raised,
        because a missing digest only makes the agreement check inconclusive."""
        try:
            self._runtime.call(
                self._averager.publish_state_hash, round, bytes.fromhex(state_hash_hex)
            )
        except Exception as exc:
            log.warning("round %d: could not publish the state hash: %s", round, exc)

    def agreement(self, round: int, peers: int, timeout_s: float) -> swarm.StateAgreement | None:
        """The published digests of ``round`` once ``peers`` of them are visible, or what is
        visible after ``timeout_s`` (the round's peers publish within milliseconds of each other,
        so waiting is short; a peer that died after the all-reduce never publishes). None when
        the DHT could not be read at all."""
        deadline = time.monotonic() + timeout_s
        seen: swarm.StateAgreement | None = None
        while True:
            try:
                seen = self._runtime.call(self._averager.state_agreement, round)
            except Exception as exc:
                log.warning("round %d: could not read the state hashes: %s", round, exc)
            if (seen is not None and seen.peers >= peers) or time.monotonic() >= deadline:
                return seen
            time.sleep(AGREEMENT_POLL_S)
