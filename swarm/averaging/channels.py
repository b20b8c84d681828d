"""Which data channels an all-reduce round keeps for the next one: the kept-channel agreement,
sans-IO.

A pair's ``p2p.BulkChannel`` numbers its payloads, so both ends must have counted the same
payloads before a kept channel carries the next one: a payload cut off halfway, or sent but never
read, would otherwise be read as the next round's. The agreement, per ordered pair (sender ->
receiver):

1. *Propose.* The sender's ``Hello`` names the channel it kept to the receiver and how many
   payloads it sent on it (``KeptChannels.propose``; none: an empty id).
2. *Answer.* The receiver lends its end only if it kept that very channel, intact, with as many
   payloads received (``resume_ok``): ``Resumed(True)``, else ``Resumed(False)``; every other end
   it kept from that sender is stale, since the sender keeps one channel per peer. A ``Hello``
   naming none makes all of them stale.
3. *Use.* The sender reads the answer before its first big payload (one round trip, where opening
   a channel costs three and a new connection's slow start): on yes the kept channel carries the
   round's payloads, on no it is closed and a new one opened. A proposal never needed (no big
   payload this round) stays as it was, so it may be kept again.
4. *Keep.* A channel is kept only when its traffic ended clean, the round succeeded here, and the
   peer was neither lost nor dropped (``Standing.keeps``). Clean, on the sender: every payload
   went out whole and its send loop ended normally; on the receiver: the stream ended between
   messages after the peer's ``Done`` (``receiver_clean``), so every item announced was read
   with its payload. A channel that ends clean before the round's outcome is known is held
   (``Verdict.HOLD``) and settled when the session ends (``KeptChannels.release``); every other
   channel is retired (closed).

``KeptChannels`` is generic in the channel type: it never touches one, it only says what to do
with it (``Verdict``); the driver carries that out on ``swarm.averaging.channel_pool.ChannelPool``,
which holds the channels between rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

__all__ = ["Direction", "KeptChannels", "Standing", "Verdict", "receiver_clean", "resume_ok"]

C = TypeVar("C")


class Direction(Enum):
    OUT = "out"  # we opened it and send on it
    IN = "in"  # the peer opened it and we receive on it


class Verdict(Enum):
    GIVE_BACK = "give back"  # keep it in the pool for the pair's next round
    RETIRE = "retire"  # close it
    HOLD = "hold"  # ended clean; the round's outcome decides at ``release``


def resume_ok(
    kept_id: bytes, kept_payloads: int, intact: bool, proposed_id: bytes, proposed_payloads: int
) -> bool:
    """Rule 2: the receiver's end ``kept_id`` (``kept_payloads`` received, ``intact``) may carry
    the round whose sender proposed ``proposed_id`` with ``proposed_payloads`` sent."""
    return intact and kept_id == proposed_id and kept_payloads == proposed_payloads


def receiver_clean(ended_between_messages: bool, said_done: bool) -> bool:
    """Rule 4: the receiver's traffic ended clean: the stream ended between messages, after the
    sender's ``Done``."""
    return ended_between_messages and said_done


@dataclass(frozen=True)
class Standing:
    """What the session knows of its round when it decides on a channel: ``succeeded`` (it holds
    a result, no error), ``closed`` (the session ended), ``good`` (peers neither lost nor
    dropped, still alive), ``pooled`` (channels outlive the session: an Averager's pool)."""

    succeeded: bool
    closed: bool
    good: frozenset[bytes]
    pooled: bool

    def keeps(self, peer: bytes) -> bool:
        """Rule 4: a clean channel with ``peer`` may be kept."""
        return self.pooled and self.succeeded and peer in self.good

    def awaiting_ends(self, receiving: frozenset[bytes]) -> frozenset[bytes]:
        """The peers whose incoming stream is worth waiting for (a moment) before the session
        closes: their channel may end clean and be kept (rule 4)."""
        return receiving & self.good if self.pooled and self.succeeded else frozenset()


class KeptChannels(Generic[C]):
    """One session's kept-channel bookkeeping: proposals awaiting an answer, channels held until
    the round's outcome is known."""

    def __init__(self) -> None:
        self._proposed: dict[bytes, C] = {}
        self._held: dict[tuple[bytes, Direction], C] = {}

    def propose(self, peer: bytes, channel: C) -> None:
        """Rule 1: ``channel`` (ours to ``peer``) is named in our Hello."""
        self._proposed[peer] = channel

    def take_proposal(self, peer: bytes) -> C | None:
        """The proposal to ``peer`` awaiting its answer (rule 3), now the caller's to settle."""
        return self._proposed.pop(peer, None)

    def ended(
        self, peer: bytes, direction: Direction, channel: C, clean: bool, standing: Standing
    ) -> Verdict:
        """Rule 4: the traffic on ``channel`` with ``peer`` ended (``clean`` or not): what to do
        with it now. ``HOLD`` means this keeps it until ``release``."""
        if not clean or standing.closed or not standing.pooled or (peer, direction) in self._held:
            return Verdict.RETIRE
        if standing.keeps(peer):
            return Verdict.GIVE_BACK
        self._held[(peer, direction)] = channel
        return Verdict.HOLD

    def release(self, standing: Standing) -> list[tuple[Verdict, bytes, Direction, C]]:
        """The session ends: every held channel given back if its peer ``keeps``, else retired."""
        verdicts = [
            (
                Verdict.GIVE_BACK if standing.keeps(peer) else Verdict.RETIRE,
                peer,
                direction,
                channel,
            )
            for (peer, direction), channel in self._held.items()
        ]
        self._held.clear()
        return verdicts
