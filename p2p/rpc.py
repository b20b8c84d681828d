"""Request/response and streaming calls over libp2p streams.

One libp2p protocol id per method (``/swarmtrain/<service>/<method>/<version>``): multistream-select
does the dispatch, so there are no method-name strings inside our messages, and an incompatible
change gets a new protocol id. A call is:

    client                                server
    open stream(protocol)  ------------>
    [request frame]        ------------>  decode (limit of the request type, checked first)
                           <------------  [response frame]              (unary)
                           <------------  [item]* [StreamEnd(count)]    (server streaming)
                           <------------  [RpcErrorReply(code, msg)]    (any failure)

Items are messages or tensors (a ``TensorHeader`` frame, then raw chunk frames). ``StreamEnd``
carries the item count so a truncated stream is detected, not mistaken for a short answer. Every
client call runs under a deadline (``deadline_s``). Remote failures come back as ``RemoteError``
with the server's code; bad bytes from the peer as ``RemoteProtocolError``; deadlines as
``RpcTimeout``. Server-side, a handler's exception becomes an ``RpcErrorReply`` and a log line; it
never reaches the host.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import numpy as np
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from p2p.bulk.transfer import lazy_buffer
from p2p.errors import P2PError, RemoteError, RemoteProtocolError
from p2p.host import Host, reset_quietly
from p2p.stream_deadlines import StreamDeadlineExceeded
from p2p.tensors import TensorHeader, as_wire_bytes, from_wire_bytes, header_for
from p2p.wire import (
    FRAME_HEADER,
    Message,
    decode,
    encode,
    message,
    read_exactly,
    read_frame,
    read_frame_or_end,
    write_frame,
)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Item = Message | np.ndarray
DEFAULT_DEADLINE_S = 30.0
DEFAULT_MAX_TENSOR_BYTES = 1 << 30


class RpcTimeout(P2PError, TimeoutError):
    """The call did not complete before its deadline."""


@message(1, max_bytes=4096)
class RpcErrorReply(Message):
    code: str
    message: str


@message(2, max_bytes=64)
class StreamEnd(Message):
    count: int


class RpcStream:
    """Typed messages and tensors over one libp2p stream (either side)."""

    def __init__(self, stream: INetStream, *, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES):
        self.stream = stream
        self.peer_id: ID = stream.muxed_conn.peer_id
        self.max_tensor_bytes = max_tensor_bytes

    async def send(self, msg: Message) -> None:
        await write_frame(self.stream, encode(msg))

    async def send_tensor(self, array: np.ndarray) -> None:
        header = header_for(array)
        data = as_wire_bytes(array)
        await self.send(header)
        for start in range(0, header.nbytes, header.chunk_bytes):
            await write_frame(self.stream, bytes(data[start : start + header.chunk_bytes]))

    async def receive(self, *expected: type[M]) -> M:
        limit = max(t.MAX_BYTES for t in expected)
        return decode(await read_frame(self.stream, limit), *expected)

    async def receive_or_end(self, *expected: type[M]) -> M | None:
        """``receive``, or None when the peer closed its side of the stream between messages."""
        limit = max(t.MAX_BYTES for t in expected)
        frame = await read_frame_or_end(self.stream, limit)
        return None if frame is None else decode(frame, *expected)

    async def receive_item(self, *expected: type[Message]) -> Item:
        """A message of the expected types, or a tensor if TensorHeader is among them."""
        msg = await self.receive(*expected)
        if isinstance(msg, TensorHeader):
            return await self.receive_tensor_body(msg)
        return msg

    async def receive_tensor_body(self, header: TensorHeader) -> np.ndarray:
        if header.nbytes > self.max_tensor_bytes:
            raise RemoteProtocolError(f"tensor of {header.nbytes} B > {self.max_tensor_bytes}")
        data = lazy_buffer(header.nbytes)  # pages mapped as the chunks arrive
        view = memoryview(data)
        for index in range(header.num_chunks):
            start = index * header.chunk_bytes
            want = min(header.chunk_bytes, header.nbytes - start)
            length = FRAME_HEADER.unpack(await read_exactly(self.stream, FRAME_HEADER.size))[0]
            if length != want:
                raise RemoteProtocolError(f"tensor chunk {index} is {length} B, expected {want}")
            view[start : start + want] = await read_exactly(self.stream, want)
        return from_wire_bytes(header, data)

    async def close(self) -> None:
        with trio.move_on_after(1):
            try:
                await self.stream.close()
            except Exception as exc:
                log.debug("stream close failed: %r", exc)


UnaryHandler = Callable[[ID, M], Awaitable[Message]]
StreamingHandler = Callable[[ID, M], AsyncIterator[Item]]


def serve_unary(host: Host, protocol: str, request_type: type[M], handler: UnaryHandler) -> None:
    """Serve one request/response method. ``handler(peer_id, request) -> response``."""

    async def serve(rpc: RpcStream) -> None:
        request = await rpc.receive(request_type)
        await rpc.send(await handler(rpc.peer_id, request))

    host.set_handler(protocol, _guarded(host, protocol, serve))


def serve_stream(
    host: Host, protocol: str, request_type: type[M], handler: StreamingHandler
) -> None:
    """Serve a server-streaming method: ``handler`` is an async generator of messages/tensors."""

    async def serve(rpc: RpcStream) -> None:
        request = await rpc.receive(request_type)
        count = 0
        async for item in handler(rpc.peer_id, request):
            if isinstance(item, np.ndarray):
                await rpc.send_tensor(item)
            else:
                await rpc.send(item)
            count += 1
        await rpc.send(StreamEnd(count))

    host.set_handler(protocol, _guarded(host, protocol, serve))


def _guarded(
    host: Host, protocol: str, serve: Callable[[RpcStream], Awaitable[None]]
) -> Callable[[INetStream], Awaitable[None]]:
    """Turn every failure into a counted rejection and, where possible, an error reply."""

    async def handle(stream: INetStream) -> None:
        rpc = RpcStream(stream)
        try:
            await serve(rpc)
        except StreamDeadlineExceeded:
            await reset_quietly(stream)  # counted and logged where it was raised
            return
        except RemoteProtocolError as exc:
            host.reject(rpc.peer_id, protocol, str(exc))
            await _reply_error(rpc, "bad_request", str(exc))
            return
        except Exception as exc:
            host.statistics.handler_failures += 1
            host.reject(rpc.peer_id, f"{protocol} (handler failed)", repr(exc))
            await _reply_error(rpc, "internal", f"{type(exc).__name__}: {exc}")
            return
        await rpc.close()

    return handle


async def _reply_error(rpc: RpcStream, code: str, text: str) -> None:
    with trio.move_on_after(1):
        try:
            await rpc.send(RpcErrorReply(code, text[:1000]))
            await rpc.stream.close()
            return
        except Exception as exc:
            log.debug("could not send error reply: %r", exc)
    await reset_quietly(rpc.stream)


@asynccontextmanager
async def _call_scope(
    host: Host, peer_id: ID, protocol: str, deadline_s: float
) -> AsyncIterator[RpcStream]:
    try:
        with trio.fail_after(deadline_s):
            stream = await host.open_stream(peer_id, protocol)
            rpc = RpcStream(stream)
            try:
                yield rpc
            except BaseException:
                await reset_quietly(stream)
                raise
            await rpc.close()
    except trio.TooSlowError as exc:
        raise RpcTimeout(f"{protocol} to {peer_id} exceeded {deadline_s} s") from exc


def _raise_if_error(msg: Message) -> None:
    if isinstance(msg, RpcErrorReply):
        raise RemoteError(msg.code, msg.message)


async def call_unary(
    host: Host,
    peer_id: ID,
    protocol: str,
    request: Message,
    response_type: type[M],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> M:
    """Send ``request`` and return the response.

    Raises ``RemoteError`` (the server reported a failure), ``RemoteProtocolError`` (bad
    response), ``RpcTimeout``, or ``PeerUnreachable``.
    """
    async with _call_scope(host, peer_id, protocol, deadline_s) as rpc:
        await rpc.send(request)
        reply = await rpc.receive(response_type, RpcErrorReply)
        _raise_if_error(reply)
        return reply  # type: ignore[return-value]


async def call_stream(
    host: Host,
    peer_id: ID,
    protocol: str,
    request: Message,
    item_types: tuple[type[Message], ...],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
) -> list[Item]:
    """Send ``request`` and collect every streamed item (messages and/or tensors).

    Collected rather than yielded: an async generator cannot safely hold a deadline scope open
    across yields (trio's rule), and the callers here want the whole answer anyway.
    """
    items: list[Item] = []
    async with _call_scope(host, peer_id, protocol, deadline_s) as rpc:
        rpc.max_tensor_bytes = max_tensor_bytes
        await rpc.send(request)
        while True:
            item = await rpc.receive_item(*item_types, TensorHeader, StreamEnd, RpcErrorReply)
            if isinstance(item, StreamEnd):
                if item.count != len(items):
                    raise RemoteProtocolError(f"stream ended after {len(items)} of {item.count}")
                return items
            if isinstance(item, Message):
                _raise_if_error(item)
            items.append(item)
