"""Trio driver of one all-reduce round: carries ``swarm.averaging.allreduce``'s orders over p2p
streams.

Wire, per ordered pair of group members (sender -> receiver), one libp2p stream on ``PROTOCOL``:

    Hello(run_id, group_id, layout digest, kept channel id, its payloads sent)
                                 <- Resumed(ok)   only when the Hello named a kept channel
    ( Item(kind, part, weight, contributors, nbytes, inline, proof)  [payload, bulk plane] )*
    Done()                       -- the sender finished; it may still forward parts after this
    (end of stream)              -- the sender will send nothing more this round

An item's payload rides inline when small, else on the pair's ``p2p.BulkChannel``: the one the
pair kept from an earlier round (``swarm.averaging.channel_pool``), else one negotiated on the
stream at the first big payload (a TCP data connection when the libp2p connection is direct, the
stream itself when relayed). It carries every later payload: no handshake, dial or slow start per
payload, and the next payload follows without waiting for a confirmation. One stream per pair keeps
each pair's messages in order, which the machine's forwarding rule relies on (a forwarded reduced
part arrives before the forwarder's own slice).

Keeping channels across rounds. A channel's payloads are keyed by their index, so both ends must
have counted the same payloads before a kept channel carries the next one: a payload cut off
halfway, or sent but never read, would otherwise be read as the next round's. So the sender's
Hello names the channel it kept and how many payloads it sent on it; the receiver answers
``Resumed(True)`` only if it kept that channel with as many payloads received, else
``Resumed(False)`` (and the sender opens a new one). The sender reads the answer before its
first big payload: one round trip, where opening a channel costs three and a new connection's
slow start. A channel is kept only when its round succeeded here, the peer was neither lost nor
dropped, and the pair's traffic ended clean: on the sender, every payload went out whole and its
send loop ended normally; on the receiver, the stream ended between messages after the peer's
``Done`` (so every item announced was read with its payload). A session waits up to ``FLUSH_S``
for those ends before it closes; every other channel it used is closed.

The machine is fed from one task (``Session.run``) and runs in a worker thread when the vector is
large, so reducing never stalls heartbeats. Receivers and senders are separate tasks per peer;
they report what happened as events into one inbox. A peer is lost when its stream breaks before
its ``Done``, when a transfer with it makes no progress for ``peer_timeout_s`` (at least 5 s),
when it cannot be reached (found and dialed) within ``peer_timeout_s`` of the round's start
(silent dials are tried again until then, refused ones are final), or when it leaves a ping
unanswered for ``peer_timeout_s`` while nothing is in flight with it (a frozen process keeps its
sockets open); bytes that break the protocol (a wrong length, NaN, an unknown part) drop it with
the reason. After ``Finish`` the session keeps serving forwards until every live peer said
``Done`` or the deadline passes; the caller already has its result.

Longer than our usual 400 lines: the send and receive loops, the channel keeping and the fault
handling all act on one session's state (its machine, outboxes, landings and channels), and
split apart they would pass most of that state back and forth; the wire messages and the pure
helpers (``chunks_for``, ``settle_landings``) are the candidates to move out first.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import trio

from p2p import (
    BulkChannel,
    BulkConfig,
    BulkTransferFailed,
    Message,
    Node,
    P2PError,
    PeerID,
    RemoteProtocolError,
    RpcStream,
    Stream,
    StreamEnded,
    accept_channel,
    message,
    open_channel,
    stream_kind,
    verify_peer_signature,
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
    is_view_at,
    partition,
)
from swarm.averaging.audit import MAX_PROOF_BYTES, proof_message, slice_hash
from swarm.averaging.bandwidth import share_weights
from swarm.averaging.buffers import BufferPool
from swarm.averaging.channel_pool import ChannelPool, Direction
from swarm.averaging.matchmaking import Group
from swarm.averaging.payload import Layout

log = logging.getLogger(__name__)

PROTOCOL = "/swarmtrain/allreduce/2"  # 2: kept data channels (Hello, Resumed)
KIND_SLICE, KIND_REDUCED = 0, 1
INLINE_MAX_BYTES = 256 * 1024
# Paced channels together take this share of our link: just under it, so the flows meeting at a
# receiver stay below its rate and its queue drains between bursts.
PACING_SHARE = 0.97
# Below this many elements the machine runs on the event loop: a thread hop costs more.
THREAD_MIN_NUMEL = 1 << 16
# Each peer's share is cut into chunks, so that a reducer reduces and sends chunk k while chunk
# k + 1 arrives: about CHUNK_SECONDS of the slowest member's declared link, between MIN and MAX
# bytes. On a 100 Mbit/s, 25 ms link (bench.allreduce_netlab) 8 MiB chunks reached 0.81-0.84 of
# the bandwidth limit where one 25 MB chunk per peer reached 0.75; on loopback, where the CPU is
# the limit, every extra chunk is overhead (32 MiB: 1.35 s, 8 MiB: 2.5 s for N=4, 25M floats).
CHUNK_SECONDS = 0.5
MIN_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 32 << 20
MAX_CHUNKS = 16
CONNECT_WAIT_S = 1.0
FLUSH_S = 2.0
# Raw float32 payloads are little-endian: received bytes are the values where that is native.
_RAW_IS_NATIVE = np.dtype("<f4") == np.dtype(np.float32)


def chunks_for(numel: int, group_size: int, slowest_bps: float) -> int:
    """Chunks per peer: a function of the round's shape and the members' declarations only, so
    every member computes the same."""
    chunk = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, slowest_bps / 8 * CHUNK_SECONDS))
    return max(1, min(MAX_CHUNKS, math.ceil(4 * numel / group_size / chunk)))


def settle_landings(
    result: np.ndarray,
    parts: Sequence[tuple[bytes, int, int]],
    held: Sequence[tuple[np.ndarray, frozenset[bytes]] | None],
    landed: Collection[int],
    landing: Collection[int],
) -> np.ndarray:
    """``result`` (the machine's assembled vector) with every part received in place put right.

    A copy of part p received into its place (``landed``) that the machine did not keep (it
    reduced p, or took a later copy) may have been written while the machine, in a worker
    thread, assembled ``result``: the held bytes go there again. If such a receive is still
    going on (``landing``), it goes on writing into ``result``: then this returns a copy.
    """
    settled = result.copy() if landing else result
    for p in landed:
        entry = held[p]
        assert entry is not None  # Finish means every part is held
        _, start, stop = parts[p]
        if not is_view_at(entry[0], settled, start):
            settled[start:stop] = entry[0]
    return settled


@message(100, max_bytes=1024)
class Hello(Message):
    run_id: str
    group_id: bytes
    layout: bytes
    # The data channel to the receiver the sender kept from an earlier round (b"": none), and
    # how many payloads it sent on it: the receiver uses it only if it counted as many.
    channel: bytes = b""
    channel_payloads: int = 0

    def __post_init__(self) -> None:
        if len(self.channel) > 64 or self.channel_payloads < 0:
            raise ValueError("bad kept-channel fields")


@message(101, max_bytes=INLINE_MAX_BYTES + 64 * 1024)
class Item(Message):
    kind: int
    part_index: int
    weight: float
    contributors: tuple[bytes, ...]
    weights: tuple[float, ...]
    nbytes: int
    inline: bytes
    # A slice's sender signs (run, round, group, part, weight, SHA-256 of the slice) when the
    # round is audited (``SessionConfig.sign``): its reducer can then prove what it summed.
    proof: bytes = b""


@message(102, max_bytes=128)
class Done(Message):
    """The sender holds its result (no digest: hashing 100 MB costs a third of a second)."""


@message(103, max_bytes=64)
class Resumed(Message):
    """The receiver's answer to a Hello naming a kept channel: True, it carries this round's
    payloads; False, the sender opens a new one (and closes the one it kept)."""

    ok: bool


class AveragingFailed(Exception):
    """A round ended without a result for this peer; the message says why."""


@dataclass(frozen=True)
class SessionConfig:
    timeout_s: float = 60.0
    peer_timeout_s: float = 10.0
    heartbeat_s: float = 0.5
    bulk: BulkConfig = field(default_factory=BulkConfig)
    # Tests of the aggregation audit (``AveragingFaults``): every part we reduce goes through it.
    tamper_reduced: Callable[[int, np.ndarray], np.ndarray] | None = None
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
        self._local = local  # what we encode our slices from (their decoding is machine.local)
        # Encoded bytes of reduced parts, by the held array: a forward must carry exactly the
        # bytes the reducer sent, and re-encoding a decoded int8 part may not reproduce them.
        self._encoded: dict[int, tuple[np.ndarray, bytes]] = {}
        slowest = min(m.bandwidth_bps for m in group.members)
        self.chunks = chunks_for(len(local), len(self.peers), slowest)
        # The result vector. Reduced parts that travel raw are received straight into their
        # place in it (the first copy of each part only: a later one may replace a part the
        # machine holds, and one arriving while we reduce the part ourselves must not race our
        # write), so the result is assembled without copying 2(N-1)/N of the vector again.
        self._out = self._buffers.take(len(local))
        self._landed: set[int] = set()
        self._landing: set[int] = set()
        # An audited round's evidence, (part, sender) -> the slice's signature and SHA-256: made
        # for our slices as we send them, checked for the others' as they arrive.
        self.proofs: dict[tuple[int, bytes], bytes] = {}
        self.digests: dict[tuple[int, bytes], bytes] = {}
        self.machine = AllReduce(
            self.me,
            self.peers,
            bandwidths,
            self._wire_values(local, bandwidths),
            weight,
            deadline=math.inf,
            finalize=self._finalizer(layout, config.tamper_reduced),
            chunks=self.chunks,
            out=self._out,
            allocate=self._buffers.take,
        )
        self.parts = self.machine.parts
        self.alive: frozenset[bytes] = frozenset(self.peers)
        self.dropped: dict[bytes, str] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        # Upload rate: bulk bytes over the time at least one bulk send was running.
        self._bulk_sent = 0
        self._uploads = 0
        self._upload_since = 0.0
        self._upload_busy = 0.0
        self._reach_until = math.inf  # members are dialed again until then (run() sets it)
        self._inbox_send, self._inbox = trio.open_memory_channel[Any](math.inf)
        self._outboxes = {
            peer: trio.open_memory_channel[Any](math.inf) for peer in self.peers if peer != self.me
        }
        self._done_from: set[bytes] = set()
        self._flushing = False
        self._last_heard: dict[bytes, float] = {}
        # Transfers in flight per peer: their own progress deadline watches those peers, and a
        # ping that has to queue behind them under load would only misjudge a busy peer as gone.
        self._in_flight: dict[bytes, int] = {}
        self._bulk = replace(
            config.bulk,
            idle_timeout_s=min(config.bulk.idle_timeout_s, max(5.0, config.peer_timeout_s)),
        )
        self._reported_lost: set[bytes] = set()
        self._handler_scopes: set[trio.CancelScope] = set()
        # Kept channels: ours proposed in a Hello, the answer not read yet; peers' lent to us
        # when we answered yes; channels whose traffic ended clean, given back at the end if the
        # round succeeded with that peer. Peers whose incoming stream is still being read.
        self._proposed: dict[bytes, BulkChannel] = {}
        self._clean: dict[tuple[bytes, Direction], BulkChannel] = {}
        self._receiving: set[bytes] = set()
        self._opened_to_us: set[bytes] = set()  # members whose stream reached us this round
        self._streams_due = math.inf  # ... by then (run() sets it)
        self._receivers_changed = trio.Event()
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
        if self._upload_busy < 0.02 or self._bulk_sent < (1 << 20):
            return None
        return 8 * self._bulk_sent / self._upload_busy

    @property
    def lost(self) -> frozenset[bytes]:
        """Peers this session saw go (a broken stream, no answer to pings)."""
        return frozenset(self._reported_lost)

    async def result(self) -> RoundResult:
        """Wait for this peer's outcome; raises ``AveragingFailed``."""
        await self._finished.wait()
        if self._result is None:
            raise AveragingFailed(self._error or "the round ended without a result")
        return self._result

    def cancel(self) -> None:
        """Leave the round now (the caller was cancelled); peers see our streams close."""
        self._scope.cancel()

    async def run(self) -> None:
        """Drive the round until everyone is done, it fails, or the deadline passes."""
        deadline = trio.current_time() + self.config.timeout_s
        try:
            with self._scope:
                self._scope.deadline = deadline + self.config.peer_timeout_s
                self._reach_until = trio.current_time() + self.config.peer_timeout_s
                # A member still in the round opens its stream to us once its connect pass is
                # over (at most the peer timeout + CONNECT_WAIT_S), within one more peer timeout.
                self._streams_due = self._reach_until + CONNECT_WAIT_S + self.config.peer_timeout_s
                await self._connect_all()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_liveness)
                    async with trio.open_nursery() as senders:
                        for peer in self._outboxes:
                            senders.start_soon(self._send_loop, peer)
                        await self._drive(deadline)
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
            self._opened_to_us.add(peer)
            try:
                if self._closed:
                    return
                resumed = await self._resume_incoming(peer, rpc, hello)
                await self._receive_loop(peer, rpc, resumed)
            except StreamEnded as exc:
                self._peer_gone(peer, f"its stream ended: {exc}")
            except RemoteProtocolError as exc:
                log.warning("dropping %s from round %s: %s", _short(peer), self.group.round, exc)
                self._inbox_send.send_nowait(PeerMisbehaved(peer, str(exc)))
            except (P2PError, OSError, BulkTransferFailed, trio.BrokenResourceError) as exc:
                self._peer_gone(peer, f"stream from it broke: {exc!r}")
            except Exception as exc:  # libp2p's own stream errors (StreamEOF, reset) vary
                self._peer_gone(peer, f"stream from it ended: {exc!r}")
            finally:
                self._handler_scopes.discard(scope)
                self._receiving.discard(peer)
                self._receivers_changed.set()

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
        if self._result is None or self._pool is None:
            return
        with trio.move_on_after(FLUSH_S):
            while self._receiving & (self.alive - self._reported_lost - set(self.dropped)):
                self._receivers_changed = trio.Event()
                await self._receivers_changed.wait()

    def _keep(self, peer: bytes, direction: Direction, channel: BulkChannel) -> None:
        """``channel``'s traffic with ``peer`` this round ended clean: give it back now if the
        round already succeeded here with that peer, else decide when the session ends."""
        if self._closed or self._pool is None or (peer, direction) in self._clean:
            self._retire(peer, direction, channel)
        elif self._keeps(peer):
            self._pool.give_back(peer, direction, channel)
        else:
            self._clean[(peer, direction)] = channel

    def _keeps(self, peer: bytes) -> bool:
        """A channel with ``peer`` that ended clean may be kept: the round succeeded here and
        the peer was neither lost nor dropped."""
        return (
            self._result is not None
            and self._error is None
            and peer in self.alive
            and peer not in self._reported_lost
            and peer not in self.dropped
        )

    def _retire(self, peer: bytes, direction: Direction, channel: BulkChannel) -> None:
        if self._pool is not None:
            self._pool.retire(peer, direction, channel)
        else:
            channel.close()

    def _release_channels(self) -> None:
        """The session ends: give back the channels that ended clean, if the round succeeded
        with their peer; retire every other; forget the kept channels of peers it lost."""
        for (peer, direction), channel in self._clean.items():
            if self._pool is not None and self._keeps(peer):
                self._pool.give_back(peer, direction, channel)
            else:
                self._retire(peer, direction, channel)
        self._clean.clear()
        if self._pool is not None:
            for peer in self._reported_lost | set(self.dropped):
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

    # -- the machine -----------------------------------------------------------------------------

    async def _drive(self, deadline: float) -> None:
        await self._apply(await self._call(self.machine.start))
        while not self._closed:
            with trio.move_on_at(deadline) as wait:
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
            if self._result is not None and self.alive - {self.me} <= self._done_from:
                return  # everyone still alive has its result: nobody can need a forward

    async def _call(self, method: Any, *event: Any) -> list[Any]:
        if self._big:
            actions = await trio.to_thread.run_sync(method, *event, time.monotonic())
        else:
            actions = method(*event, time.monotonic())
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
                if len(self.peers) > 1 and [p for p, _ in action.contributors] == [self.me]:
                    # Our own vector back is no average: every other peer was lost or refused
                    # us (we were frozen, or cut off), so this round has nothing to give.
                    self._error = "every other peer of the round was lost"
                    self._finished.set()
                    continue
                self._result = RoundResult(
                    self._settle_landings(action.result),
                    action.contributors,
                    dict(self.dropped),
                    time.perf_counter() - self._started_at,
                )
                for peer in self.alive - {self.me}:
                    self._outboxes[peer][0].send_nowait(Done())
                self._finished.set()
            elif isinstance(action, Fail):
                self._error = action.reason
                self._finished.set()

    def _settle_landings(self, result: np.ndarray) -> np.ndarray:
        # Called as the round finishes, with no await before ``_finished`` is set, after which
        # no copy lands any more.
        return settle_landings(result, self.parts, self.machine.held, self._landed, self._landing)

    # -- values on the wire ----------------------------------------------------------------------

    def _wire_values(self, local: np.ndarray, bandwidths: list[int]) -> np.ndarray:
        """Our vector as peers will decode it: every slice we send goes through the codec, and
        the reducer of a part must use the same values for its own slice as everyone else."""
        if self.layout.lossless():
            return local
        out = np.empty_like(local)
        for _, start, stop in partition(len(local), self.peers, bandwidths, self.chunks):
            out[start:stop] = self.layout.round_trip(local[start:stop], start)
        return out

    async def _own_proof(self, part: int) -> bytes:
        """Our signature over our slice of ``part`` (as the wire carries it), made once."""
        proof = self.proofs.get((part, self.me))
        if proof is None:
            _, start, stop = self.parts[part]
            values = self.machine.local[start:stop]
            digest = self.digests[(part, self.me)] = await self._hash(values)
            assert self.config.sign is not None
            message = self._proof_message(part, self.machine.weight, digest)
            proof = self.proofs[(part, self.me)] = self.config.sign(message)
        return proof

    async def _check_proof(self, peer: bytes, item: Item, values: np.ndarray) -> None:
        """Refuse a slice its sender did not sign as it is: its reducer could not prove it."""
        if len(item.proof) > MAX_PROOF_BYTES:
            raise RemoteProtocolError("slice proof over its size limit")
        digest = await self._hash(values)
        message = self._proof_message(item.part_index, item.weight, digest)
        if not verify_peer_signature(peer, message, item.proof):
            raise RemoteProtocolError(f"slice of part {item.part_index}: its proof does not verify")
        self.proofs[(item.part_index, peer)] = item.proof
        self.digests[(item.part_index, peer)] = digest

    def _proof_message(self, part: int, weight: float, digest: bytes) -> bytes:
        return proof_message(self.run_id, self.group.round, self.group_id, part, weight, digest)

    async def _hash(self, values: np.ndarray) -> bytes:
        if len(values) >= THREAD_MIN_NUMEL:
            return await trio.to_thread.run_sync(slice_hash, values)
        return slice_hash(values)

    async def audit_evidence(
        self,
    ) -> tuple[dict[tuple[int, bytes], bytes], dict[tuple[int, bytes], bytes]]:
        """Every slice's signature and hash of the round, ours for every part included (made
        now for the parts we did not send: those we reduced); what
        ``swarm.averaging.audit.audits_of`` puts in our claims, each slice hashed once."""
        for part in range(len(self.parts)):
            await self._own_proof(part)
        return dict(self.proofs), dict(self.digests)

    def _finalizer(
        self, layout: Layout, tamper: Callable[[int, np.ndarray], np.ndarray] | None
    ) -> Callable[[int, np.ndarray], np.ndarray] | None:
        if tamper is not None:
            if layout.lossless():
                return tamper
            return lambda p, x: self._finalize(p, tamper(p, x))
        return None if layout.lossless() else self._finalize

    def _finalize(self, part_index: int, reduced: np.ndarray) -> np.ndarray:
        start = self.parts[part_index][1]
        data = self.layout.encode(reduced, start)
        values = self.layout.decode(data, start, start + len(reduced))
        self._encoded[id(values)] = (values, data)
        return values

    def _payload(self, order: SendPart | SendReduced) -> bytes:
        if isinstance(order, SendPart):
            return self.layout.encode(self._local[order.start : order.stop], order.start)
        cached = self._encoded.get(id(order.data))
        if cached is not None and cached[0] is order.data:
            return cached[1]
        return self.layout.encode(order.data, self.parts[order.part_index][1])

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
                peer_id, PROTOCOL, keep_trying_s=self._keep_trying_s()
            )
            rpc = RpcStream(stream)
            direct = stream_kind(stream) == "direct"
            kept = await self._pool.lend_out(peer) if self._pool is not None else None
            hello = Hello(self.run_id, self.group_id, self.layout.digest)
            if kept is not None:
                self._proposed[peer] = kept
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
            self._peer_gone(peer, f"sending to it failed: {exc!r}")
        except Exception as exc:  # libp2p stream errors are not all P2PError
            self._peer_gone(peer, f"sending to it failed: {exc!r}")
        finally:
            # A kept channel proposed but never needed: unchanged, so it may be kept again.
            channel = channel or self._proposed.pop(peer, None)
            self._proposed.pop(peer, None)
            if channel is not None:
                if clean:
                    self._keep(peer, Direction.OUT, channel)
                else:
                    self._retire(peer, Direction.OUT, channel)
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
            payload = await trio.to_thread.run_sync(self._payload, order)
        else:
            payload = self._payload(order)
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
                with self._uploading():
                    await channel.send(payload)
                self._bulk_sent += len(payload)
        self._last_heard[order.peer] = trio.current_time()
        self.bytes_sent += len(payload)
        return channel

    async def sending_channel(self, peer: bytes, rpc: RpcStream, direct: bool) -> BulkChannel:
        """The channel for our payloads to ``peer`` this round: the one we kept, if the peer's
        ``Resumed`` says it kept its end too, else a new one negotiated on ``rpc``; paced at its
        share of our link when that is configured."""
        kept = self._proposed.pop(peer, None)
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
        # Honest peers send each part's slice once, reduced parts a few times when reducers are
        # lost; anything beyond this bound is a flood.
        limit = 4 * len(self.parts) + 4
        # the pair's bulk channel: kept from an earlier round, else accepted at the first payload
        channel: list[BulkChannel] = [resumed] if resumed is not None else []
        ended = False  # the stream ended between messages after Done: every payload was read
        try:
            for _ in range(limit):
                msg = await rpc.receive_or_end(Item, Done)
                if msg is None:
                    ended = peer in self._done_from
                    raise StreamEnded("the stream ended")
                self._last_heard[peer] = trio.current_time()
                if isinstance(msg, Done):
                    self._done_from.add(peer)
                    self._inbox_send.send_nowait(_Wake())
                    continue
                event = await self._receive_item(peer, rpc, direct, channel, msg)
                self._inbox_send.send_nowait(event)
        finally:
            for opened in channel:
                if ended:
                    self._keep(peer, Direction.IN, opened)
                else:
                    self._retire(peer, Direction.IN, opened)
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
            self._last_heard[peer] = trio.current_time()
        self.bytes_received += len(data)
        if raw is not None:
            values = raw  # the machine checks every part it is handed for NaN and inf
        elif self._big:
            values = await trio.to_thread.run_sync(self.layout.decode, data, start, stop)
        else:
            values = self.layout.decode(data, start, stop)
        if item.kind == KIND_SLICE:
            if self.config.sign is not None:
                await self._check_proof(peer, item, values)
            return PartReceived(peer, item.part_index, values, item.weight)
        if not self.layout.lossless():
            self._encoded[id(values)] = (values, bytes(data))
        contributors = tuple(zip(item.contributors, item.weights, strict=True))
        return ReducedPartReceived(peer, item.part_index, values, contributors)

    # -- liveness --------------------------------------------------------------------------------

    def _peer_gone(self, peer: bytes, why: str) -> None:
        if self._closed or peer in self._reported_lost or peer not in self.alive:
            return
        if peer in self._done_from and self._result is not None:
            return  # it finished and closed its side; nothing more is due from it
        self._reported_lost.add(peer)
        log.info("round %s: lost %s: %s", self.group.round, _short(peer), why)
        self._inbox_send.send_nowait(PeerLost(peer))

    @contextmanager
    def _uploading(self) -> Iterator[None]:
        if not self._uploads:
            self._upload_since = time.perf_counter()
        self._uploads += 1
        try:
            yield
        finally:
            self._uploads -= 1
            if not self._uploads:
                self._upload_busy += time.perf_counter() - self._upload_since

    @contextmanager
    def _transfer(self, peer: bytes) -> Iterator[None]:
        self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
        try:
            yield
        finally:
            self._in_flight[peer] -= 1

    async def _watch_liveness(self) -> None:
        """Ping every live peer that still owes us something and has been quiet for a while; a
        frozen one stops answering. A member that answers pings but never opened its stream to
        us (it left the round before its senders started, or never meant to take part) is lost
        once its stream is overdue: otherwise the parts waiting for its slices would hold
        everyone until the deadline."""
        while True:
            await trio.sleep(self.config.heartbeat_s)
            if trio.current_time() >= self._streams_due:
                waited = self._streams_due - (self._reach_until - self.config.peer_timeout_s)
                for peer in sorted(self.alive - {self.me} - self._opened_to_us):
                    self._peer_gone(peer, f"opened no stream to us within {waited:.0f} s")
            quiet_since = trio.current_time() - self.config.heartbeat_s
            targets = sorted(
                peer
                for peer in self.alive - {self.me} - self._done_from - self._reported_lost
                if self._last_heard.get(peer, -math.inf) < quiet_since
                and not self._in_flight.get(peer)
            )
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
            keep_trying_s=self._keep_trying_s(),
        )
        if not result.ok:
            self._peer_gone(peer, f"no answer to a ping: {result.error}")

    def _keep_trying_s(self) -> float:
        return max(0.0, self._reach_until - trio.current_time())


def _short(peer: bytes) -> str:
    return str(PeerID(peer))[-8:]
