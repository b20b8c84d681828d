"""The circuit relay v2 protocol of 0.8.1 with a data pump that ends only its own circuit.

0.8.1 keeps one ``_active_relays`` entry per peer id, and when either direction of a circuit
ends its pump closes the streams of whatever entry that peer id holds *then*. A second circuit
to the same peer (another source dialing it, or the same source redialing while the first
circuit's teardown is under way) was killed when the first one ended: the second source's
security handshake or its next read met a closed stream. Seen in CI as a private peer that
could not be pinged through its relay right after the previous connection was closed, and
deterministic with two sources: the first to hang up cut the other off.

Its pump also retried a failed read (0.2 s, then 0.4 s) with an ERROR line each time, though a
reset or closed stream never yields data again; that kept dead circuits, and their table
entries, alive for most of a second and filled the logs of a busy relay. And it looked at the
circuit's duration only when data arrived, so an idle circuit outlived its limit for ever.
"""

from __future__ import annotations

import contextlib
import logging
import time

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.tools.constants import MAX_READ_LEN

log = logging.getLogger(__name__)


class CircuitRelay(CircuitV2Protocol):
    async def _relay_data(
        self,
        src_stream: INetStream,
        dst_stream: INetStream,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        """Copy ``src_stream`` to ``dst_stream`` until either ends, the circuit's duration
        (``deadline``, monotonic) lapses or its data budget, shared by both directions in
        ``circuit_data_limit``, runs out; then close this circuit's two streams and no other."""
        until = trio.current_time() + (deadline - time.monotonic()) if deadline else float("inf")
        over_limit = False
        try:
            with trio.move_on_at(until) as duration:
                while True:
                    try:
                        data = await src_stream.read(MAX_READ_LEN)
                    except Exception:  # reset, closed, connection lost: this direction is over
                        break
                    if not data:
                        break
                    if circuit_data_limit is not None:
                        if len(data) > circuit_data_limit[0]:
                            over_limit = True
                            break
                        circuit_data_limit[0] -= len(data)
                    with trio.move_on_after(self.write_timeout) as write:
                        try:
                            await dst_stream.write(data)
                        except Exception:
                            break
                    if write.cancelled_caught:
                        break
            if duration.cancelled_caught or over_limit:
                # The spec's answer to a lapsed limit is a reset of both ends: a status message
                # written into a relayed stream would reach the other side's encryption as data.
                log.info(
                    "circuit with %s reached its %s limit",
                    peer_id,
                    "data" if over_limit else "duration",
                )
                for stream in (src_stream, dst_stream):
                    with contextlib.suppress(Exception):  # already gone: nothing to tell it
                        await stream.reset()
        finally:
            await self._close_stream(src_stream)
            await self._close_stream(dst_stream)
            entry = self._active_relays.get(peer_id)
            if entry is not None and (src_stream in entry or dst_stream in entry):
                del self._active_relays[peer_id]
