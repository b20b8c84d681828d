"""``swarm.averaging.channel_pool``: which kept data channels a round may borrow, and which are
closed."""

from __future__ import annotations

from swarm.averaging.channel_pool import MAX_IDLE_PER_SENDER, ChannelPool, Direction

A, B = b"peer-a", b"peer-b"


class FakeChannel:
    def __init__(self, channel_id: bytes, payloads: int = 0, intact: bool = True) -> None:
        self.channel_id = channel_id
        self.payloads_sent = self.payloads_received = payloads
        self.intact = intact
        self.closed = False

    def reusable(self) -> bool:
        return self.intact and not self.closed

    def close(self) -> None:
        self.closed = True


def kept(pool: ChannelPool, peer: bytes, direction: Direction, channel: FakeChannel) -> None:
    pool.opened(peer, direction, channel)  # type: ignore[arg-type]
    pool.give_back(peer, direction, channel)  # type: ignore[arg-type]


def test_a_kept_channel_is_lent_once_and_only_to_its_peer() -> None:
    pool = ChannelPool()
    channel = FakeChannel(b"x", 3)
    kept(pool, A, Direction.OUT, channel)
    assert pool.lend_out_nowait(B) is None
    assert pool.lend_out_nowait(A) is channel
    assert pool.lend_out_nowait(A) is None  # busy with the round that borrowed it
    assert not channel.closed


def test_the_receiver_lends_only_the_proposed_channel_with_the_same_count() -> None:
    pool = ChannelPool()
    stale, proposed = FakeChannel(b"old", 2), FakeChannel(b"new", 5)
    kept(pool, A, Direction.IN, stale)
    kept(pool, A, Direction.IN, proposed)
    assert pool.lend_in_nowait(A, b"new", 4) is None  # a payload the sender sent, we never read
    assert proposed.closed and stale.closed  # neither is ever lent again
    again = FakeChannel(b"new", 5)
    kept(pool, A, Direction.IN, again)
    assert pool.lend_in_nowait(A, b"new", 5) is again
    assert pool.statistics().reused == 1


def test_broken_channels_are_closed_not_kept() -> None:
    pool = ChannelPool()
    broken = FakeChannel(b"x", intact=False)
    kept(pool, A, Direction.OUT, broken)
    assert broken.closed and pool.lend_out_nowait(A) is None
    retired = FakeChannel(b"y")
    pool.opened(A, Direction.OUT, retired)  # type: ignore[arg-type]
    pool.retire(A, Direction.OUT, retired)  # type: ignore[arg-type]
    assert retired.closed and pool.statistics().idle == 0


def test_a_sender_keeps_one_channel_a_receiver_a_few_and_departures_close_them() -> None:
    pool = ChannelPool()
    outs = [FakeChannel(bytes([i])) for i in range(3)]
    ins = [FakeChannel(bytes([i])) for i in range(MAX_IDLE_PER_SENDER + 1)]
    for channel in outs:
        kept(pool, A, Direction.OUT, channel)
    for channel in ins:
        kept(pool, A, Direction.IN, channel)
    assert [c.closed for c in outs] == [True, True, False]
    assert [c.closed for c in ins] == [True] + [False] * MAX_IDLE_PER_SENDER
    pool.drop_in(A)  # the sender proposes none: its channels we kept are stale
    assert all(c.closed for c in ins) and not outs[-1].closed
    kept(pool, B, Direction.OUT, other := FakeChannel(b"b"))
    pool.discard(A)
    assert outs[-1].closed and not other.closed
    pool.close()
    assert other.closed
    late = FakeChannel(b"late")
    kept(pool, B, Direction.OUT, late)  # given back after the Averager ended: closed
    assert late.closed


def test_the_pool_closes_the_oldest_channel_past_its_limit() -> None:
    pool = ChannelPool(max_idle=2)
    channels = [FakeChannel(bytes([i])) for i in range(3)]
    for i, channel in enumerate(channels):
        kept(pool, bytes([i]), Direction.OUT, channel)
    assert [c.closed for c in channels] == [True, False, False]
