"""Trio driver of one all-reduce round: carries ``swarm.averaging.allreduce``'s orders over p2p
streams and keeps time; it decides nothing itself.

What it holds: one ``Session`` per round and group, its lifetime (``run``: connect, drive, flush,
wait for the ends that let channels be kept, release) and the state its tasks share (the machine,
one inbox, an outbox per peer, the result buffer, the channels in use). Its byte-moving half,
each pair's streams, is its base ``session_links.PeerLinks``. The rules live in sans-IO modules:
the round's in ``allreduce`` (reducers, exclusions, finish, failure, the deadline), when a peer is
lost in ``liveness``, which data channels are kept in ``channels``, the wire messages and the
bytes of values in ``session_wire``.

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
import math
import threading
import time
from collections.abc import Callable
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
    RemoteProtocolError,
    RpcStream,
    StreamEnded,
)
from swarm.averaging.allreduce import (
    AllReduce,
    DropPeer,
    Fail,
    Finish,
    PeerMisbehaved,
    SendPart,
    SendReduced,
)
from swarm.averaging.bandwidth import share_weights
from swarm.averaging.buffers import BufferPool
from swarm.averaging.channel_pool import ChannelPool
from swarm.averaging.channels import KeptChannels
from swarm.averaging.commitment import check_contribution, leaf_size
from swarm.averaging.liveness import Liveness, LivenessConfig
from swarm.averaging.matchmaking import Group
from swarm.averaging.payload import Layout
from swarm.averaging.session_links import PeerLinks, UploadMeter, claim_place, short_id
from swarm.averaging.session_wire import (
    THREAD_MIN_NUMEL,
    Done,
    Hello,
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
    # Tests of the aggregation audit (``AveragingFaults``): every part we reduce goes through it.
    tamper_reduced: Callable[[int, np.ndarray], np.ndarray] | None = None
    # The weights the run allows (``AllReduce``'s ``weight_bounds``).
    weight_bounds: tuple[float, float] = (0.0, math.inf)
    # ``AllReduce``'s ``check_slice``: may refuse a peer's raw slice (sender, start, values).
    check_slice: Callable[[bytes, int, np.ndarray], str | None] | None = None
    # Our upload link's rate, when known (configured, not measured): each pair's channel is then
    # paced at its share, rate x PACING_SHARE / (N - 1), so the N - 1 flows into a receiver fit
    # its link (equal links) instead of overflowing its queue and backing off (TCP incast).
    pace_bps: float | None = None
    # An audited round (``swarm.averaging.audit``): sign our slices with this (our identity's
    # ``RecordSigner.sign_message``) and refuse a slice whose proof does not verify.
    sign: Callable[[bytes], bytes] | None = None
    # The rule each part we reduce is computed with (``swarm.averaging.aggregation``).
    aggregation: str = "mean"
    # The run's ``AveragerConfig.row_size``, which our Hellos carry (``hello_refusal``).
    row_size: int | None = None
    # A round of committed contributions (issue 19; ``swarm.averaging.commitment``): a sender's
    # committed root (None: it committed nothing), and our contribution's leaf digests. Parts
    # are then cut on leaf boundaries and a bound sender's slice is refused unless it matches.
    bound: Callable[[bytes], bytes | None] | None = None
    leaves: bytes = b""


@dataclass(frozen=True)
class RoundResult:
    """What ``Session`` returns: the averaged flat vector and whose contributions it holds."""

    vector: np.ndarray
    contributors: tuple[tuple[bytes, float], ...]
    dropped: dict[bytes, str]
    seconds: float


class Session(PeerLinks):
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
        result_in_local: bool = False,
    ) -> None:
        """``channels``: where data channels kept from earlier rounds are borrowed and given
        back (the Averager's pool); None opens new ones and closes them at the end.
        ``buffers``: where the result vector, received slices and reduced parts are taken from
        (the Averager's, so that rounds reuse memory the kernel has already zeroed).
        ``result_in_local``: ``local`` is the round's to overwrite: when the codec is lossy
        enough that our slices' wire bytes cost at most half of their values
        (``RoundValues.keeps_own_payloads``), they are encoded and kept now and the result is
        assembled in ``local`` itself instead of a vector of its own."""
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
        self.align = 1 if config.bound is None else leaf_size(len(local))
        self._leaves: dict[bytes, bytes] = {}  # each sender's contribution leaves (its Hello)
        # The result vector. Reduced parts that travel raw are received straight into their
        # place in it (the first copy of each part only: a later one may replace a part the
        # machine holds, and one arriving while we reduce the part ourselves must not race our
        # write), so the result is assembled without copying 2(N-1)/N of the vector again.
        in_local = result_in_local and self._values.keeps_own_payloads()
        self._keeps_encoded = not layout.gathers and not layout.lossless() and config.sign is None
        self._out = local if in_local else self._buffers.take(len(local))
        self._landed: set[int] = set()
        self._landing: set[int] = set()
        # Receivers (the event loop) and our own reductions (a worker thread) both claim
        # parts' places in the result: one at a time.
        self._landing_lock = threading.Lock()
        finalize = self._values.finalizer(config.tamper_reduced)
        # The round's clock starts here, on trio's clock: the machine's deadline, the reach
        # window and the streams' due time all count from it.
        self._t0 = trio.current_time()
        self.machine = AllReduce(
            self.me,
            self.peers,
            bandwidths,
            local,
            weight,
            deadline=self._t0 + config.timeout_s,
            finalize=finalize,
            chunks=self.chunks,
            out=self._out,
            allocate=self._buffers.take,
            weight_bounds=config.weight_bounds,
            check_slice=None
            if config.check_slice is None and config.bound is None
            else self._check_slice,
            aggregation=config.aggregation,
            # Our values in a part we reduce, one part at a time (a lossy codec's round trip).
            own=None if self.layout.lossless() else self._values.own_values,
            # Others' slices kept as their wire bytes while the round lasts (int8: a quarter
            # of the values), decoded when reduced (``_receive_item`` checked that they do).
            decode=self.layout.decode if self._keeps_encoded else None,
            align=self.align,
        )
        self.parts = self._values.parts = self.machine.parts
        if in_local:
            self._values.keep_own_payloads()  # before anything lands in ``local``
        self.alive: frozenset[bytes] = frozenset(self.peers)
        self.dropped: dict[bytes, str] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self._upload = UploadMeter()
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
        self._values.place = _claimer(
            self._out, self.parts, self._landed, self._landing_lock, self._finished
        )
        self._result: RoundResult | None = None
        self._error: str | None = None
        self._closed = False
        self._scope = trio.CancelScope()
        self._started_at = time.perf_counter()

    # -- public ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def upload_bps(self) -> float | None:
        """What our bulk sends achieved (bits/s), None if too few to tell."""
        if self._upload.busy_s < 0.02 or self._upload.sent < (1 << 20):
            return None
        return 8 * self._upload.sent / self._upload.busy_s

    def sent(self) -> np.ndarray | None:
        """Our contribution as every peer decodes it (a lossy codec's round trip, a new vector:
        for a caller's error feedback, which keeps what the codec dropped); None when the
        codec is lossless (it is ``local`` then)."""
        if self.layout.lossless():
            return None
        bandwidths = share_weights([m.bandwidth_bps for m in self.group.members])
        return self._values.wire_values(self.peers, bandwidths, self.chunks)

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

    def _check_slice(self, sender: bytes, start: int, values: np.ndarray) -> str | None:
        """The machine's check of a raw slice: the caller's (``SessionConfig.check_slice``),
        then, for a sender that committed its contribution, its leaves (from its Hello, which
        its stream carried before any item) against that commitment."""
        if self.config.check_slice is not None:
            why = self.config.check_slice(sender, start, values)
            if why:
                return why
        root = None if self.config.bound is None else self.config.bound(sender)
        if root is None:
            return None
        leaves = self._leaves.get(sender, b"")
        return check_contribution(root, leaves, len(self.machine.local), start, values)

    async def serve_incoming(self, peer: bytes, rpc: RpcStream, hello: Hello) -> None:
        """Answer ``peer``'s ``hello`` (if it names a kept channel), then read its items from its
        stream until it ends or we close."""
        self._leaves[peer] = hello.leaves
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
                log.warning("dropping %s from round %s: %s", short_id(peer), self.group.round, exc)
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

    def _watched(self) -> frozenset[bytes]:
        return self.alive - {self.me}  # every other member

    async def _apply(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendPart | SendReduced):
                self._outboxes[action.peer][0].send_nowait(action)
            elif isinstance(action, DropPeer):
                self.dropped[action.peer] = action.reason
                log.info(
                    "round %s: %s out (%s)", self.group.round, short_id(action.peer), action.reason
                )
            elif isinstance(action, Finish):
                # No await before ``_finished`` is set, after which no copy lands any more.
                vector = settle_landings(
                    action.result, self.parts, self.machine.held, self._landed, self._landing
                )
                seconds = time.perf_counter() - self._started_at
                self._result = RoundResult(vector, action.contributors, dict(self.dropped), seconds)
                for peer in self._watched():
                    self._outboxes[peer][0].send_nowait(Done())
                self._finished.set()
            elif isinstance(action, Fail):
                self._error = action.reason
                self._finished.set()

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

    def _release_channels(self) -> None:
        """The session ends: settle the channels held until now; forget the kept channels of
        peers it lost."""
        for verdict, peer, direction, channel in self._kept.release(self._standing()):
            self._settle(verdict, peer, direction, channel)
        if self._pool is not None:
            for peer in self._live.lost | set(self.dropped):
                self._pool.discard(peer)


def _claimer(
    out: np.ndarray,
    parts: list[tuple[bytes, int, int]],
    landed: set[int],
    lock: threading.Lock,
    finished: trio.Event,
) -> Callable[[int], np.ndarray | None]:
    """Where a part we reduced goes (``RoundValues.place``): its place in the result ``out``
    when no copy of it landed or is landing there (it is then marked landed: later copies go
    elsewhere, and ``settle_landings`` puts the held part back if the machine takes another),
    else None. A closure over these objects, not a method of the session: the session's
    values would refer back to it, and a cycle keeps a round's buffers until the next full
    garbage collection instead of until its caller drops the result."""

    def claim(part: int) -> np.ndarray | None:
        if not claim_place(part, landed, lock, finished):
            return None
        _, start, stop = parts[part]
        return out[start:stop]

    return claim
