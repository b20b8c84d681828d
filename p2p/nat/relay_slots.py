"""Relay slots of a private peer, kept for the whole run: the driver of ``p2p.nat.reservations``.

``RelaySlots.reserve`` makes the first reservation on a relay (the caller awaits it); ``keep``
runs in ``NatService``'s nursery for the node's life. Every ``watch_interval_s`` it looks whether
our connection to each relay is still open, tells the keeper, and sends a RESERVE (each in its
own task, so watching goes on meanwhile) to the relays the keeper says are due: refreshes at 2/3
of the granted TTL, re-reservations after the connection closed (the relay restarted, or a NAT
mapping timed out), retries with backoff. It makes no decision of its own.

A RESERVE is one stream and one round trip on the open connection to the relay, which extends
a held reservation or makes a new one if the relay forgot us (0.8.1's hop answers OK either way).
"""

from __future__ import annotations

import logging
import time

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

from p2p.errors import P2PError, PeerUnreachable
from p2p.host import Host, connection_kind
from p2p.nat.reachability import parse_tcp_addr
from p2p.nat.reservations import KeeperStatistics, ReservationKeeper, ReservationPolicy, SlotState

log = logging.getLogger(__name__)


class KeptCircuitTransport(CircuitV2Transport):
    """The circuit v2 transport without 0.8.1's reservation refresher, which ``RelaySlots``
    replaces (``p2p.nat.reservations`` says what the refresher got wrong)."""

    async def _refresh_reservations_worker(self) -> None:
        return


class RelaySlots:
    def __init__(
        self,
        host: Host,
        transport: CircuitV2Transport,
        policy: ReservationPolicy,
        *,
        attempt_timeout_s: float,
        watch_interval_s: float,
    ) -> None:
        self.host = host
        self._transport = transport
        self._keeper: ReservationKeeper[ID] = ReservationKeeper(policy)
        self._infos: dict[ID, PeerInfo] = {}
        self._circuits: dict[ID, multiaddr.Multiaddr] = {}
        self._attempt_timeout_s = attempt_timeout_s
        self._watch_interval_s = watch_interval_s

    async def reserve(self, relay: PeerInfo, nursery: trio.Nursery) -> multiaddr.Multiaddr:
        """Keep a slot on ``relay``, reserving it now. Returns our circuit address through it.
        Raises ``PeerUnreachable``; ``keep`` retries a failed relay after its backoff."""
        self._infos[relay.peer_id] = relay
        if not self._keeper.begin(relay.peer_id, trio.current_time()):
            raise PeerUnreachable(f"a reservation on {relay.peer_id} is already under way")
        return await self._attempt(relay.peer_id, nursery)

    async def keep(self) -> None:
        """Refresh and re-make the slots, for ever (ends by cancellation)."""
        raw = self.host.libp2p
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                for relay_id in list(self._infos):
                    connected = connection_kind(raw, relay_id) is not None
                    before = self._keeper.statistics().losses
                    self._keeper.observe_connection(relay_id, connected, now)
                    if self._keeper.statistics().losses > before:
                        log.warning("connection to relay %s closed; reserving again", relay_id)
                for relay_id in self._keeper.due(now):
                    # Each attempt in its own task: the connections stay watched while one runs
                    # (a relay that restarts during a refresh is a lost slot, not a refresh).
                    nursery.start_soon(self._attempt_logged, relay_id, nursery)
                next_due = self._keeper.next_due()
                wait_s = self._watch_interval_s
                if next_due is not None:
                    wait_s = min(wait_s, max(0.0, next_due - trio.current_time()))
                await trio.sleep(wait_s)

    def circuit_addrs(self) -> list[multiaddr.Multiaddr]:
        """One ``/p2p-circuit`` address per relay we keep a slot on (held, or being made again:
        the address stays the same), without relays the keeper only tries now and then."""
        return [self._circuits[r] for r in self.relays()]

    def relays(self) -> list[ID]:
        kept = []
        for relay_id in self._circuits:
            slot = self._keeper.slot(relay_id)
            if slot is not None and slot.state is not SlotState.DORMANT:
                kept.append(relay_id)
        return kept

    def statistics(self) -> KeeperStatistics:
        return self._keeper.statistics()

    def _how(self, relay_id: ID) -> str:
        slot = self._keeper.slot(relay_id)
        return "unknown relay" if slot is None else f"{slot.failures} in a row, {slot.state.value}"

    async def _attempt_logged(self, relay_id: ID, nursery: trio.Nursery) -> None:
        try:
            await self._attempt(relay_id, nursery)
        except P2PError as exc:
            log.warning("no relay slot on %s: %s (%s)", relay_id, exc, self._how(relay_id))

    async def _attempt(self, relay_id: ID, nursery: trio.Nursery) -> multiaddr.Multiaddr:
        """One bounded RESERVE on a relay the keeper handed out; reports the outcome to it."""
        try:
            circuit, ttl_s = await self._reserve_once(self._infos[relay_id], nursery)
        except BaseException as exc:
            # Cancelled included: the keeper must never be left waiting for this attempt.
            self._keeper.failed(relay_id, trio.current_time(), repr(exc))
            raise
        self._keeper.reserved(relay_id, ttl_s, trio.current_time())
        self._circuits[relay_id] = circuit
        return circuit

    async def _reserve_once(
        self, relay: PeerInfo, nursery: trio.Nursery
    ) -> tuple[multiaddr.Multiaddr, float]:
        # The keeper spaces the attempts (1, 2, 4 ... 60 s), not 0.8.1's 60 s negative cache.
        await self.host.connect(relay.peer_id, relay.addrs, own_backoff=True)
        known = self.host.libp2p.get_peerstore().addrs(relay.peer_id)
        relay_addr = next(
            (
                a
                for a in [*known, *relay.addrs]
                if parse_tcp_addr(str(a)) is not None and "/p2p-circuit" not in str(a)
            ),
            None,
        )
        if relay_addr is None:
            raise PeerUnreachable(f"relay {relay.peer_id} has no TCP address to publish")
        try:
            with trio.fail_after(self._attempt_timeout_s):
                stream = await self.host.open_stream(relay.peer_id, HOP_PROTOCOL)
                try:
                    # The nursery is where 0.8.1 would start its refresher (ours never runs).
                    ok = await self._transport.reserve(stream, relay.peer_id, nursery)
                finally:
                    with trio.move_on_after(1):
                        await stream.close()
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"reservation on {relay.peer_id} timed out") from exc
        if not ok:
            raise PeerUnreachable(f"relay {relay.peer_id} refused a reservation")
        # 0.8.1 keeps the relay's expiry (its wall clock, whole seconds); the keeper runs on
        # ours, so only the TTL crosses over.
        ttl_s = float(self._transport._reservations.get(relay.peer_id, 0)) - time.time()
        base = str(relay_addr).split("/p2p/")[0]
        circuit = multiaddr.Multiaddr(
            f"{base}/p2p/{relay.peer_id.to_base58()}"
            f"/p2p-circuit/p2p/{self.host.peer_id.to_base58()}"
        )
        log.info("reserved a relay slot for %.0f s: %s", ttl_s, circuit)
        return circuit, ttl_s
