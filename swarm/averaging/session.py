"""Trio driver of one all-reduce round: carries ``swarm.averaging.allreduce``'s orders over p2p
streams and keeps time; it decides nothing itself.

What it holds: one ``Session`` per round and group, its tasks and the state they share (the
machine, one inbox, an outbox per peer, the result buffer, the channels in use). The rules live
in sans-IO modules: the round's in ``allreduce`` (reducers, exclusions, finish, failure, the
deadline), when a peer is lost in ``liveness``, which data channels are kept in ``channels``,
the wire messages and the bytes of values in ``session_wire``.

Tasks. ``run`` feeds the machine from the inbox (in a worker thread when the vector is large, so
reducing never stalls heartbeats) and puts its orders in the outboxes; one sender task per peer
drains its outbox onto its stream; one receiver per incoming stream (``serve_incoming``, called
by the Averager's handler) turns items into events; a watcher pings quiet peers. Whatever breaks a
stream or a transfer reports the peer lost; bytes that break the protocol (a wrong length, NaN,
an unknown part) report it misbehaving, with the reason. After ``Finish`` the session keeps
serving forwards until every live peer said ``Done`` or the deadline passes (the caller already
has its result), then waits up to ``FLUSH_S`` for the ends that let it keep channels.

Queues are bounded by what a round can hold: an outbox by ``AllReduce.max_orders_per_peer``
(+1 for ``Done``), so an order is queued without waiting on a sender that is busy with a payload;
the inbox by every event honest peers can cause (each stream's item limit, plus a loss and a
misbehaviour per peer), so a receiver never waits on the machine, while a flood beyond it waits
(``_post``) instead of growing memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

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
    DropPeer,
    Fail,
    Finish,
    PartReceived,
    PeerLost,
    PeerMisbehaved,
    ReducedPartReceived,
    SendPart,
    SendReduced,
)
from swarm.averaging.bandwidth import share_weights
from swarm.averaging.buffers import BufferPool
from swarm.averaging.channel_pool import ChannelPool
from swarm.averaging.channels import Direction, KeptChannels, Standing, Verdict, receiver_clean
from swarm.averaging.liveness import CONNECT_WAIT_S, Liveness, LivenessConfig
from swarm.averaging.matchmaking import Group
from swarm.averaging.payload import Layout
from swarm.averaging.session_wire import (
    INLINE_MAX_BYTES,
    KIND_REDUCED,
    KIND_SLICE,
    PROTOCOL,
    THREAD_MIN_NUMEL,
    Done,
    Hello,
    Item,
    Resumed,
    RoundValues,
    chunks_for,
    settle_landings,
)
from swarm.errors import AveragingFailed

log = logging.getLogger(__name__)

# Paced channels together take this share of our link: just under it, so the flows meeting at a
# receiver stay below its rate and its queue drains between bursts.
PACING_SHARE = 0.97
FLUSH_S = 2.0
# Raw float32 payloads are little-endian: received bytes are the values where that is native.
_RAW_IS_NATIVE = np.dtype("<f4") == np.dtype(np.float32)


@dataclass(frozen=True)
class SessionConfig:
    timeout_s: float = 60.0
    peer_timeout_s: float = 10.0
    heartbeat_s: float = 0.5
    bulk: BulkConfig = field(default_factory=BulkConfig)
    cheat_reduce: bool = False  # tests of the aggregation audit: our reduced parts are wrong
    # Our upload link's rate, when known (configured, not measured): each pair's channel is then
    # paced at its share, rate x PACING_SHARE / (N - 1), so the N - 1 flows into a receiver fit
    # its link (equal links) instead of overflowing its queue and backing off (TCP incast).
    pace_bps: float | None = None
    # An audited round (``swarm.averaging.audit``): sign our slices with this (our identity's
    # ``RecordSigner.sign_message``) and refuse a slice whose proof does not verify.
    sign: Callable[[bytes], bytes] | None = None


@dataclass(frozen=True)
class RoundResult:
    """What ``Session`` returns: the averaged flat vector and whose contributions it holds."""

    vector: np.ndarray
    contributors: tuple[tuple[bytes, float], ...]
    dropped: dict[bytes, str]
    seconds: float


class _Wake:
    """Inbox marker: something other than a machine event changed (a peer said Done)."""


class _UploadMeter:
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


class Session:
    """One peer's part in one group's all-reduce. ``run`` drives it; ``result`` waits for it."""

    def __init__(
        self,
        node: Node,
        run_id: str,
        group: Group,
        local: np.ndarray,
        weight: float,
        layout: Layout,
        config: SessionConfig,
        *,
        channels: ChannelPool | None = None,
        buffers: BufferPool | None = None,
    ) -> None:
        """``channels``: where data channels kept from earlier rounds are borrowed and given
        back (the Averager's pool); None opens new ones and closes them at the end.
        ``buffers``: where the result vector, received slices and reduced parts are taken from
        (the Averager's, so that rounds reuse memory the kernel has already zeroed)."""
        self.node = node
        self._pool = channels
        self._buffers = buffers if buffers is not None else BufferPool(limit_bytes=0)
        self.run_id = run_id
        self.group = group
        self.layout = layout
        self.config = config
        self.me = node.host.peer_id.to_bytes()
        self.peers = group.peer_ids
        bandwidths = share_weights([m.bandwidth_bps for m in group.members])
        self._big = len(local) >= THREAD_MIN_NUMEL
        self._values = RoundValues(run_id, group, self.me, layout, local, config.sign)
        slowest = min(m.bandwidth_bps for m in group.members)
        self.chunks = chunks_for(len(local), len(self.peers), slowest)
        # The result vector. Reduced parts that travel raw are received straight into their
        # place in it (the first copy of each part only: a later one may replace a part the
        # machine holds, and one arriving while we reduce the part ourselves must not race our
        # write), so the result is assembled without copying 2(N-1)/N of the vector again.
        self._out = self._buffers.take(len(local))
        self._landed: set[int] = set()
        self._landing: set[int] = set()
        wire = self._values.wire_values(self.peers, bandwidths, self.chunks)
        finalize = self._values.finalizer(config.cheat_reduce)
        # The round's clock starts here, on trio's clock: the machine's deadline, the reach
        # window and the streams' due time all count from it.
        self._t0 = trio.current_time()
        self.machine = AllReduce(
            self.me,
            self.peers,
            bandwidths,
            wire,
            weight,
            deadline=self._t0 + config.timeout_s,
            finalize=finalize,
            chunks=self.chunks,
            out=self._out,
            allocate=self._buffers.take,
        )
        self.parts = self._values.parts = self.machine.parts
        self.alive: frozenset[bytes] = frozenset(self.peers)
        self.dropped: dict[bytes, str] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self._upload = _UploadMeter()
        self._live = Liveness(LivenessConfig(config.peer_timeout_s, config.heartbeat_s))
        self._kept: KeptChannels[BulkChannel] = KeptChannels()
        self._bulk = replace(
            config.bulk, idle_timeout_s=self._live.transfer_idle_s(config.bulk.idle_timeout_s)
        )
        # Honest peers send each part's slice once, reduced parts a few times when reducers are
        # lost; anything beyond this bound of items per stream is a flood.
        self._item_limit = 4 * len(self.parts) + 4
        others = [peer for peer in self.peers if peer != self.me]
        inbox_bound = max(1, len(others) * (self._item_limit + 2))
        self._inbox_send, self._inbox = trio.open_memory_channel[Any](inbox_bound)
        outbox_bound = self.machine.max_orders_per_peer + 1
        self._outboxes = {peer: trio.open_memory_channel[Any](outbox_bound) for peer in others}
        self._handler_scopes: set[trio.CancelScope] = set()
        self._receiving: set[bytes] = set()  # peers whose incoming stream is still being read
        self._receivers_changed = trio.Event()
        self._flushing = False
        self._finished = trio.Event()
        self._result: RoundResult | None = None
        self._error: str | None = None
        self._closed = False
        self._scope = trio.CancelScope()
        self._started_at = time.perf_counter()

    # -- public ----------------------------------------------------------------------------------

    @property
    def group_id(self) -> bytes:
        return self.group.group_id

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def upload_bps(self) -> float | None:
        """What our bulk sends achieved (bits/s), None if too few to tell."""
        if self._upload.busy_s < 0.02 or self._upload.sent < (1 << 20):
            return None
        return 8 * self._upload.sent / self._upload.busy_s

    @property
    def lost(self) -> frozenset[bytes]:
        """Peers this session saw go (a broken stream, no answer to pings)."""
        return frozenset(self._live.lost)

    async def result(self) -> RoundResult:
        """Wait for this peer's outcome; raises ``AveragingFailed``."""
        await self._finished.wait()
        if self._result is None:
            raise AveragingFailed(self._error or "the round ended without a result")
        return self._result

    def cancel(self) -> None:
        """Leave the round now (the caller was cancelled); peers see our streams close."""
        self._scope.cancel()

    async def audit_evidence(
        self,
    ) -> tuple[dict[tuple[int, bytes], bytes], dict[tuple[int, bytes], bytes]]:
        """Every slice's signature and hash of the round, ours for every part included (made
        now for the parts we did not send: those we reduced); what
        ``swarm.averaging.audit.audits_of`` puts in our claims, each slice hashed once."""
        for part in range(len(self.parts)):
            await self._own_proof(part)
        return dict(self._values.proofs), dict(self._values.digests)

    async def run(self) -> None:
        """Drive the round until everyone is done, it fails, or the deadline passes."""
        try:
            with self._scope:
                self._scope.deadline = self.machine.deadline + self.config.peer_timeout_s
                self._live.start(self._t0)
                await self._connect_all()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_liveness)
                    async with trio.open_nursery() as senders:
                        for peer in self._outboxes:
                            senders.start_soon(self._send_loop, peer)
                        await self._drive()
                        self._flush(senders.cancel_scope)
                    nursery.cancel_scope.cancel()
                await self._wait_incoming_ends()
        finally:
            self._closed = True
            for scope in list(self._handler_scopes):
                scope.cancel()
            self._release_channels()
            if not self._finished.is_set():
                timed_out = trio.current_time() >= self._scope.deadline
                self._error = self._error or (
                    "the round's deadline passed" if timed_out else "cancelled"
                )
                self._finished.set()

    async def serve_incoming(self, peer: bytes, rpc: RpcStream, hello: Hello) -> None:
        """Answer ``peer``'s ``hello`` (if it names a kept channel), then read its items from its
        stream until it ends or we close."""
        with trio.CancelScope() as scope:
            self._handler_scopes.add(scope)
            self._receiving.add(peer)
            self._live.stream_opened(peer)
            try:
                if self._closed:
                    return
                resumed = await self._resume_incoming(peer, rpc, hello)
                await self._receive_loop(peer, rpc, resumed)
            except StreamEnded as exc:
                await self._peer_gone(peer, f"its stream ended: {exc}")
            except RemoteProtocolError as exc:
                log.warning("dropping %s from round %s: %s", _short(peer), self.group.round, exc)
                await self._post(PeerMisbehaved(peer, str(exc)))
            except (P2PError, OSError, BulkTransferFailed, trio.BrokenResourceError) as exc:
                await self._peer_gone(peer, f"stream from it broke: {exc!r}")
            except Exception as exc:  # libp2p's own stream errors (StreamEOF, reset) vary
                await self._peer_gone(peer, f"stream from it ended: {exc!r}")
            finally:
                self._handler_scopes.discard(scope)
                self._receiving.discard(peer)
                self._receivers_changed.set()

    # -- the machine -----------------------------------------------------------------------------

    async def _drive(self) -> None:
        await self._apply(await self._call(self.machine.start))
        while not self._closed:
            with trio.move_on_at(self.machine.deadline) as wait:
                event = await self._inbox.receive()
            if wait.cancelled_caught:
                await self._apply(await self._call(self.machine.handle, DeadlineReached()))
                return
            if not isinstance(event, _Wake):
                try:
                    actions = await self._call(self.machine.handle, event)
                except RemoteProtocolError as exc:
                    log.warning("ignored an event: %s", exc)
                    continue
                await self._apply(actions)
            if self._error is not None:
                return
            if self._result is not None and self.alive - {self.me} <= self._live.done:
                return  # everyone still alive has its result: nobody can need a forward

    async def _call(self, method: Any, *event: Any) -> list[Any]:
        now = trio.current_time()
        if self._big:
            actions = await trio.to_thread.run_sync(method, *event, now)
        else:
            actions = method(*event, now)
        self.alive = frozenset(self.machine.alive)
        return actions

    async def _apply(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendPart | SendReduced):
                self._outboxes[action.peer][0].send_nowait(action)
            elif isinstance(action, DropPeer):
                self.dropped[action.peer] = action.reason
                log.info(
                    "round %s: %s out (%s)", self.group.round, _short(action.peer), action.reason
                )
            elif isinstance(action, Finish):
                # No await before ``_finished`` is set, after which no copy lands any more.
                vector = settle_landings(
                    action.result, self.parts, self.machine.held, self._landed, self._landing
                )
                seconds = time.perf_counter() - self._started_at
                self._result = RoundResult(vector, action.contributors, dict(self.dropped), seconds)
                for peer in self.alive - {self.me}:
                    self._outboxes[peer][0].send_nowait(Done())
                self._finished.set()
            elif isinstance(action, Fail):
                self._error = action.reason
                self._finished.set()

    async def _post(self, event: Any) -> None:
        """Into the inbox: at once while it has room (always, for honest peers), else wait."""
        try:
            self._inbox_send.send_nowait(event)
        except trio.WouldBlock:
            await self._inbox_send.send(event)

    # -- ends ------------------------------------------------------------------------------------

    def _flush(self, senders: trio.CancelScope) -> None:
        """Take no more orders, but let each sender finish the payload it is on and deliver the
        ``Done`` queued behind it, for at most ``FLUSH_S``: a peer that sees our stream end before
        our ``Done`` counts us lost and leaves us out of its next round."""
        self._flushing = True
        for send, _ in self._outboxes.values():
            send.close()
        senders.deadline = min(senders.deadline, trio.current_time() + FLUSH_S)

    async def _wait_incoming_ends(self) -> None:
        """After a successful round, wait (at most ``FLUSH_S``) for the live peers' streams to
        end: a stream that ends between messages leaves its channel in a known state, to keep."""
        with trio.move_on_after(FLUSH_S):
            while self._standing().awaiting_ends(frozenset(self._receiving)):
                self._receivers_changed = trio.Event()
                await self._receivers_changed.wait()

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

    def _release_channels(self) -> None:
        """The session ends: settle the channels held until now; forget the kept channels of
        peers it lost."""
        for verdict, peer, direction, channel in self._kept.release(self._standing()):
            self._settle(verdict, peer, direction, channel)
        if self._pool is not None:
            for peer in self._live.lost | set(self.dropped):
                self._pool.discard(peer)

    async def _connect_all(self) -> None:
        """Connect to every member before any stream opens, the lower peer id dialing.

        When both ends of a pair dial at once, each side may keep a different one of the two
        connections and close the other (one connection per peer), which resets the streams on
        both: at first contact a group of 8 lost whole rounds that way. So the higher id waits a
        moment for the lower one's dial, then dials itself (the lower one may be behind a NAT).
        """

        async def one(peer: bytes) -> None:
            peer_id = PeerID(peer)
            if self.me > peer:
                with trio.move_on_after(CONNECT_WAIT_S):
                    while self.node.host.connection_kind(peer_id) is None:
                        await trio.sleep(0.02)
            try:
                await self.node.reach(peer_id)
            except P2PError as exc:
                log.debug("connecting to %s: %s", _short(peer), exc)  # its sender tries again

        with trio.move_on_after(self.config.peer_timeout_s + CONNECT_WAIT_S):
            async with trio.open_nursery() as nursery:
                for peer in self._outboxes:
                    nursery.start_soon(one, peer)

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
            hello = Hello(self.run_id, self.group_id, self.layout.digest)
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
                        log.debug("closing the stream to %s: %r", _short(peer), exc)

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
                log.debug("%s did not keep our channel; opening a new one", _short(peer))
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
                    await self._post(_Wake())
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
        if item.kind not in (KIND_SLICE, KIND_REDUCED):
            raise RemoteProtocolError(f"unknown item kind {item.kind}")
        if not 0 <= item.part_index < len(self.parts):
            raise RemoteProtocolError(f"part index {item.part_index} out of range")
        _, start, stop = self.parts[item.part_index]
        expected = self.layout.wire_bytes(start, stop)
        if item.nbytes != expected:
            raise RemoteProtocolError(
                f"part {item.part_index} payload of {item.nbytes} bytes, expected {expected}"
            )
        if len(item.contributors) != len(item.weights):
            raise RemoteProtocolError("contributors and weights differ in length")
        raw: np.ndarray | None = None  # the values themselves, received in place
        if item.inline or expected <= INLINE_MAX_BYTES:
            if len(item.inline) != expected:
                raise RemoteProtocolError(f"inline payload of {len(item.inline)} bytes")
            data: bytes | bytearray | memoryview = item.inline
        else:
            landing = False
            if _RAW_IS_NATIVE and self.layout.lossless_between(start, stop):
                # Never once the round finished: the result handed out is ``_out`` itself, and a
                # late copy (reduced before its sender learned of an exclusion) must not change it.
                landing = (
                    item.kind == KIND_REDUCED
                    and item.part_index not in self._landed
                    and not self._finished.is_set()
                )
                if landing:
                    self._landed.add(item.part_index)
                    self._landing.add(item.part_index)
                    raw = self._out[start:stop]
                else:
                    raw = self._buffers.take(stop - start)
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
        if raw is not None:
            values = raw  # the machine checks every part it is handed for NaN and inf
        elif self._big:
            values = await trio.to_thread.run_sync(self.layout.decode, data, start, stop)
        else:
            values = self.layout.decode(data, start, stop)
        if item.kind == KIND_SLICE:
            if self.config.sign is not None:
                await self._values.check_proof(peer, item, values)
            return PartReceived(peer, item.part_index, values, item.weight)
        if not self.layout.lossless():
            self._values.remember(values, bytes(data))
        contributors = tuple(zip(item.contributors, item.weights, strict=True))
        return ReducedPartReceived(peer, item.part_index, values, contributors)

    # -- liveness --------------------------------------------------------------------------------

    async def _peer_gone(self, peer: bytes, why: str) -> None:
        finished = self._result is not None
        if self._live.report(
            peer, alive=peer in self.alive, closed=self._closed, finished=finished
        ):
            log.info("round %s: lost %s: %s", self.group.round, _short(peer), why)
            await self._post(PeerLost(peer))

    @contextmanager
    def _transfer(self, peer: bytes) -> Iterator[None]:
        self._live.transfer_started(peer)
        try:
            yield
        finally:
            self._live.transfer_ended(peer)

    async def _watch_liveness(self) -> None:
        """Every heartbeat, report the members whose stream to us is overdue and ping the quiet
        ones (``swarm.averaging.liveness`` says which)."""
        while True:
            await trio.sleep(self.config.heartbeat_s)
            for peer, why in self._live.overdue(trio.current_time(), self.alive - {self.me}):
                await self._peer_gone(peer, why)
            targets = self._live.to_ping(trio.current_time(), self.alive - {self.me})
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

    async def _own_proof(self, part: int) -> bytes:
        _, start, stop = self.parts[part]
        values = self.machine.local[start:stop]
        return await self._values.own_proof(part, values, self.machine.weight)


def _short(peer: bytes) -> str:
    return str(PeerID(peer))[-8:]
