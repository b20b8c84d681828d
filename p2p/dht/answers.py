"""What our Kad server's answers may name: only peers in its routing table (and itself)."""

from __future__ import annotations

from collections.abc import Callable

import varint
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.network.stream.net_stream import INetStream


class AnswerFilter:
    """The Kad handler's view of an inbound stream: answers name only routing-table peers.

    0.8.1 prepends the target of a FIND_NODE to the answer whenever the peerstore has an address
    for it (go-libp2p's FIND_PEER rule), a client-mode or private peer included; askers then
    dial it as a DHT server. The handler writes every answer as two writes, the varint length
    then the message; this holds the length back, drops ``closerPeers`` that ``keep`` refuses,
    and writes both at once. Any other write goes through unchanged.
    """

    def __init__(self, stream: INetStream, keep: Callable[[bytes], bool]) -> None:
        self._stream = stream
        self._keep = keep
        self._prefix: tuple[bytes, int] | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        return await self._stream.read(n)

    async def write(self, data: bytes) -> None:
        if self._prefix is None and 0 < len(data) <= 10:
            try:
                length = varint.decode_bytes(data)
            except Exception:
                length = -1
            if length >= 0 and len(varint.encode(length)) == len(data):
                self._prefix = (data, length)
                return
        if self._prefix is not None:
            prefix, length = self._prefix
            self._prefix = None
            data = self._filtered(data) if len(data) == length else prefix + data
        await self._stream.write(data)

    def _filtered(self, body: bytes) -> bytes:
        message = Message()
        try:
            message.ParseFromString(body)
        except Exception:  # not a Kad answer after all: pass it on as written
            return varint.encode(len(body)) + body
        kept = [p for p in message.closerPeers if self._keep(p.id)]
        if len(kept) != len(message.closerPeers):
            del message.closerPeers[:]
            message.closerPeers.extend(kept)
            body = message.SerializeToString()
        return varint.encode(len(body)) + body
