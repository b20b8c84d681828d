"""Downloading a run's global state from its peers: the ``/swarmtrain/state/1`` protocol (trio).

Serve side (``StateServer``): every node keeps its latest agreed states (the encoding of
``diloco.GlobalState``, which ends in its own SHA-256, the state hash) and answers range requests
for them. A request names the run, the state hash and a byte range; the reply is a small accept or
refuse message, then the range as one bulk transfer (``p2p.send_bulk``: a data connection at
close to plain-TCP cost where the peers can reach each other, the libp2p stream when relayed).
Nothing is pickled; the request is a size-limited wire message; a range is bounded by
``MAX_RANGE_BYTES`` and by the state's size; at most ``MAX_CONCURRENT_SERVES`` ranges are served at
once (more are refused, so a flood of joiners cannot exhaust memory or CPU); every failure in the
handler is caught and logged (``Host.set_handler`` guards it as well), so a bad peer costs one
stream, never the node.

Fetch side (``download_state``): the joiner knows the exact size (its model has the same layout)
and the hash the round's majority published. ``swarmtrain.membership.state_sync_plan.RangePlan``
decides which piece to pull from which source; one task per source pulls pieces until none are
left; a source that fails is dropped and its piece resumed by the next idle source. The assembled
bytes are checked against the hash; if they do not match (some source sent bad bytes that still
decoded), each source is tried alone, and the first whose full copy matches wins, so one lying
source cannot stop a joiner. A state that does not match the published hash is never returned.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

import trio

from p2p import (
    BulkConfig,
    Message,
    Node,
    P2PError,
    PeerID,
    RemoteProtocolError,
    RpcStream,
    Stream,
    message,
    receive_bulk,
    send_bulk,
    stream_kind,
)
from swarmtrain.membership.state_sync_plan import Piece, RangePlan

log = logging.getLogger(__name__)

PROTOCOL = "/swarmtrain/state/1"
HASH_BYTES = 32
MAX_RANGE_BYTES = 64 << 20
MAX_STATE_BYTES = 17 << 30  # 2 x 2**31 float32 elements (diloco.state's limit) plus headers
MAX_CONCURRENT_SERVES = 4
KEEP_STATES = 2  # the latest agreed state and the one before: a joiner may ask for either
REQUEST_TIMEOUT_S = 10.0
PIECE_TIMEOUT_S = 60.0


@message(400, max_bytes=256)
class StateRangeRequest(Message):
    run_id: str
    state_hash: bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if len(self.state_hash) != HASH_BYTES:
            raise ValueError("state_hash must be 32 bytes")
        if not 0 <= self.offset <= MAX_STATE_BYTES or not 0 < self.length <= MAX_RANGE_BYTES:
            raise ValueError("range out of bounds")


@message(401, max_bytes=64)
class StateRangeAccepted(Message):
    total_bytes: int


@message(402, max_bytes=512)
class StateRangeRefused(Message):
    reason: str


class StateSyncFailed(Exception):
    """No verified copy of the state could be assembled; the message names each source's fault."""


def state_hash_of(data: bytes | bytearray | memoryview) -> bytes | None:
    """The hash a state encoding claims (its trailing SHA-256) if it matches the body, else None.

    This is ``diloco.GlobalState``'s own check, done here without decoding tensors."""
    view = memoryview(data)
    if len(view) <= HASH_BYTES:
        return None
    claimed = bytes(view[-HASH_BYTES:])
    return claimed if hashlib.sha256(view[:-HASH_BYTES]).digest() == claimed else None


class StoredState:
    """A state's encoding as ``length`` bytes at ``offset`` of a file (its checkpoint), read a
    range at a time: a node serves its states without a copy of them in memory. The file is
    opened here and stays open while this object lives, so a checkpoint deleted by a later
    round still serves a transfer under way. Raises OSError, or ValueError when the file's
    range does not end in ``state_hash`` (the encoding's own trailing digest; a joiner checks
    the whole against it anyway)."""

    def __init__(self, path: str | os.PathLike[str], offset: int, length: int, state_hash: bytes):
        self._file = open(path, "rb")  # noqa: SIM115  # held open on purpose, see above
        self.offset, self.length = offset, length
        if length <= HASH_BYTES or self.read(length - HASH_BYTES, HASH_BYTES) != state_hash:
            self._file.close()
            raise ValueError(f"{path} does not hold the state {state_hash.hex()[:12]}")

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, length: int) -> bytes:
        data = os.pread(self._file.fileno(), length, self.offset + start)
        if len(data) != length:
            raise OSError(f"short read of a stored state ({len(data)} of {length} bytes)")
        return data


class StateServer:
    """Serves this node's latest agreed states to joiners. ``offer`` runs in the trio thread."""

    def __init__(
        self, node: Node, run_id: str, admit: Callable[[bytes], bool] | None = None
    ) -> None:
        self.node = node
        self.run_id = run_id
        self._admit = admit  # a permissioned run's members; None: anyone
        self._states: OrderedDict[bytes, bytes | StoredState] = OrderedDict()
        self._serving = 0
        self.ranges_served = 0
        self.bytes_served = 0

    def install(self) -> None:
        self.node.host.set_handler(PROTOCOL, self.serve)

    def offer(self, state_hash: bytes, data: bytes | StoredState) -> None:
        """Serve ``data`` (a state encoding whose hash is ``state_hash``, or where a file holds
        it, checked when it was opened) from now on."""
        if not isinstance(data, StoredState) and state_hash_of(data) != state_hash:
            raise ValueError("the offered state does not match its hash")
        self._states[state_hash] = data
        self._states.move_to_end(state_hash)
        while len(self._states) > KEEP_STATES:
            self._states.popitem(last=False)

    def _refusal(self, request: StateRangeRequest) -> tuple[str, bytes | StoredState | None]:
        if request.run_id != self.run_id:
            return f"not serving run {request.run_id!r}", None
        data = self._states.get(request.state_hash)
        if data is None:
            return "no such state here (too old, or never agreed)", None
        if request.offset + request.length > len(data):
            return f"range beyond the state's {len(data)} bytes", None
        if self._serving >= MAX_CONCURRENT_SERVES:
            return "busy: too many state transfers in flight", None
        return "", data

    async def serve(self, stream: Stream) -> None:
        rpc = RpcStream(stream)
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                request = await rpc.receive(StateRangeRequest)
            reason, data = self._refusal(request)
            if self._admit is not None and not self._admit(rpc.peer_id.to_bytes()):
                reason, data = "not a member of this run", None
            if data is None:
                await rpc.send(StateRangeRefused(reason))
                await rpc.close()
                return
            self._serving += 1
            try:
                await rpc.send(StateRangeAccepted(len(data)))
                start, length = request.offset, request.length
                if isinstance(data, StoredState):
                    view = memoryview(await trio.to_thread.run_sync(data.read, start, length))
                else:
                    view = memoryview(data)[start : start + length]
                await send_bulk(
                    stream,
                    view,
                    direct=stream_kind(stream) == "direct",
                    listener=self.node.bulk_listener,
                )
            finally:
                self._serving -= 1
            self.ranges_served += 1
            self.bytes_served += request.length
            await rpc.close()
        except Exception as exc:  # one bad or vanished peer costs this stream, never the node
            log.info("state request from %s failed: %r", str(rpc.peer_id)[-8:], exc)
            with trio.move_on_after(1):
                try:
                    await stream.reset()
                except Exception as reset_exc:
                    log.debug("reset failed: %r", reset_exc)


Fetch = Callable[[Hashable, Piece], Awaitable[bytes | bytearray]]


def node_fetcher(node: Node, run_id: str, state_hash: bytes) -> Fetch:
    """``fetch(source, piece)`` over ``PROTOCOL`` from ``node``: the bytes of ``piece``. Raises
    P2PError (unreachable, refused, bad bytes) or trio.TooSlowError."""

    async def fetch(source: Hashable, piece: Piece) -> bytearray:
        assert isinstance(source, PeerID)
        with trio.fail_after(PIECE_TIMEOUT_S):
            await node.reach(source)
            stream = await node.host.open_stream(source, PROTOCOL)
            rpc = RpcStream(stream)
            done = False
            try:
                await rpc.send(StateRangeRequest(run_id, state_hash, piece.offset, piece.length))
                reply = await rpc.receive(StateRangeAccepted, StateRangeRefused)
                if isinstance(reply, StateRangeRefused):
                    raise P2PError(f"refused: {reply.reason}")
                received = await receive_bulk(
                    stream,
                    direct=stream_kind(stream) == "direct",
                    listener=node.bulk_listener,
                    config=BulkConfig(max_bytes=piece.length),
                )
                if len(received.data) != piece.length:
                    raise RemoteProtocolError(
                        f"sent {len(received.data)} bytes for a {piece.length}-byte range"
                    )
                done = True
                return received.data
            finally:
                # A finished transfer closes politely (the server is closing its side too); a
                # failed one is reset so the server stops sending at once.
                with trio.move_on_after(1):
                    try:
                        await (stream.close() if done else stream.reset())
                    except Exception as exc:
                        log.debug("closing the state stream failed: %r", exc)

    return fetch


@dataclass(frozen=True)
class Downloaded:
    data: bytearray
    pieces_by_source: dict[str, int]
    failures: dict[str, str]


async def download_state(
    fetch: Fetch,
    state_hash: bytes,
    total_bytes: int,
    sources: Sequence[Hashable],
    *,
    piece_bytes: int | None = None,
) -> Downloaded:
    """Assemble the state ``state_hash`` of ``total_bytes`` from ``sources`` and verify it.

    Raises StateSyncFailed when no combination of sources yields bytes that match the hash
    (every source failed, or every full copy was wrong). Callers bound it with a deadline."""
    if total_bytes <= HASH_BYTES or total_bytes > MAX_STATE_BYTES:
        raise StateSyncFailed(f"a state of {total_bytes} bytes is out of bounds")
    if not sources:
        raise StateSyncFailed("no source holds the agreed state")
    result = await _assemble(fetch, total_bytes, list(sources), piece_bytes)
    if state_hash_of(result.data) == state_hash:
        return result
    log.warning("assembled state does not match its hash; trying each source alone")
    failures = dict(result.failures)
    for source in sources:
        if str(source) in failures:
            continue
        alone = await _assemble(fetch, total_bytes, [source], piece_bytes)
        if state_hash_of(alone.data) == state_hash:
            return Downloaded(alone.data, alone.pieces_by_source, {**failures, **alone.failures})
        failures[str(source)] = alone.failures.get(str(source), "sent bytes that fail the hash")
    raise StateSyncFailed(_describe(failures) or "every copy failed the state hash")


async def _assemble(
    fetch: Fetch, total_bytes: int, sources: list[Hashable], piece_bytes: int | None
) -> Downloaded:
    plan = RangePlan(total_bytes, sources, piece_bytes=piece_bytes)
    buffer = bytearray(total_bytes)
    changed = [trio.Event()]

    def notify() -> None:
        changed[0].set()
        changed[0] = trio.Event()

    async def pull(source: Hashable) -> None:
        while not plan.complete and plan.is_live(source):
            piece = plan.next_range(source)
            if piece is None:  # the rest is in flight elsewhere; one may fail and come back
                await changed[0].wait()
                continue
            try:
                data = await fetch(source, piece)
                if len(data) != piece.length:
                    raise RemoteProtocolError(f"{len(data)} bytes for {piece}")
            except (Exception, trio.TooSlowError) as exc:
                log.info("state source %s failed at %s: %r", str(source)[-8:], piece, exc)
                plan.failed(source, piece, f"{type(exc).__name__}: {exc}"[:200])
            else:
                buffer[piece.offset : piece.end] = data
                plan.completed(source, piece)
            notify()
        notify()

    async with trio.open_nursery() as nursery:
        for source in sources:
            nursery.start_soon(pull, source)
    if not plan.complete:
        raise StateSyncFailed(_describe({str(s): r for s, r in plan.failures.items()}))
    counts: dict[str, int] = {}
    for source in plan.held_from().values():
        counts[str(source)] = counts.get(str(source), 0) + 1
    return Downloaded(buffer, counts, {str(s): r for s, r in plan.failures.items()})


def _describe(failures: dict[str, str]) -> str:
    return "; ".join(f"{source[-8:]}: {why}" for source, why in failures.items())
