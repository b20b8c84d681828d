"""The byte-moving half of an all-reduce session: each member's links for one round.

``PeerLinks`` (the base of ``swarm.averaging.session.Session``) holds what one session does on the
network: connect to the members (the lower peer id dialing), one sender task per peer that writes
its stream (``Hello``, then items with their payloads on the pair's bulk channel, then ``Done``),
one receiver per incoming stream that turns items into the machine's events, the reports of lost
or misbehaving peers into the inbox, and what becomes of each data channel when its traffic ends.
It decides nothing: when a peer is lost is ``swarm.averaging.liveness``'s rule, which channel is
kept ``swarm.averaging.channels``'s, what the bytes are ``swarm.averaging.session_wire``'s;
whatever breaks a stream or a transfer reports the peer lost, bytes that break the protocol report
it misbehaving.

Its state is the session's (set by ``Session.__init__``, listed below): the two halves act on one
round's machine, inbox, outboxes, landings and channels, and a class apart would pass most of it
back and forth.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from p2p import (
    BulkChannel,
    BulkConfig,
    BulkTransferFailed,
    Node,
    P2PError,
    PeerID,
    RemoteProtocolError,
    RpcStream,
    Stream,
    StreamEnded,
    accept_channel,
    open_channel,
    stream_kind,
)
from swarm.averaging.allreduce import (
    AllReduce,
    DeadlineReached,
    Encoded,
    PartReceived,
    PeerLost,
    ReducedPartReceived,
    SendPart,
    SendReduced,
)
from swarm.averaging.buffers import BufferPool
from swarm.averaging.channel_pool import ChannelPool
from swarm.averaging.channels import Direction, KeptChannels, Standing, Verdict, receiver_clean
from swarm.averaging.liveness import CONNECT_WAIT_S, Liveness
from swarm.averaging.matchmaking import Group
from swarm.averaging.payload import Layout
from swarm.averaging.session_wire import (
    INLINE_MAX_BYTES,
    KIND_REDUCED,
    KIND_SLICE,
    PROTOCOL,
    Done,
    Hello,
    Item,
    Resumed,
    RoundValues,
    check_item,
)

if TYPE_CHECKING:
    from swarm.averaging.session import RoundResult, SessionConfig

log = logging.getLogger(__name__)

# Paced channels together take this share of our link: just under it, so the flows meeting at a
# receiver stay below its rate and its queue drains between bursts.
PACING_SHARE = 0.97
# Raw float32 payloads are little-endian: received bytes are the values where that is native.
_RAW_IS_NATIVE = np.dtype("<f4") == np.dtype(np.float32)


class Wake:
    """Inbox marker: something other than a machine event changed (a peer said Done)."""


class UploadMeter:
    """Our upload rate: bulk bytes sent over the time at least one bulk send was running."""

    def __init__(self) -> None:
        self.sent = 0
        self.busy_s = 0.0
        self._running = 0
        self._since = 0.0

    @contextmanager
    def sending(self) -> Iterator[None]:
        if not self._running:
            self._since = time.perf_counter()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if not self._running:
                self.busy_s += time.perf_counter() - self._since


async def connect_first(
    node: Node, me: bytes, peers: Iterable[bytes], peer_timeout_s: float
) -> None:
    """Connect to every member before any stream opens, the lower peer id dialing.

    When both ends of a pair dial at once, each side may keep a different one of the two
    connections and close the other (one connection per peer), which resets the streams on
    both: at first contact a group of 8 lost whole rounds that way. So the higher id waits a
    moment for the lower one's dial, then dials itself (the lower one may be behind a NAT).
    """

    async def one(peer: bytes) -> None:
        peer_id = PeerID(peer)
        if me > peer:
            with trio.move_on_after(CONNECT_WAIT_S):
                while node.host.connection_kind(peer_id) is None:
                    await trio.sleep(0.02)
        try:
            await node.reach(peer_id)
        except P2PError as exc:
            log.debug("connecting to %s: %s", short_id(peer), exc)  # its sender tries again

    with trio.move_on_after(peer_timeout_s + CONNECT_WAIT_S):
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)


class RoundDriver:
    """The loop that feeds one round's sans-IO machine (the flat ``AllReduce`` or the grid's
    ``GridAllReduce``) its events and applies its actions, shared by ``Session`` and
    ``GridSession``: they differ in their links, their ``_apply`` and ``_watched``."""

    node: Node
    config: SessionConfig
    group: Group
    machine: Any
    alive: frozenset[bytes]
    _live: Liveness
    _big: bool  # big enough for the machine, encoding, decoding and hashing to go to a thread
    _inbox: trio.MemoryReceiveChannel[Any]
    _inbox_send: trio.MemorySendChannel[Any]
    _result: RoundResult | None
    _error: str | None
    _closed: bool

    async def _apply(self, actions: list[Any]) -> None:
        raise NotImplementedError

    def _watched(self) -> frozenset[bytes]:
        """The live peers we exchange items with: those whose streams and pings we watch, and
        who may still need something from us until they said ``Done``."""
        raise NotImplementedError

    async def _drive(self) -> None:
        await self._apply(await self._call(self.machine.start))
        while not self._closed:
            with trio.move_on_at(self.machine.deadline) as wait:
                event = await self._inbox.receive()
            if wait.cancelled_caught:
                await self._apply(await self._call(self.machine.handle, DeadlineReached()))
                return
            if not isinstance(event, Wake):
                try:
                    actions = await self._call(self.machine.handle, event)
                except RemoteProtocolError as exc:
                    log.warning("ignored an event: %s", exc)
                    continue
                await self._apply(actions)
            if self._error is not None:
                return
            if self._result is not None and self._watched() <= self._live.done:
                return  # nobody we talk to can still need a forward, relay or handover from us

    async def _call(self, method: Any, *event: Any) -> list[Any]:
        now = trio.current_time()
        if self._big:
            actions = await trio.to_thread.run_sync(method, *event, now)
        else:
            actions = method(*event, now)
        self.alive = frozenset(self.machine.alive)
        return actions

    async def _thread(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args) if self._big else fn(*args)

    async def _watch_liveness(self) -> None:
        """Every heartbeat, report the watched peers whose stream to us is overdue and ping the
        quiet ones (``swarm.averaging.liveness`` rules 2 and 3 say which)."""
        while True:
            await trio.sleep(self.config.heartbeat_s)
            for peer, why in self._live.overdue(trio.current_time(), self._watched()):
                await self._peer_gone(peer, why)
            targets = self._live.to_ping(trio.current_time(), self._watched())
            async with trio.open_nursery() as nursery:
                for peer in targets:
                    nursery.start_soon(self._ping, peer)

    async def _ping(self, peer: bytes) -> None:
        # Reached (or not) like its sender: a member without a connection yet is tried again
        # until the peer timeout from the round's start, not dropped by a ping's first dial.
        result = await self.node.ping(
            PeerID(peer),
            rounds=1,
            deadline_s=self.config.peer_timeout_s,
            keep_trying_s=self._live.keep_trying_s(trio.current_time()),
        )
        if not result.ok:
            await self._peer_gone(peer, f"no answer to a ping: {result.error}")

    async def _peer_gone(self, peer: bytes, why: str) -> None:
        finished = self._result is not None
        if self._live.report(
            peer, alive=peer in self.alive, closed=self._closed, finished=finished
        ):
            log.info("round %s: lost %s: %s", self.group.round, short_id(peer), why)
            await self._post(PeerLost(peer))

    async def _post(self, event: Any) -> None:
        """Into the inbox: at once while it has room (always, for honest peers), else wait."""
        try:
            self._inbox_send.send_nowait(event)
        except trio.WouldBlock:
            await self._inbox_send.send(event)


class PeerLinks(RoundDriver):
    """Each member's links for one session (see the module docstring)."""

    node: Node
    run_id: str
    layout: Layout
    config: SessionConfig
    me: bytes
    peers: tuple[bytes, ...]
    parts: list[tuple[bytes, int, int]]
    align: int
    machine: AllReduce
    dropped: dict[bytes, str]
    bytes_sent: int
    bytes_received: int
    _pool: ChannelPool | None
    _buffers: BufferPool
    _values: RoundValues
    _kept: KeptChannels[BulkChannel]
    _bulk: BulkConfig
    _upload: UploadMeter
    _out: np.ndarray
    _landed: set[int]
    _landing: set[int]
    _landing_lock: threading.Lock
    _keeps_encoded: bool  # others' lossy slices go to the machine ``Encoded``
    _item_limit: int
    _outboxes: dict[bytes, tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]]]
    _flushing: bool
    _finished: trio.Event

    @property
    def group_id(self) -> bytes:
        return self.group.group_id

    async def _connect_all(self) -> None:
        """Connect to every member before any stream opens (``connect_first``)."""
        await connect_first(self.node, self.me, self._outboxes, self.config.peer_timeout_s)

    # -- senders ---------------------------------------------------------------------------------

    async def _send_loop(self, peer: bytes) -> None:
        outbox = self._outboxes[peer][1]
        stream: Stream | None = None
        channel: BulkChannel | None = None
        clean = False
        try:
            peer_id = PeerID(peer)
            # A member whose dial fails is tried again until the peer timeout from the round's
            # start, the time a member that stops answering gets: it declared for this round,
            # it may have stalled for a moment, or its connections to us just closed.
            stream = await self.node.open_stream(
                peer_id, PROTOCOL, keep_trying_s=self._live.keep_trying_s(trio.current_time())
            )
            rpc = RpcStream(stream)
            direct = stream_kind(stream) == "direct"
            kept = await self._pool.lend_out(peer) if self._pool is not None else None
            hello = Hello(
                self.run_id,
                self.group_id,
                self.layout.digest,
                row_size=self.config.row_size or 0,
                align=self.align,
                leaves=self.config.leaves,
            )
            if kept is not None:
                self._kept.propose(peer, kept)
                hello = replace(hello, channel=kept.channel_id, channel_payloads=kept.payloads_sent)
            await rpc.send(hello)
            async for order in outbox:
                if isinstance(order, Done):
                    await rpc.send(order)
                    continue
                if self._flushing:
                    continue  # everyone has its result: nobody needs this forward any more
                channel = await self._send_item(rpc, direct, channel, order)
            clean = True
        except (P2PError, OSError, BulkTransferFailed, trio.BrokenResourceError) as exc:
            await self._peer_gone(peer, f"sending to it failed: {exc!r}")
        except Exception as exc:  # libp2p stream errors are not all P2PError
            await self._peer_gone(peer, f"sending to it failed: {exc!r}")
        finally:
            # A kept channel proposed but never needed: unchanged, so it may be kept again.
            channel = self._kept.take_proposal(peer) if channel is None else channel
            if channel is not None:
                self._ended(peer, Direction.OUT, channel, clean)
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception as exc:
                        log.debug("closing the stream to %s: %r", short_id(peer), exc)

    async def _send_item(
        self,
        rpc: RpcStream,
        direct: bool,
        channel: BulkChannel | None,
        order: SendPart | SendReduced,
    ) -> BulkChannel | None:
        """Send one item; big payloads go over the pair's bulk channel, opened at the first."""
        if self._big:
            payload = await trio.to_thread.run_sync(self._values.payload, order)
        else:
            payload = self._values.payload(order)
        inline = len(payload) <= INLINE_MAX_BYTES
        if isinstance(order, SendPart):
            proof = await self._own_proof(order.part_index) if self.config.sign else b""
            item = Item(
                KIND_SLICE, order.part_index, self.machine.weight, (), (), len(payload), b"", proof
            )
        else:
            item = Item(
                KIND_REDUCED,
                order.part_index,
                0.0,
                tuple(p for p, _ in order.contributors),
                tuple(w for _, w in order.contributors),
                len(payload),
                b"",
            )
        if inline:
            item = replace(item, inline=bytes(payload))
        await rpc.send(item)
        if not inline:
            with self._transfer(order.peer):
                if channel is None:
                    channel = await self.sending_channel(order.peer, rpc, direct)
                with self._upload.sending():
                    await channel.send(payload)
                self._upload.sent += len(payload)
        self._live.heard(order.peer, trio.current_time())
        self.bytes_sent += len(payload)
        return channel

    async def sending_channel(self, peer: bytes, rpc: RpcStream, direct: bool) -> BulkChannel:
        """The channel for our payloads to ``peer`` this round: the one we kept, if the peer's
        ``Resumed`` says it kept its end too, else a new one negotiated on ``rpc``; paced at its
        share of our link when that is configured."""
        kept = self._kept.take_proposal(peer)
        channel = None
        if kept is not None:
            try:
                with trio.fail_after(self._bulk.control_timeout_s):
                    answer = await rpc.receive(Resumed)
            except BaseException:
                self._retire(peer, Direction.OUT, kept)
                raise
            if answer.ok:
                channel = kept
                if self._pool is not None:
                    self._pool.reused()
            else:
                log.debug("%s did not keep our channel; opening a new one", short_id(peer))
                self._retire(peer, Direction.OUT, kept)
        if channel is None:
            channel = await open_channel(
                rpc.stream, direct=direct, listener=self.node.bulk_listener, config=self._bulk
            )
            if self._pool is not None:
                self._pool.opened(peer, Direction.OUT, channel)
        if self.config.pace_bps and len(self.peers) > 1:
            share = self.config.pace_bps * PACING_SHARE / (len(self.peers) - 1)
            channel.limit_rate(share / 8)
        return channel

    # -- receivers -------------------------------------------------------------------------------

    async def _resume_incoming(
        self, peer: bytes, rpc: RpcStream, hello: Hello
    ) -> BulkChannel | None:
        """Answer a Hello that names a kept channel: lend our end if we kept it with as many
        payloads as the sender sent. A Hello naming none makes our kept ends from it stale."""
        if not hello.channel:
            if self._pool is not None:
                self._pool.drop_in(peer)
            return None
        kept = None
        if self._pool is not None:
            kept = await self._pool.lend_in(peer, hello.channel, hello.channel_payloads)
        try:
            with trio.fail_after(self._bulk.control_timeout_s):
                await rpc.send(Resumed(kept is not None))
        except BaseException:
            if kept is not None:
                self._retire(peer, Direction.IN, kept)
            raise
        return kept

    async def _receive_loop(
        self, peer: bytes, rpc: RpcStream, resumed: BulkChannel | None = None
    ) -> None:
        direct = stream_kind(rpc.stream) == "direct"
        limit = self._item_limit
        # the pair's bulk channel: kept from an earlier round, else accepted at the first payload
        channel: list[BulkChannel] = [resumed] if resumed is not None else []
        ended = False  # the stream ended between messages after Done: every payload was read
        try:
            for _ in range(limit):
                msg = await rpc.receive_or_end(Item, Done)
                if msg is None:
                    ended = receiver_clean(True, peer in self._live.done)
                    raise StreamEnded("the stream ended")
                self._live.heard(peer, trio.current_time())
                if isinstance(msg, Done):
                    self._live.said_done(peer)
                    await self._post(Wake())
                    continue
                event = await self._receive_item(peer, rpc, direct, channel, msg)
                await self._post(event)
        finally:
            for opened in channel:
                self._ended(peer, Direction.IN, opened, ended)
        raise RemoteProtocolError(f"more than {limit} items in one round")

    async def _receive_item(
        self, peer: bytes, rpc: RpcStream, direct: bool, channel: list[BulkChannel], item: Item
    ) -> PartReceived | ReducedPartReceived:
        start, stop, expected = check_item(item, self.parts, self.layout)
        raw: np.ndarray | None = None  # the values themselves, received in place
        if item.inline or expected <= INLINE_MAX_BYTES:
            data: bytes | bytearray | memoryview = item.inline
        else:
            landing = False
            if _RAW_IS_NATIVE and self.layout.lossless_between(start, stop):
                landing = item.kind == KIND_REDUCED and self._lands(item.part_index)
                raw = self._out[start:stop] if landing else self._buffers.take(stop - start)
            data = bytearray(expected) if raw is None else memoryview(raw).cast("B")
            try:
                with self._transfer(peer):
                    if not channel:
                        channel.append(
                            await accept_channel(
                                rpc.stream,
                                direct=direct,
                                listener=self.node.bulk_listener,
                                config=self._bulk,
                            )
                        )
                        if self._pool is not None:
                            self._pool.opened(peer, Direction.IN, channel[0])
                    await channel[0].receive(data)
            finally:
                if landing:
                    self._landing.discard(item.part_index)
            self._live.heard(peer, trio.current_time())
        self.bytes_received += len(data)
        contributors = tuple(zip(item.contributors, item.weights, strict=True))
        decode: Any = self.layout.decode
        arguments: tuple[Any, ...] = (data, start, stop)
        if item.kind == KIND_REDUCED and self.layout.gathers:
            decode, arguments = self.layout.decode_reduced, (*arguments, contributors)
        landing = False
        if raw is None and item.kind == KIND_REDUCED and not self.layout.gathers:
            # An encoded reduced part (int8) is decoded into its place in the result, as a raw
            # one is received there (same rules), so the result is not a second copy of it.
            landing = self._lands(item.part_index)
            if landing:
                decode, arguments = self._decode_into, (*arguments, self._out[start:stop])
        try:
            if raw is not None:
                values = raw  # the machine checks every part it is handed for NaN and inf
            elif self._big:
                values = await trio.to_thread.run_sync(decode, *arguments)
            else:
                values = decode(*arguments)
        finally:
            if landing:
                self._landing.discard(item.part_index)
        if item.kind == KIND_SLICE:
            if self.config.sign is not None:
                await self._values.check_proof(peer, item, values)
            if self.layout.gathers:  # kept for the reduced part it goes into
                self._values.remember_slice(item.part_index, peer, bytes(data))
            if self._keeps_encoded and raw is None:
                # Decoded above only to check it; the machine decodes it again when it reduces
                # the part, and holds the wire bytes until then (``Encoded``).
                return PartReceived(peer, item.part_index, Encoded(bytes(data)), item.weight)
            return PartReceived(peer, item.part_index, values, item.weight)
        if not self.layout.lossless():
            self._values.remember(values, bytes(data))
        return ReducedPartReceived(peer, item.part_index, values, contributors)

    def _lands(self, part: int) -> bool:
        """Whether a reduced copy of ``part`` now being received goes into its place in the
        result (``claim_place``; it is then marked landing until written)."""
        return claim_place(
            part, self._landed, self._landing_lock, self._finished, landing=self._landing
        )

    def _decode_into(
        self, data: bytes | bytearray | memoryview, start: int, stop: int, place: np.ndarray
    ) -> np.ndarray:
        """``layout.decode`` of a reduced part, written into ``place`` (its place in the
        result), which it returns: the decoded copy lives only for this call."""
        place[:] = self.layout.decode(data, start, stop)
        return place

    @contextmanager
    def _transfer(self, peer: bytes) -> Iterator[None]:
        self._live.transfer_started(peer)
        try:
            yield
        finally:
            self._live.transfer_ended(peer)

    def _standing(self) -> Standing:
        return Standing(
            succeeded=self._result is not None and self._error is None,
            closed=self._closed,
            good=self.alive - self._live.lost - self.dropped.keys(),
            pooled=self._pool is not None,
        )

    def _ended(self, peer: bytes, direction: Direction, channel: BulkChannel, clean: bool) -> None:
        """The traffic on ``channel`` ended: keep, hold or close it as ``channels`` says."""
        verdict = self._kept.ended(peer, direction, channel, clean, self._standing())
        self._settle(verdict, peer, direction, channel)

    def _settle(
        self, verdict: Verdict, peer: bytes, direction: Direction, channel: BulkChannel
    ) -> None:
        if verdict is Verdict.GIVE_BACK and self._pool is not None:
            self._pool.give_back(peer, direction, channel)
        elif verdict is not Verdict.HOLD:
            self._retire(peer, direction, channel)

    def _retire(self, peer: bytes, direction: Direction, channel: BulkChannel) -> None:
        if self._pool is not None:
            self._pool.retire(peer, direction, channel)
        else:
            channel.close()

    async def _own_proof(self, part: int) -> bytes:
        _, start, stop = self.parts[part]
        values = self.machine.local[start:stop]
        return await self._values.own_proof(part, values, self.machine.weight)


def short_id(peer: bytes) -> str:
    return str(PeerID(peer))[-8:]


def claim_place(
    part: int,
    landed: set[int],
    lock: threading.Lock,
    finished: trio.Event,
    *,
    landing: set[int] | None = None,
) -> bool:
    """Whether a copy of ``part`` now goes into its place in the round's result, claiming it
    (``landed``, and ``landing`` until written when given): the first copy of each part only,
    and never once the round finished: the result handed out is that vector itself, and a late
    copy (reduced before its sender learned of an exclusion) must not change it. Under ``lock``:
    receivers on the event loop and our own reductions in a worker thread both claim."""
    with lock:
        if part in landed or finished.is_set():
            return False
        landed.add(part)
        if landing is not None:
            landing.add(part)
    return True
