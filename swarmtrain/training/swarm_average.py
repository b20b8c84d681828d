"""``SwarmAverage``: diloco's ``Average`` protocol on top of the swarm's ``Averager``.

DiLoCo calls ``average(round, vector, weight)`` once per outer round with its flat float32
pseudo-gradient and treats any raise as a failed round (no outer update, local progress kept).
So this adapter only translates: the vector goes to ``Averager.average_vector`` as it is (the
parameter ``sizes`` pick each segment's codec, as they would per tensor), DiLoCo's round number
becomes the swarm round number (every peer of a run derives it from the same checkpointed
counter, which is what lines up matchmaking keys across processes), the mean comes back as one
vector with its contributors and a ``RoundReport`` (the outcome's ``detail``, which
``DiLoCo.step`` hands to the training loop), and ``AveragingFailed`` (one class: diloco
re-exports swarm's) passes through.

The state hash only exists after DiLoCo applied the outer step, i.e. after ``__call__`` returned,
so publishing it is a separate call the training loop makes (``publish_state``); ``agreement``
reads back what the round's peers published, polling in the node's loop (``p2p.poll``).

The averager runs in the node's trio loop (``swarmtrain.runtime.PeerRuntime``); DiLoCo calls from
the torch thread. The membership rules (``set_rules``, given once the membership that answers
them exists, since it needs the ``DiLoCo`` built on this object): ``expected`` names the peers
matchmaking should wait for in a round, which is how an announced joiner gets into its first
round (``swarmtrain.membership.elastic``); ``exclude`` names the peers a round must leave out
(banned, or whose task failed verification: ``swarmtrain.verified.volunteer``); ``behind``
returns why a round cannot meet anyone (the swarm already averaged it:
``swarmtrain.membership.elastic``), failing it before matchmaking. ``check`` (optional) may still
fail a finished all-reduce by raising ``AveragingFailed`` before DiLoCo applies it (a verified
run's aggregation audit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

import swarm
from diloco import AverageOutcome, AveragingFailed
from swarmtrain.runtime import PeerRuntime

log = logging.getLogger(__name__)

AGREEMENT_POLL_S = 0.1


@dataclass(frozen=True)
class RoundReport:
    """What the swarm said about one successful round on this peer."""

    round: int
    peers: int
    bytes_sent: int
    bytes_received: int
    matchmaking_s: float
    allreduce_s: float
    group_size: int = 0  # the group as formed (``AveragingResult.group_size``)
    dropped: tuple[str, ...] = ()  # why the all-reduce dropped peers, one reason each


class SwarmAverage:
    """Callable as diloco's ``Average``; the outcome's ``detail`` is the round's ``RoundReport``.

    ``sizes``: the segments of DiLoCo's vector (its trainable parameters' sizes, in order), or
    a function of the round giving them (streaming fragments: the vector is one fragment's,
    another each round); one segment when not given.

    ``overwrite``: DiLoCo never reads the vector it handed to a round after the call (no error
    feedback, whose residual is computed from it, and no overlap, which carries a failed
    round's vector into the next), so the mean may land in it (``Averager.average_vector``'s
    ``overwrite``): a model-sized buffer less at the round. ``error_feedback``: DiLoCo keeps
    what the codec dropped, so the outcome carries ``sent``, the codec's round trip of the
    vector (without it that vector-sized copy is never made)."""

    def __init__(
        self,
        runtime: PeerRuntime,
        averager: swarm.Averager,
        expected: Callable[[int], Iterable[bytes] | None] | None = None,
        exclude: Callable[[int], Iterable[bytes]] | None = None,
        check: Callable[[swarm.AveragingResult], None] | None = None,
        behind: Callable[[int], str | None] | None = None,
        *,
        sizes: Sequence[int] | Callable[[int], Sequence[int]] | None = None,
        only: Callable[[int], frozenset[bytes] | None] | None = None,
        overwrite: bool = False,
        error_feedback: bool = True,
    ) -> None:
        if overwrite and error_feedback:
            raise ValueError("error feedback reads the vector after the round: no overwrite")
        self._overwrite = overwrite
        self._error_feedback = error_feedback
        self._runtime = runtime
        self._averager = averager
        self._max_weight = averager.config.weight_bounds[1]
        self._check = check
        self._sizes = sizes if sizes is None or callable(sizes) else tuple(sizes)
        self._only = only
        self.set_rules(expected=expected, exclude=exclude, behind=behind)

    def set_rules(
        self,
        *,
        expected: Callable[[int], Iterable[bytes] | None] | None = None,
        exclude: Callable[[int], Iterable[bytes]] | None = None,
        behind: Callable[[int], str | None] | None = None,
    ) -> None:
        """The membership's answers for each round (see the module docstring); None: no rule.
        (``only``, given at construction: the peers a round may group with at all, None for
        anyone: a verified run's members and its verified newcomers.)"""
        self._expected = expected
        self._exclude = exclude
        self._behind = behind

    def __call__(self, round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        """Average with the peers of ``round``. Raises diloco's ``AveragingFailed`` when the swarm
        round fails; ``ValueError`` (NaN/inf input, bad weight) and ``RuntimeError`` (the node
        stopped) pass through, and DiLoCo counts them as a failed round as well."""
        why = self._behind(round) if self._behind is not None else None
        if why is not None:
            raise AveragingFailed(why)
        expected = self._expected(round) if self._expected is not None else None
        exclude = frozenset(self._exclude(round)) if self._exclude is not None else frozenset()
        only = self._only(round) if self._only is not None else None
        averager = self._averager
        sizes = self._sizes(round) if callable(self._sizes) else self._sizes
        # Rounds of carried work past the run's bound: counted at the bound, not dropped by
        # every reducer as an inflated claim.
        weight = min(weight, self._max_weight)

        async def average() -> swarm.AveragingResult:
            return await averager.average_vector(
                vector,
                weight,
                sizes=sizes,
                round_number=round,
                expected_peers=expected,
                exclude=exclude,
                admit=None if only is None else only.__contains__,
                # DiLoCo never writes a vector it handed to a round (``diloco.Average``): the
                # round may use it as it is, without its own model-sized copy.
                give=True,
                overwrite=self._overwrite,
                want_sent=self._error_feedback,
            )

        result = self._runtime.call(average)  # AveragingFailed passes through
        if self._check is not None:
            self._check(result)
        report = RoundReport(
            round,
            peers=len(result.contributors),
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            matchmaking_s=result.matchmaking_s,
            allreduce_s=result.allreduce_s,
            group_size=result.group_size,
            dropped=tuple(result.dropped.values()),
        )
        # A view of the round's vector, no copy: DiLoCo only reads it (the outer step).
        mean = torch.from_numpy(result.vector)
        sent = None if result.sent is None else torch.from_numpy(result.sent)
        return AverageOutcome(mean, dict(result.contributors), detail=report, sent=sent)

    def publish_state(self, round: int, state_hash_hex: str) -> None:
        """Publish our state digest after round ``round``; a DHT failure is logged, not raised,
        because a missing digest only makes the agreement check inconclusive."""
        try:
            self._runtime.call(
                self._averager.publish_state_hash, round, bytes.fromhex(state_hash_hex)
            )
        except Exception as exc:
            log.warning("round %d: could not publish the state hash: %s", round, exc)

    def agreement(
        self, round: int, peers: int, timeout_s: float, among: Iterable[bytes] | None = None
    ) -> swarm.StateAgreement | None:
        """The published digests of ``round`` once ``peers`` of them are visible, or what is
        visible after ``timeout_s`` (the round's peers publish within milliseconds of each other,
        so waiting is short; a peer that died after the all-reduce never publishes). ``among``:
        only those owners' digests count (the round's contributors; anyone may publish under
        the run-wide key). None when the DHT could not be read at all."""
        averager = self._averager
        seen: swarm.StateAgreement | None = None
        only = None if among is None else frozenset(among)

        async def read() -> swarm.StateAgreement | None:
            nonlocal seen
            try:
                found = await averager.state_agreement(round)
                seen = found if only is None else found.among(only)
            except Exception as exc:
                log.warning("round %d: could not read the state hashes: %s", round, exc)
            return seen

        self._runtime.poll(
            read,
            lambda s: s is not None and s.peers >= peers,
            interval_s=AGREEMENT_POLL_S,
            timeout_s=timeout_s,
        )
        return seen
