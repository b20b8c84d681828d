"""Inbound connections that give their slot back when they close.

py-libp2p 0.8.1's ``Swarm._handle_inbound_connection`` takes one token of ``_inbound_limiter``
(``max_connections - min_connections`` tokens) per accepted TCP connection and returns it when
``_do_handle_inbound_connection`` returns. That function upgrades the connection (Noise, yamux)
and then waits for ``manager.wait_finished()``, the *host's* end, as a barrier that keeps the
accepted socket open (trio closes a served socket when its handler returns). A connection that
closes therefore keeps its token: after ``max_connections`` inbound connections, closed or not,
every further dial is refused for good while the process looks alive (seen: a relay dead after its
257th connection; tests/integration/test_host.py reproduces it).

Here the handler waits for *its own* connection to close instead: the ``SwarmConn`` that
``add_conn`` registered for the upgraded muxed connection sets ``event_closed`` when the peer or
we close it, and the host's shutdown cancels the wait as before. Everything else (the connection
gate, the upgrade with its timeout and resource scopes, closing the raw connection on a failure)
is 0.8.1's code path, called as is. The limit on connections open at once is unchanged: the token
is held exactly as long as the connection is open.
"""

from __future__ import annotations

import logging
from typing import Any

from libp2p.abc import IMuxedConn
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.swarm import Swarm

log = logging.getLogger(__name__)


def return_slots_on_close(swarm: Swarm) -> None:
    """Make ``swarm`` hold an inbound slot only while its connection is open."""
    original = swarm._do_handle_inbound_connection

    async def handle(read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        if isinstance(read_write_closer, IMuxedConn):
            # Pre-multiplexed transports (QUIC): not used by us; 0.8.1's path as is.
            await original(read_write_closer, maddr, failure_event)
            return
        remote = swarm._build_remote_multiaddr(read_write_closer)
        if remote is not None and not await swarm.connection_gate.is_allowed(remote):
            await _close(read_write_closer)
            return
        raw_conn = RawConnection(read_write_closer, False)
        try:
            muxed_conn = await swarm.upgrade_inbound_raw_conn(raw_conn, maddr)
        except Exception as exc:
            log.debug("inbound connection from %s failed its upgrade: %r", remote, exc)
            await _close(raw_conn)
            return
        await wait_closed(swarm, muxed_conn)

    swarm._do_handle_inbound_connection = handle  # type: ignore[method-assign]


async def wait_closed(swarm: Swarm, muxed_conn: IMuxedConn) -> None:
    """Return once the swarm connection built on ``muxed_conn`` has closed (at once when the
    swarm did not keep it: a duplicate, or one closed before it was registered)."""
    peer_id = getattr(muxed_conn, "peer_id", None)
    conns = swarm.get_connections(peer_id) if peer_id is not None else []
    for conn in conns:
        if getattr(conn, "muxed_conn", None) is muxed_conn:
            await conn.event_closed.wait()
            return


async def _close(closer: Any) -> None:
    try:
        await closer.close()
    except Exception as exc:
        log.debug("closing a refused inbound connection failed: %r", exc)
