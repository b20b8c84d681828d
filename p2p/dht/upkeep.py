"""Routing-table upkeep: departed peers leave the table within seconds.

py-libp2p 0.8.1 drops a table entry only when its bucket is full and the oldest entry fails a
ping. A bootstrap peer or relay that outlives its visitors therefore keeps every departed peer and
names them in its answers; a newcomer's lookup spends its rounds on dead peers and never reaches
the live ones closest to a key, so two live peers store and read one key at different replicas
(seen in CI: a 4-peer round split after one relay had seen 60 peers of earlier tests come and go;
the newcomer stored its declaration at the relay, the others read at each other).

Three signals remove an entry (go-libp2p-kad-dht removes a peer on a query's dial failure and
evicts, in its refresh, peers that fail a liveness check; this follows it):

* ``forget``: our own request could not open a stream to it (``Dht`` calls it);
* its last connection to us closed: ``CHECK_DELAY_S`` later, unless it connected again, we dial
  it once; refused or silent within ``timeout_s``, it is removed. A process that exits closes its
  connections, so a relay hears of every departure that way;
* ``sweep`` (the DHT's refresh loop): entries we hold no connection to are dialed the same way,
  ``SWEEP_MAX`` a sweep, those checked least recently first; a departure whose connection had
  closed long before is found within a few refreshes.

A check is a dial; it never runs while the host holds more than ``BUSY_FRACTION`` of its
connection limit (the limit closes new connections at once, which would look like another
departure and start another check), and a peer found alive is not dialed again for ``RECHECK_S``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID

from p2p.errors import P2PError

if TYPE_CHECKING:
    from multiaddr import Multiaddr

    from p2p.host import Host

log = logging.getLogger(__name__)

CHECK_DELAY_S = 1.0
RECHECK_S = 60.0
SWEEP_MAX = 32
CHECKS_AT_ONCE = 8
BUSY_FRACTION = 0.8


class TableUpkeep:
    """Removes departed peers from ``table`` (0.8.1's ``RoutingTable``) of a DHT on ``host``.

    ``start(nursery)`` begins watching connections; ``forget``, ``check`` and ``sweep`` are the
    DHT's to call. ``on_forget(peer)`` runs for each removal (the DHT drops what it keeps per
    peer); ``forgotten`` counts removals.
    """

    def __init__(
        self,
        host: Host,
        table: Any,
        *,
        timeout_s: float,
        on_forget: Callable[[ID], None] | None = None,
    ) -> None:
        self._host = host
        self._on_forget = on_forget
        self._table = table
        self._timeout_s = timeout_s
        self._nursery: trio.Nursery | None = None
        self._checking: set[ID] = set()
        self._alive_at: dict[ID, float] = {}
        self._limiter = trio.CapacityLimiter(CHECKS_AT_ONCE)
        self.forgotten = 0

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._host.libp2p.get_network().register_notifee(_Departures(self))

    def stop(self) -> None:
        self._nursery = None

    def forget(self, peer: ID, why: str) -> None:
        self._alive_at.pop(peer, None)
        if self._table.remove_peer(peer):
            self.forgotten += 1
            log.debug("routing table: removed %s (%s)", peer, why)
        if self._on_forget is not None:
            self._on_forget(peer)

    def on_departure(self, peer: ID) -> None:
        if (
            self._nursery is not None
            and self._table.peer_in_table(peer)
            and self._host.connection_kind(peer) is None
        ):
            self._nursery.start_soon(self._check_later, peer)

    async def _check_later(self, peer: ID) -> None:
        await trio.sleep(CHECK_DELAY_S)
        await self.check(peer)

    async def check(self, peer: ID) -> None:
        """Dial ``peer`` unless connected, checked alive lately, or the host is busy; remove it
        from the table if the dial fails."""
        now = trio.current_time()
        if (
            peer in self._checking
            or not self._table.peer_in_table(peer)
            or self._host.connection_kind(peer) is not None
            or now - self._alive_at.get(peer, -RECHECK_S) < RECHECK_S
            or self._busy()
        ):
            return
        self._checking.add(peer)
        try:
            async with self._limiter:
                why = await self._dial(peer)
        finally:
            self._checking.discard(peer)
        if why:
            self.forget(peer, why)
        else:
            self._alive_at[peer] = trio.current_time()

    async def sweep(self) -> None:
        """Check up to ``SWEEP_MAX`` table entries we hold no connection to."""
        unconnected = [
            p for p in self._table.get_peer_ids() if self._host.connection_kind(p) is None
        ]
        unconnected.sort(key=lambda p: self._alive_at.get(p, -RECHECK_S))
        async with trio.open_nursery() as nursery:
            for peer in unconnected[:SWEEP_MAX]:
                nursery.start_soon(self.check, peer)
        for peer in [p for p in self._alive_at if not self._table.peer_in_table(p)]:
            del self._alive_at[peer]

    async def _dial(self, peer: ID) -> str:
        addrs = self._direct_addrs(peer)
        if not addrs:
            return "no address to dial"
        with trio.move_on_after(self._timeout_s):
            try:
                await self._host.connect(peer, addrs)
            except P2PError as exc:
                return str(exc)
            return ""
        return f"no answer in {self._timeout_s} s"

    def _direct_addrs(self, peer: ID) -> list[Multiaddr]:
        try:
            addrs = self._host.libp2p.get_peerstore().addrs(peer)
        except Exception:
            return []
        return [a for a in addrs if "/p2p-circuit" not in str(a)]

    def _busy(self) -> bool:
        network = self._host.libp2p.get_network()
        held = sum(len(conns) for conns in network.get_connections_map().values())
        return held >= BUSY_FRACTION * self._host.config.max_connections


class _Departures(INotifee):
    """Tells the upkeep when a peer's last connection to us closed."""

    def __init__(self, upkeep: TableUpkeep) -> None:
        self._upkeep = upkeep

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._upkeep.on_departure(conn.muxed_conn.peer_id)

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass
