"""Trio driver of one hierarchical all-reduce round (``hierarchical.GridAllReduce``): carries the
machine's items over p2p streams and keeps time; it decides nothing itself.

It does for the grid what ``session.Session`` does for the flat machine, over the same wire
(``session_wire``: ``Hello``, items, ``Done`` on one stream per ordered pair; the items are
``grid_wire.GridItem``), with what a grid changes: a member talks only to its *near* peers, the
members of its row and of the rows above and below it (its row for the scatter, gather and
barrier, the column chains' neighbours for partial sums and takeovers), so it holds
``O(row)`` streams, not ``O(n)``.

* At the start it connects to every near peer (the lower id dialing, as ``PeerLinks`` does) and
  opens its stream to each with a ``Hello`` at once: every near pair then has a stream each way,
  so a member whose session ends early (failed, cancelled, killed) is seen gone by the end of
  its stream, and ``Liveness`` rule 2 (streams due) holds for near peers.
* Liveness (``liveness``) watches the near peers only: pings when quiet, lost when a stream or
  transfer breaks. Each loss is a ``PeerLost`` to the machine; bytes that break the protocol
  drop their sender (a ``PeerLost`` too, the reason kept in ``dropped``).
* After ``Finish`` it sends ``Done`` to the near peers and keeps serving (forwards, relays,
  takeovers) until every near peer still counted alive said ``Done`` or the deadline passes:
  only near peers can still need anything from us (``hierarchical``: "Finish").

* A lossy codec (``hierarchical``, "Codecs"): before the machine starts, our slice of each
  column is encoded once (``grid_wire.encode_slices``, in a worker thread, into ``local`` when
  the round may overwrite it); received slices and columns are decoded in a worker thread, and
  what we pass on goes as the bytes that came.

No data channel is kept between rounds (a grid round's pairs change with the group's layout).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import trio

from p2p import (
    BulkChannel,
    BulkTransferFailed,
    Node,
    P2PError,
    PeerID,
    RemoteProtocolError,
    RpcStream,
    StreamEnded,
    accept_channel,
    open_channel,
    stream_kind,
)
from swarm.averaging.allreduce import DropPeer, Fail, Finish, PeerLost
from swarm.averaging.grid import grid_plan
from swarm.averaging.grid_wire import (
    GridItem,
    encode_slices,
    finalizer,
    from_wire,
    payload_bytes,
    to_wire,
)
from swarm.averaging.hierarchical import GridAllReduce, ItemReceived, SendItem
from swarm.averaging.liveness import Liveness, LivenessConfig
from swarm.averaging.matchmaking import Group
from swarm.averaging.payload import Layout
from swarm.averaging.session import FLUSH_S, RoundResult, SessionConfig
from swarm.averaging.session_links import RoundDriver, Wake, connect_first, short_id
from swarm.averaging.session_wire import INLINE_MAX_BYTES, PROTOCOL, THREAD_MIN_NUMEL, Done, Hello
from swarm.errors import AveragingFailed

__all__ = ["GridSession"]

log = logging.getLogger(__name__)


class GridSession(RoundDriver):
    """One peer's part in one group's hierarchical all-reduce. ``run`` drives it; ``result``
    waits for it. The surface the Averager uses is ``Session``'s."""

    def __init__(
        self,
        node: Node,
        run_id: str,
        group: Group,
        local: np.ndarray,
        layout: Layout,
        config: SessionConfig,
        *,
        result_in_local: bool = False,
    ) -> None:
        """``config.row_size``: the grid's largest row. ``result_in_local``: ``local`` is the
        round's to overwrite; with a lossy codec our contribution as the others decode it goes
        there (no vector of its own)."""
        assert config.row_size is not None
        self.node, self.run_id, self.group, self.layout, self.config = (
            node, run_id, group, layout, config,
        )  # fmt: skip
        # Grid rounds never carry committed contributions (``Averager``: committed rounds are
        # flat), so their parts are never leaf-aligned.
        self.align = 1
        self.me = node.host.peer_id.to_bytes()
        # A declared weight outside the run's bounds leaves its peer out of the grid, as every
        # reducer drops it in a flat round: the layout is then over the others, on every peer.
        low, high = config.weight_bounds
        members = [m for m in group.members if math.isfinite(m.weight) and low <= m.weight <= high]
        self.peers = tuple(m.peer_id for m in members)
        plan = self.plan = grid_plan(
            self.peers, [m.weight for m in members], len(local), config.row_size
        )
        self._t0 = trio.current_time()
        self._deadline = self._t0 + config.timeout_s
        self._local = local
        self._in_place = result_in_local
        # Set by ``run`` (a lossy round encodes our vector first, in a worker thread).
        self.machine: GridAllReduce
        my_row = plan.row_of(plan.peers.index(self.me))
        rows = range(max(0, my_row - 1), min(plan.rows, my_row + 2))
        self.near = frozenset(plan.peers[i] for k in rows for i in plan.row(k)) - {self.me}
        self.parts = [(self.me, *plan.part(c)) for c in range(plan.columns)]
        self._big = len(local) >= THREAD_MIN_NUMEL
        self.alive: frozenset[bytes] = frozenset(self.peers)
        self.dropped: dict[bytes, str] = {
            m.peer_id: f"weight {m.weight:g} outside the run's bounds [{low:g}, {high:g}]"
            for m in group.members
            if m.peer_id not in self.peers
        }
        self.bytes_sent = 0
        self.bytes_received = 0
        self.upload_bps: float | None = None
        self._live = Liveness(LivenessConfig(config.peer_timeout_s, config.heartbeat_s))
        # Every item an honest near peer sends is bounded by the grid's items, resent once per
        # exclusion or takeover at most; beyond this a stream is a flood.
        self._item_limit = 8 * (plan.columns * (plan.rows + 4) + 8)
        self._inbox_send, self._inbox = trio.open_memory_channel[Any](
            max(1, len(self.near)) * (self._item_limit + 2)
        )
        self._outboxes: dict[bytes, trio.MemorySendChannel[Any]] = {}
        self._senders: trio.Nursery | None = None
        self._channels: list[BulkChannel] = []
        self._handler_scopes: set[trio.CancelScope] = set()
        self._finished = trio.Event()
        self._result: RoundResult | None = None
        self._error: str | None = None
        self._closed = False
        self._scope = trio.CancelScope()
        self._started_at = time.perf_counter()

    # -- Session's surface -----------------------------------------------------------------------

    @property
    def group_id(self) -> bytes:
        return self.group.group_id

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def lost(self) -> frozenset[bytes]:
        return frozenset(self._live.lost)

    def sent(self) -> np.ndarray | None:
        """Our contribution as every peer decodes it (a lossy codec's round trip); None when
        the codec is lossless (what we gave)."""
        if self.layout.lossless():
            return None
        values = self.machine.local
        return values if self._in_place else values.copy()

    async def result(self) -> RoundResult:
        """Wait for this peer's outcome; raises ``AveragingFailed``."""
        await self._finished.wait()
        if self._result is None:
            raise AveragingFailed(self._error or "the round ended without a result")
        return self._result

    def cancel(self) -> None:
        self._scope.cancel()

    async def run(self) -> None:
        """Drive the round until the near peers are done, it fails, or the deadline passes."""
        try:
            with self._scope:
                self._scope.deadline = self._deadline + self.config.peer_timeout_s
                self._live.start(self._t0)
                self.machine = await self._thread(self._machine)
                await self._connect_near()
                async with trio.open_nursery() as senders:
                    self._senders = senders
                    for peer in sorted(self.near):
                        self._outbox(peer)  # the Hello goes at once (module docstring)
                    async with trio.open_nursery() as watcher:
                        watcher.start_soon(self._watch_liveness)
                        await self._drive()
                        watcher.cancel_scope.cancel()
                    for send in self._outboxes.values():
                        send.close()  # senders deliver what is queued (Done last), then end
                    senders.cancel_scope.deadline = trio.current_time() + FLUSH_S
        finally:
            self._closed = True
            for scope in list(self._handler_scopes):
                scope.cancel()
            for channel in self._channels:
                channel.close()
            if not self._finished.is_set():
                timed_out = trio.current_time() >= self._scope.deadline
                self._error = self._error or (
                    "the round's deadline passed" if timed_out else "cancelled"
                )
                self._finished.set()

    async def serve_incoming(self, peer: bytes, rpc: RpcStream, hello: Hello) -> None:
        """Read ``peer``'s items from its stream until it ends or we close."""
        with trio.CancelScope() as scope:
            self._handler_scopes.add(scope)
            self._live.stream_opened(peer)
            try:
                if self._closed:
                    return
                if hello.channel:
                    raise RemoteProtocolError("a grid round keeps no data channel")
                await self._receive_loop(peer, rpc)
            except StreamEnded as exc:
                await self._peer_gone(peer, f"its stream ended: {exc}")
            except RemoteProtocolError as exc:
                log.warning("dropping %s from round %s: %s", short_id(peer), self.group.round, exc)
                self.dropped.setdefault(peer, str(exc))
                await self._post(PeerLost(peer))
            except Exception as exc:  # libp2p's stream errors vary (reset, EOF, P2PError)
                await self._peer_gone(peer, f"stream from it broke: {exc!r}")
            finally:
                self._handler_scopes.discard(scope)

    # -- the machine -----------------------------------------------------------------------------

    def _machine(self) -> GridAllReduce:
        """The round's machine; in a lossy round over our vector as the others decode it,
        with its wire bytes (``grid_wire.encode_slices``)."""
        if self.layout.lossless():
            return GridAllReduce(self.me, self.plan, self._local, self._deadline)
        values = self._local if self._in_place else np.empty_like(self._local)
        payloads = encode_slices(self._local, self.plan, self.layout, values)
        return GridAllReduce(
            self.me,
            self.plan,
            values,
            self._deadline,
            payloads=payloads,
            finalize=finalizer(self.layout),
        )

    def _watched(self) -> frozenset[bytes]:
        return self.alive & self.near  # only near peers exchange items with us

    async def _apply(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendItem):
                await self._outbox(action.peer).send(action.item)
            elif isinstance(action, DropPeer):
                self.dropped[action.peer] = action.reason
                log.info(
                    "round %s: %s out (%s)", self.group.round, short_id(action.peer), action.reason
                )
            elif isinstance(action, Finish):
                seconds = time.perf_counter() - self._started_at
                self._result = RoundResult(
                    action.result, action.contributors, dict(self.dropped), seconds
                )
                for peer in sorted(self._watched()):
                    await self._outbox(peer).send(Done())
                self._finished.set()
            elif isinstance(action, Fail):
                self._error = action.reason
                self._finished.set()

    # -- links -----------------------------------------------------------------------------------

    async def _connect_near(self) -> None:
        """Connect to the near peers before any stream opens (``connect_first``)."""
        await connect_first(self.node, self.me, self.near, self.config.peer_timeout_s)

    def _outbox(self, peer: bytes) -> trio.MemorySendChannel[Any]:
        """The queue of items to ``peer``, its sender task started at first use. Bounded as a
        stream's items are; a sender that failed keeps draining it, so we never wait on it."""
        if peer not in self._outboxes:
            assert self._senders is not None
            send, receive = trio.open_memory_channel[Any](self._item_limit + 2)
            self._outboxes[peer] = send
            self._senders.start_soon(self._send_loop, peer, receive)
        return self._outboxes[peer]

    async def _send_loop(self, peer: bytes, outbox: trio.MemoryReceiveChannel[Any]) -> None:
        stream = None
        try:
            stream = await self.node.open_stream(
                PeerID(peer), PROTOCOL, keep_trying_s=self._live.keep_trying_s(trio.current_time())
            )
            rpc = RpcStream(stream)
            direct = stream_kind(stream) == "direct"
            channel: BulkChannel | None = None
            hello = Hello(
                self.run_id, self.group_id, self.layout.digest, row_size=self.config.row_size or 0
            )
            await rpc.send(hello)
            async for item in outbox:
                if isinstance(item, Done):
                    await rpc.send(item)
                    continue
                msg, payload = await self._thread(to_wire, item)
                await rpc.send(msg)
                if not msg.inline and msg.nbytes:
                    if channel is None:
                        channel = await open_channel(
                            stream,
                            direct=direct,
                            listener=self.node.bulk_listener,
                            config=self.config.bulk,
                        )
                        self._channels.append(channel)
                    await channel.send(payload)
                self._live.heard(peer, trio.current_time())
                self.bytes_sent += msg.nbytes
        except (P2PError, OSError, BulkTransferFailed, trio.BrokenResourceError) as exc:
            await self._peer_gone(peer, f"sending to it failed: {exc!r}")
        except Exception as exc:  # libp2p stream errors are not all P2PError
            await self._peer_gone(peer, f"sending to it failed: {exc!r}")
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception as exc:
                        log.debug("closing the stream to %s: %r", short_id(peer), exc)
        async for _ in outbox:
            pass  # it is lost to us: what the machine still orders for it goes nowhere

    async def _receive_loop(self, peer: bytes, rpc: RpcStream) -> None:
        direct = stream_kind(rpc.stream) == "direct"
        channel: BulkChannel | None = None
        for _ in range(self._item_limit):
            msg = await rpc.receive_or_end(GridItem, Done)
            if msg is None:
                raise StreamEnded("the stream ended")
            self._live.heard(peer, trio.current_time())
            if isinstance(msg, Done):
                self._live.said_done(peer)
                await self._post(Wake())
                continue
            expected = payload_bytes(msg, self.plan, self.layout)
            data: bytes | bytearray = msg.inline
            if expected > INLINE_MAX_BYTES and not msg.inline:
                data = bytearray(expected)
                self._live.transfer_started(peer)
                try:
                    if channel is None:
                        channel = await accept_channel(
                            rpc.stream,
                            direct=direct,
                            listener=self.node.bulk_listener,
                            config=self.config.bulk,
                        )
                        self._channels.append(channel)
                    await channel.receive(data)
                finally:
                    self._live.transfer_ended(peer)
                self._live.heard(peer, trio.current_time())
            self.bytes_received += len(data)
            if self.layout.lossless():
                item = from_wire(msg, data, self.plan, self.layout)
            else:  # decoding a column costs as much as a flat reducer's
                item = await self._thread(from_wire, msg, data, self.plan, self.layout)
            await self._post(ItemReceived(peer, item))
        raise RemoteProtocolError(f"more than {self._item_limit} items in one round")
