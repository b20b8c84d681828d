"""Data channels kept between all-reduce rounds, so a round does not pay for opening them again.

Opening a pair's ``p2p.BulkChannel`` costs about three round trips (offer and accept, the TCP
dial, the ready byte) and a fresh connection's slow start: on a 100 Mbit/s link with 50 ms round
trips, a quarter of a second per round. The ``Averager`` owns one ``ChannelPool``; each round's
session borrows the channels it had with its peers and gives them back when the round ended
cleanly for that pair.

Rules (the agreement between a pair's two ends is ``swarm.averaging.channels``):

- A channel is in one session's hands at a time: ``opened`` and the lends mark it busy, and
  ``give_back`` or ``retire`` ends that; two rounds that overlap never share one. A lend waits
  a moment (``BUSY_WAIT_S``) for a busy channel to come back: the round before may still be
  closing it on this side when the next one starts.
- Only an intact channel comes back (``give_back``): one whose every payload went through whole,
  of a round that succeeded, with a peer that was not lost or dropped; the session retires
  (closes) every other, so a payload cut off halfway can never be read as the next round's.
- The sender proposes the channel it holds; the receiver lends its end only if it holds the same
  channel with as many payloads received as the sender sent, and closes any other it holds from
  that sender (the sender keeps at most one, so the others are stale).
- ``discard`` closes a departed peer's channels; ``close`` (the Averager's end) closes all, and
  anything given back afterwards is closed.

Trio only for those waits; everything else is plain bookkeeping that closes sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2p import BulkChannel
from swarm.averaging.channels import Direction, resume_ok

# Idle channels kept in all (sockets held open); past it the one given back longest ago closes.
# Groups of up to 64 that change every round (Moshpit) meet many peers over time.
MAX_IDLE_CHANNELS = 256
# Receiving ends kept per sender: two rounds that overlap may each have opened one.
MAX_IDLE_PER_SENDER = 2
# How long a lend waits for the channel asked for while a session still holds it.
BUSY_WAIT_S = 0.5


Key = tuple[bytes, Direction, bytes]  # (peer, direction, channel id)


@dataclass(frozen=True)
class PoolStatistics:
    """``opened``: channels our sessions opened or accepted; ``reused``: kept ones that carried
    a later round's payloads (each end counts its own); ``idle``: kept now; ``closed``: closed
    by the pool (retired, stale, broken, over the limit)."""

    opened: int
    reused: int
    idle: int
    closed: int


class ChannelPool:
    def __init__(self, max_idle: int = MAX_IDLE_CHANNELS) -> None:
        self._max_idle = max_idle
        self._idle: OrderedDict[Key, BulkChannel] = OrderedDict()  # oldest given back first
        self._busy: dict[Key, BulkChannel] = {}
        self._returned = trio.Event()
        self._closed = False
        self._opened = 0
        self._reused = 0
        self._closed_count = 0

    def opened(self, peer: bytes, direction: Direction, channel: BulkChannel) -> None:
        """A session opened (or accepted) ``channel`` with ``peer``: busy until given back."""
        self._opened += 1
        self._busy[(peer, direction, channel.channel_id)] = channel

    async def lend_out(self, peer: bytes) -> BulkChannel | None:
        """``lend_out_nowait`` after waiting up to ``BUSY_WAIT_S`` while a session still holds
        a channel of ours to ``peer``."""
        await self._wait_while(lambda k: k[0] == peer and k[1] is Direction.OUT)
        return self.lend_out_nowait(peer)

    def lend_out_nowait(self, peer: bytes) -> BulkChannel | None:
        """Our kept channel to ``peer`` if it is intact, taken out of the pool (busy)."""
        for key in [k for k in self._idle if k[0] == peer and k[1] is Direction.OUT]:
            channel = self._idle.pop(key)
            if channel.reusable():
                return self._lend(key, channel)
            self._close(channel)
        return None

    async def lend_in(self, peer: bytes, channel_id: bytes, payloads: int) -> BulkChannel | None:
        """``lend_in_nowait`` after waiting up to ``BUSY_WAIT_S`` while a session still holds
        that channel."""
        await self._wait_while(lambda k: k == (peer, Direction.IN, channel_id))
        return self.lend_in_nowait(peer, channel_id, payloads)

    def lend_in_nowait(self, peer: bytes, channel_id: bytes, payloads: int) -> BulkChannel | None:
        """Our end of ``peer``'s channel ``channel_id`` if we kept it intact with ``payloads``
        payloads received (what the sender says it sent), taken out of the pool (busy). Every
        other end from ``peer`` we kept is closed: the sender keeps one channel to us, the one
        it proposes."""
        found = None
        for key in [k for k in self._idle if k[0] == peer and k[1] is Direction.IN]:
            channel = self._idle.pop(key)
            if found is None and resume_ok(
                key[2], channel.payloads_received, channel.reusable(), channel_id, payloads
            ):
                found = self._lend(key, channel)
                self._reused += 1  # we answer yes: it carries this round's payloads
            else:
                self._close(channel)
        return found

    def drop_in(self, peer: bytes) -> None:
        """``peer`` proposes no channel to us: the ends of its channels we kept are stale."""
        for key in [k for k in self._idle if k[0] == peer and k[1] is Direction.IN]:
            self._close(self._idle.pop(key))

    def give_back(self, peer: bytes, direction: Direction, channel: BulkChannel) -> None:
        """Keep ``channel`` for ``peer``'s next round (the caller vouches that it ended clean)."""
        key = (peer, direction, channel.channel_id)
        self._unbusy(key, channel)
        if self._closed or not channel.reusable():
            self._close(channel)
            return
        same = [k for k in self._idle if k[0] == peer and k[1] is direction]
        keep = 1 if direction is Direction.OUT else MAX_IDLE_PER_SENDER
        for old in same[: max(0, len(same) - keep + 1)]:
            self._close(self._idle.pop(old))
        self._idle[key] = channel
        while len(self._idle) > self._max_idle:
            self._close(self._idle.popitem(last=False)[1])

    def retire(self, peer: bytes, direction: Direction, channel: BulkChannel) -> None:
        """Close ``channel`` for good (its round failed with it, or it broke)."""
        self._unbusy((peer, direction, channel.channel_id), channel)
        self._close(channel)

    def discard(self, peer: bytes) -> None:
        """Close every kept channel with ``peer`` (it left, or a round lost it)."""
        for key in [k for k in self._idle if k[0] == peer]:
            self._close(self._idle.pop(key))

    def close(self) -> None:
        """Close everything kept; whatever is given back from now on is closed too."""
        self._closed = True
        while self._idle:
            self._close(self._idle.popitem()[1])
        self._wake()

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self._opened, self._reused, len(self._idle), self._closed_count)

    def reused(self) -> None:
        """The peer kept its end of a channel we lent: it carries this round's payloads."""
        self._reused += 1

    def _lend(self, key: Key, channel: BulkChannel) -> BulkChannel:
        self._busy[key] = channel
        return channel

    def _unbusy(self, key: Key, channel: BulkChannel) -> None:
        if self._busy.get(key) is channel:
            del self._busy[key]
            self._wake()

    def _wake(self) -> None:
        self._returned.set()
        self._returned = trio.Event()

    async def _wait_while(self, busy: Callable[[Key], bool]) -> None:
        with trio.move_on_after(BUSY_WAIT_S):
            while not self._closed:
                # a channel its session closed without retiring it is not coming back
                for key in [k for k, c in self._busy.items() if c.closed]:
                    del self._busy[key]
                if not any(busy(k) for k in self._busy):
                    return
                await self._returned.wait()

    def _close(self, channel: BulkChannel) -> None:
        channel.close()
        self._closed_count += 1
