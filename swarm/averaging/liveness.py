"""When a member of one all-reduce round counts as lost: the liveness rules, sans-IO.

The session's driver (``swarm.averaging.session``) tells a ``Liveness`` what it saw (a message
heard, a transfer begun or ended, a stream opened to us, a ``Done``) with the time it saw it, and
asks it whom to ping, whom to call lost, and how long a dial may keep trying. Times are plain
numbers on the driver's clock; nothing here sleeps, dials or reads a clock.

Rules, ``T`` being ``peer_timeout_s``:

1. *Reach.* A member is dialed (by its sender, or by a ping) again until ``T`` after the round's
   start: it declared for this round, it may have stalled a moment, or its connections to us
   just closed. ``keep_trying_s`` is what is left of that window (all of it before ``start``).
2. *Streams due.* A member still in the round opens its stream to us once its connect pass is
   over (at most ``T`` + ``connect_wait_s``), within one more ``T``: by ``2 T + connect_wait_s``
   (1 s) after the start. One that answers pings but opened no stream by then is lost
   (``overdue``): it left before its senders started, or never meant to take part, and the parts
   waiting for its slices would otherwise hold everyone until the deadline.
3. *Pings.* A live member that still owes us something (no ``Done`` yet), quiet for a heartbeat,
   with no transfer in flight, is pinged (``to_ping``); the ping's own deadline is ``T``, so a
   frozen process that keeps its sockets open is lost after ``T``. A member with a transfer in
   flight is not pinged: the transfer's progress deadline watches it (``transfer_idle_s``, at
   least 5 s), and a ping queued behind a payload under load would misjudge a busy peer.
4. *Once.* A peer is reported lost at most once, never after the session closed, never one no
   longer alive, and never one that said ``Done`` after we had our result: it finished and
   closed its side, nothing more is due from it (``report``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CONNECT_WAIT_S", "MIN_TRANSFER_IDLE_S", "Liveness", "LivenessConfig"]

# How long the higher peer id of a pair waits for the lower one's dial before dialing itself.
CONNECT_WAIT_S = 1.0
# A transfer may stall this long at least before its peer counts as lost, whatever ``T``: a
# payload's TCP connection can back off for seconds under loss without the peer being gone.
MIN_TRANSFER_IDLE_S = 5.0


@dataclass(frozen=True)
class LivenessConfig:
    peer_timeout_s: float
    heartbeat_s: float
    connect_wait_s: float = CONNECT_WAIT_S


class Liveness:
    """What one session knows of its peers' liveness, and the decisions drawn from it."""

    def __init__(self, config: LivenessConfig) -> None:
        self.config = config
        self.started_at = math.nan
        self.reach_until = math.inf  # rule 1; ``start`` sets it
        self.streams_due = math.inf  # rule 2; ``start`` sets it
        self.last_heard: dict[bytes, float] = {}
        self.in_flight: dict[bytes, int] = {}
        self.opened_to_us: set[bytes] = set()  # members whose stream reached us this round
        self.done: set[bytes] = set()  # members that said Done
        self.lost: set[bytes] = set()  # members reported lost

    # -- facts -------------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        """The round starts: the reach window and the streams' due time count from ``now``."""
        timeout = self.config.peer_timeout_s
        self.started_at = now
        self.reach_until = now + timeout
        self.streams_due = self.reach_until + self.config.connect_wait_s + timeout

    def heard(self, peer: bytes, now: float) -> None:
        self.last_heard[peer] = now

    def transfer_started(self, peer: bytes) -> None:
        self.in_flight[peer] = self.in_flight.get(peer, 0) + 1

    def transfer_ended(self, peer: bytes) -> None:
        self.in_flight[peer] -= 1

    def stream_opened(self, peer: bytes) -> None:
        self.opened_to_us.add(peer)

    def said_done(self, peer: bytes) -> None:
        self.done.add(peer)

    # -- decisions ---------------------------------------------------------------------------------

    def keep_trying_s(self, now: float) -> float:
        """Rule 1: how long a dial to a member may still keep trying."""
        return max(0.0, self.reach_until - now)

    def transfer_idle_s(self, configured_s: float) -> float:
        """Rule 3: a transfer's progress deadline, from the bulk plane's configured one."""
        return min(configured_s, max(MIN_TRANSFER_IDLE_S, self.config.peer_timeout_s))

    def overdue(self, now: float, others: Iterable[bytes]) -> list[tuple[bytes, str]]:
        """Rule 2: the live ``others`` whose stream to us is overdue, with why, sorted."""
        if now < self.streams_due:
            return []
        why = f"opened no stream to us within {self.streams_due - self.started_at:.0f} s"
        return [(peer, why) for peer in sorted(set(others) - self.opened_to_us)]

    def to_ping(self, now: float, others: Iterable[bytes]) -> list[bytes]:
        """Rule 3: the live ``others`` to ping now, sorted."""
        quiet_since = now - self.config.heartbeat_s
        return sorted(
            peer
            for peer in set(others) - self.done - self.lost
            if self.last_heard.get(peer, -math.inf) < quiet_since and not self.in_flight.get(peer)
        )

    def report(self, peer: bytes, *, alive: bool, closed: bool, finished: bool) -> bool:
        """Rule 4: whether ``peer``, seen gone, is to be reported lost now (recorded if so).
        ``alive``: the machine still counts it; ``closed``: the session ended; ``finished``:
        we hold our result."""
        if closed or peer in self.lost or not alive:
            return False
        if peer in self.done and finished:
            return False
        self.lost.add(peer)
        return True
