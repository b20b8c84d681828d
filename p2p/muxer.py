"""Yamux whose frame writes survive cancellation.

py-libp2p 0.8.1's Noise channel encrypts a frame, spending a nonce, before the write's first
checkpoint (the TCP stream's lock). A Cancelled delivered there (a deadline that passed while the
writer waited for the connection's frame lock: every write pending on an event loop that stalled
for a moment, or a timeout that fires as a write starts) sends nothing, so the peer's next frame
fails authentication and it closes the connection: every stream on it ends at once, on both sides
("stream ended" from peers that were fine). Measured: a peer stalled 3.5 s mid-round lost all of
its connections this way when it woke; tests/integration/test_host.py reproduces it with one write.

Here a frame, once it holds the lock, is written whole: shielded from cancellation, the caller's
Cancelled arriving right after. A write that cannot finish within ``FRAME_WRITE_TIMEOUT_S`` (the
peer stopped reading) may have left half a frame on the wire, so the connection is closed.
"""

from __future__ import annotations

import logging

import trio
from libp2p import MPLEX_PROTOCOL_ID, YAMUX_PROTOCOL_ID
from libp2p.abc import IHost, IMuxedConn, ISecureConn
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.peer.id import ID
from libp2p.stream_muxer.mplex.mplex import Mplex
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import Yamux

log = logging.getLogger(__name__)

FRAME_WRITE_TIMEOUT_S = 10.0


class CancelSafeYamux(Yamux):
    async def _write_frame(self, data: bytes) -> None:
        async with self._write_lock:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(FRAME_WRITE_TIMEOUT_S) as stuck:
                    await self.secured_conn.write(data)
                if stuck.cancelled_caught:
                    log.info(
                        "closing the connection to %s: a frame write took over %.0f s",
                        self.peer_id,
                        FRAME_WRITE_TIMEOUT_S,
                    )
                    with trio.move_on_after(1):
                        await self.secured_conn.close()
                    raise ConnectionClosedError("a frame write stalled; connection closed")
        await trio.lowlevel.checkpoint()


class _Muxers(MuxerMultistream):
    """Builds the negotiated muxer from its options (0.8.1 builds a plain ``Yamux`` whatever the
    options name)."""

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        protocol, muxer_class = await self._selector.select(
            conn, conn.is_initiator, self.negotiate_timeout
        )
        return self._annotate_connection(muxer_class(conn, peer_id), conn, protocol)


def use_cancel_safe_yamux(host: IHost) -> None:
    """Make every connection ``host`` upgrades from now on run ``CancelSafeYamux`` (mplex stays
    the fallback for peers without yamux, as in libp2p's default)."""
    upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
    upgrader.muxer_multistream = _Muxers(
        {TProtocol(YAMUX_PROTOCOL_ID): CancelSafeYamux, TProtocol(MPLEX_PROTOCOL_ID): Mplex},
        upgrader.muxer_multistream.negotiate_timeout,
    )
