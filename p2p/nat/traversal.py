"""NAT traversal on py-libp2p 0.8.1: dial-back reachability, circuit relay v2, DCUtR, UPnP.

``NatService(host, config)`` is one service in the node's nursery (``await nursery.start(nat.run)``)
that owns, on the host:

- the dial-back server (``/swarmtrain/dialback/1``, ``p2p.nat.dialback``: it dials the asker back
  from a throwaway host), and ``check_reachability``, which asks helpers for that dial-back;
- circuit relay v2: the hop role with limits when ``config.relay_hop`` (public peers), the stop
  role always (so anyone can be reached through a relay), reservations on relays for private
  peers (``reserve``), and the ``/p2p-circuit`` addresses those give (``circuit_addrs``). 0.8.1
  does not add them to ``get_addrs()``: publish them in the peer's DHT record;
- DCUtR hole punching (``libp2p.relay.circuit_v2.dcutr``), used by ``connect``: direct first, then
  through a relay, then an upgrade of the relayed connection to a direct one. The connections
  a punch makes, at either end, are marked on the host (``Host.punching``), so
  ``connection_kind`` tells them (``punched``) from dialed ones.

UPnP port mapping is libp2p's (``HostConfig.enable_upnp``; off by default, off in the lab where no
gateway answers); ``upnp_status`` reports what it achieved.

Measured in the namespace lab (tests/natlab), 0.8.1, TCP: a relayed dial takes 60-130 ms; DCUtR
between two port-restricted cone NATs succeeds on the first round in about 0.35 s (it binds the
punch dials to the listen port, which is SO_REUSEPORT, and advertises WAN_IP:listen_port, which
port-preserving NATs honour), and the direct connection is then preferred for new streams;
against a symmetric NAT every round fails and 0.8.1 gives up after about 21 s, so ``connect``
bounds the wait (``holepunch_timeout_s``) and keeps the relayed connection. The per-peer
connection limit of 1 (``p2p.host``) does not stop the punched connection from being added
beside the relayed one. End to end, ``connect`` from a cone-NATed peer to another one reaches a
direct connection in about 1 s (0.5 s head start for plain addresses, ~0.1 s relayed dial,
~0.35 s punch); to a peer behind a symmetric NAT it returns relayed after the 8 s punch budget.
Dial-back verdicts: about 10 ms for a public peer, the 3 s dial timeout for a private one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from p2p.errors import P2PError, PeerUnreachable
from p2p.host import ConnectionKind, Host, is_direct_kind, is_relayed
from p2p.nat.dialback import ask_for_dialbacks, serve_dialback
from p2p.nat.reachability import (
    DIALBACK_PROTOCOL,
    Reachability,
    ReachabilityVerdict,
    decide_reachability,
    dialback_candidates,
)
from p2p.nat.relay_hop import CircuitRelay
from p2p.nat.relay_slots import KeptCircuitTransport, RelaySlots
from p2p.nat.reservations import KeeperStatistics, ReservationPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayServiceLimits:
    """What a public peer grants others through its relay (circuit relay v2 hop)."""

    circuit_duration_s: int = 3600
    circuit_data_bytes: int = 1 << 30
    max_circuits_per_reservation: int = 16
    max_reservations: int = 128
    reservation_ttl_s: int = 3600


@dataclass(frozen=True)
class NatConfig:
    # Offer the circuit relay v2 hop role (public peers; `swarmtrain relay` and the coordinator).
    relay_hop: bool = False
    relay_limits: RelayServiceLimits = field(default_factory=RelayServiceLimits)
    # Answer other peers' dial-back requests (costs one outbound dial per request address).
    dialback_server: bool = True
    dialback_dial_timeout_s: float = 3.0
    dialback_max_concurrent: int = 4
    direct_dial_timeout_s: float = 3.0
    # How long plain addresses get before circuit addresses are dialed too (a public peer
    # answers in milliseconds; a NATed one never does).
    direct_head_start_s: float = 0.5
    relay_dial_timeout_s: float = 10.0
    # DCUtR: upgrade relayed connections to direct ones. 0.8.1 needs ~0.35 s when it works and
    # gives up after ~21 s when it cannot (symmetric NAT); connect() waits at most this long.
    holepunch: bool = True
    holepunch_timeout_s: float = 8.0
    # Relay slots of a private peer: when to refresh and re-make them (p2p.nat.reservations), and
    # how often the keeper looks at its connections to the relays (a dict lookup per relay).
    reservations: ReservationPolicy = field(default_factory=ReservationPolicy)
    relay_watch_interval_s: float = 1.0


# --------------------------------------------------------------------------- connection kinds


def stream_kind(stream: INetStream) -> Literal["direct", "relayed"]:
    """Whether this stream runs over a relayed or a direct connection (dialed or punched: the
    path, which is what a data connection's choice depends on)."""
    return "relayed" if is_relayed(stream.muxed_conn) else "direct"


def is_circuit_addr(addr: multiaddr.Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(addr)


def _without_p2p(addr: multiaddr.Multiaddr) -> str:
    text = str(addr)
    return text.split("/p2p/")[0] if "/p2p/" in text and not is_circuit_addr(text) else text


def observed_addrs(host: IHost) -> list[multiaddr.Multiaddr]:
    """Addresses other peers told us (identify) they see us at; unconfirmed ones included,
    since a NATed peer usually has exactly one observer: its relay."""
    manager = getattr(host, "_observed_addr_manager", None)
    if manager is None:
        return []
    try:
        return [a for a in manager.addrs(min_observers=1) if not is_circuit_addr(a)]
    except Exception as exc:
        log.debug("observed addresses unavailable: %r", exc)
        return []


def upnp_status(host: IHost | Host) -> dict[str, object]:
    """Whether UPnP is on and which external IP a gateway gave (None: no gateway answered)."""
    raw = host.libp2p if isinstance(host, Host) else host
    manager = getattr(raw, "upnp", None)
    if manager is None:
        return {"enabled": False, "external_ip": None}
    try:
        return {"enabled": True, "external_ip": manager.get_external_ip()}
    except Exception:
        return {"enabled": True, "external_ip": None}


class _DialerDrivenDCUtR(DCUtRProtocol):
    """DCUtR where only ``connect()`` (the side that dialed through the relay) starts a punch.

    0.8.1 also auto-starts a punch from *both* ends of every relayed connection every 2 s. Two
    sessions for one pair dial the same 4-tuple from the same SO_REUSEPORT listen port, and the
    second bind fails with EADDRNOTAVAIL; measured: 1 punch in 12 between two cone NATs failed
    that way, under load. Inbound sessions are still answered.

    Both ends' dial rounds (the initiator's from ``initiate_hole_punch``, the responder's from
    its stream handler) run inside ``Host.punching``: the connection they make, dialed, merged
    by simultaneous open or accepted, is recorded as punched.
    """

    def __init__(self, host: Host) -> None:
        super().__init__(host.libp2p)
        self._our_host = host

    async def _auto_drive_loop(self) -> None:
        await trio.sleep_forever()

    async def _perform_hole_punch(
        self, peer_id: ID, addrs: list[multiaddr.Multiaddr], as_responder: bool = False
    ) -> bool:
        with self._our_host.punching(peer_id):
            return await super()._perform_hole_punch(peer_id, addrs, as_responder)


# --------------------------------------------------------------------------- the service


@dataclass
class _DialReport:
    """What the dials of one ``connect`` met: an error per address tried, and whether any of
    them stayed silent (a timeout) rather than answering with a refusal."""

    errors: list[str] = field(default_factory=list)
    silent: bool = False

    def no_answer(self, error: str) -> None:
        self.errors.append(error)
        self.silent = True


class NatService:
    """Reachability, relaying and hole punching for one host. Run with ``nursery.start(run)``."""

    def __init__(self, host: Host, config: NatConfig | None = None) -> None:
        self.host = host
        self.config = config or NatConfig()
        raw = host.libp2p
        limits = self.config.relay_limits
        self._relay_limits = RelayLimits(
            duration=limits.circuit_duration_s,
            data=limits.circuit_data_bytes,
            max_circuit_conns=limits.max_circuits_per_reservation,
            max_reservations=limits.max_reservations,
            reservation_ttl=limits.reservation_ttl_s,
        )
        roles = RelayRole.STOP | RelayRole.CLIENT
        if self.config.relay_hop:
            roles |= RelayRole.HOP
        self._relay_protocol = CircuitRelay(
            raw, limits=self._relay_limits, allow_hop=self.config.relay_hop
        )
        self._transport = KeptCircuitTransport(
            raw, self._relay_protocol, RelayConfig(roles=roles, limits=self._relay_limits)
        )
        self._dcutr = _DialerDrivenDCUtR(host) if self.config.holepunch else None
        self._slots = RelaySlots(
            host,
            self._transport,
            self.config.reservations,
            attempt_timeout_s=self.config.relay_dial_timeout_s,
            watch_interval_s=self.config.relay_watch_interval_s,
        )
        self._dialback_slots = trio.Semaphore(self.config.dialback_max_concurrent)
        self._nursery: trio.Nursery | None = None
        self.last_verdict: ReachabilityVerdict | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._slots.keep)
            async with background_trio_service(self._relay_protocol):
                with trio.fail_after(10):
                    await self._relay_protocol.event_started.wait()
                if self.config.dialback_server:
                    self.host.set_handler(DIALBACK_PROTOCOL, self._serve_dialback)
                if self._dcutr is None:
                    task_status.started()
                    await trio.sleep_forever()
                async with background_trio_service(self._dcutr):
                    with trio.fail_after(10):
                        await self._dcutr.event_started.wait()
                    task_status.started()
                    await trio.sleep_forever()

    # ------------------------------------------------------------------ reachability

    async def check_reachability(
        self, helpers: Sequence[ID], *, min_confirmations: int = 1
    ) -> ReachabilityVerdict:
        """Ask each helper (concurrently) to dial us back over a fresh connection; decide.

        Never raises for a helper's failure: that helper's report carries the error.
        """
        # Host.addrs(), not get_addrs(): it expands a wildcard listen address (the default
        # command line's 0.0.0.0/tcp/0) to our interfaces' addresses, each carrying our listen
        # port. Unexpanded, 0.0.0.0 was dropped and the helper was left with our observed
        # address, the source port of our connection to it: a public host was found private.
        candidates = dialback_candidates(
            [_without_p2p(a) for a in self.host.addrs()],
            [str(a) for a in observed_addrs(self.host.libp2p)],
        )
        reports = await ask_for_dialbacks(
            self.host,
            helpers,
            candidates,
            deadline_s=self.config.dialback_dial_timeout_s + 5.0,
        )
        verdict = decide_reachability(reports, min_confirmations=min_confirmations)
        log.info("reachability %s: %s", verdict.status.value, verdict.reason)
        self.last_verdict = verdict
        return verdict

    async def _serve_dialback(self, stream: INetStream) -> None:
        await serve_dialback(stream, self._dialback_slots, self.config.dialback_dial_timeout_s)

    # ------------------------------------------------------------------ relays

    async def reserve(self, relay: PeerInfo) -> multiaddr.Multiaddr:
        """Reserve a slot on ``relay`` and keep it from now on: refreshed before its TTL runs
        out, re-made when our connection to the relay closes (``p2p.nat.relay_slots``). Returns our
        circuit address through it. Raises ``PeerUnreachable`` (the slot is retried anyway)."""
        assert self._nursery is not None, "NatService.run() is not running"
        return await self._slots.reserve(relay, self._nursery)

    def circuit_addrs(self) -> list[multiaddr.Multiaddr]:
        """Our ``/p2p-circuit`` addresses, one per relay we keep a slot on."""
        return self._slots.circuit_addrs()

    def relays(self) -> list[ID]:
        return self._slots.relays()

    def reservation_statistics(self) -> KeeperStatistics:
        return self._slots.statistics()

    # ------------------------------------------------------------------ connect ladder

    async def connect(
        self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr], *, wait_direct: bool = True
    ) -> ConnectionKind:
        """Connect to ``peer_id``: directly at its plain addresses, else through a relay at its
        ``/p2p-circuit`` addresses, then try to upgrade a relayed connection with DCUtR (waiting
        up to ``holepunch_timeout_s`` when ``wait_direct``, else in the background).

        Returns the kind of connection we end up with. Raises ``PeerUnreachable``.
        """
        kind = self.host.connection_kind(peer_id)
        report = _DialReport()
        if kind is None:
            await self._race_direct_and_relayed(peer_id, addrs, report)
            kind = self.host.connection_kind(peer_id)
        if kind is None:
            raise PeerUnreachable(
                f"cannot reach {peer_id}: " + ("; ".join(report.errors) or "no addresses"),
                refused=bool(report.errors) and not report.silent,
            )
        log.debug("connected to %s: %s (%s)", peer_id, kind, "; ".join(report.errors))
        if kind == "relayed" and self._dcutr is not None:
            if wait_direct:
                await self.upgrade(peer_id)
            elif self._nursery is not None:
                self._nursery.start_soon(self.upgrade, peer_id)
        return self.host.connection_kind(peer_id) or kind

    async def _race_direct_and_relayed(
        self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr], report: _DialReport
    ) -> None:
        """Dial the plain addresses; after ``direct_head_start_s`` without a connection, also
        dial the circuit addresses (happy-eyeballs style). The first connection cancels the
        rest. Measured: 0.8.1's connect to an unroutable LAN address of a peer behind another NAT
        neither fails nor succeeds within 3 s, so waiting for it first cost 3 s per connect."""
        direct = [a for a in addrs if not is_circuit_addr(a)]
        circuits = [a for a in addrs if is_circuit_addr(a)]
        network = self.host.libp2p.get_network()

        async with trio.open_nursery() as nursery:

            async def dial_direct() -> None:
                timeout_s = self.config.direct_dial_timeout_s
                with trio.move_on_after(timeout_s) as dial:
                    try:
                        await self.host.libp2p.connect(PeerInfo(peer_id, direct))
                    except Exception as exc:
                        report.errors.append(f"direct: {exc}")
                if dial.cancelled_caught:
                    report.no_answer(f"direct: no answer in {timeout_s} s")
                if network.get_connections(peer_id):
                    nursery.cancel_scope.cancel()

            async def dial_relayed() -> None:
                if direct:
                    await trio.sleep(self.config.direct_head_start_s)
                for circuit in circuits:
                    timeout_s = self.config.relay_dial_timeout_s
                    with trio.move_on_after(timeout_s) as dial:
                        try:
                            await self._transport.dial(circuit)
                        except Exception as exc:
                            report.errors.append(f"relay {circuit}: {exc}")
                    if dial.cancelled_caught:
                        report.no_answer(f"relay {circuit}: no answer in {timeout_s} s")
                    if network.get_connections(peer_id):
                        nursery.cancel_scope.cancel()
                        return

            if direct:
                nursery.start_soon(dial_direct)
            if circuits:
                nursery.start_soon(dial_relayed)
        if direct and not is_direct_kind(self.host.connection_kind(peer_id)):
            # Forget the plain addresses that did not answer: DCUtR's first step re-dials every
            # plain address in the peerstore (10 s budget, swarm retries with backoff), which
            # measured 8+ s here and used up the whole hole-punch window.
            if not any(e.startswith("direct:") for e in report.errors):
                report.no_answer(
                    "direct: no connection (the relayed one came first, or it closed at once)"
                )
            self.host.libp2p.get_peerstore().clear_addrs(peer_id)

    async def upgrade(self, peer_id: ID) -> bool:
        """Try to turn a relayed connection into a direct one (DCUtR); bounded; never raises."""
        if self._dcutr is None:
            return False
        with trio.move_on_after(self.config.holepunch_timeout_s):
            try:
                await self._dcutr.initiate_hole_punch(peer_id)
            except Exception as exc:
                log.info("hole punch to %s failed: %r", peer_id, exc)
        direct = is_direct_kind(self.host.connection_kind(peer_id))
        log.info("connection to %s is %s", peer_id, "direct" if direct else "still relayed")
        return direct


# --------------------------------------------------------------------------- node composition


async def establish(nat: NatService, helpers: Sequence[PeerInfo]) -> ReachabilityVerdict:
    """What a joining node does once connected to its bootstrap peers: ask them for a dial-back,
    and when we are not public, reserve a slot on each of them (they are relays). A relay that
    refuses is logged and skipped; never raises for one helper's failure."""
    verdict = await nat.check_reachability([h.peer_id for h in helpers])
    if verdict.status is not Reachability.PUBLIC:
        for helper in helpers:
            try:
                await nat.reserve(helper)
            except P2PError as exc:
                log.warning("no relay slot on %s: %s", helper.peer_id, exc)
    return verdict


def advertised_addrs(host: Host, nat: NatService) -> list[multiaddr.Multiaddr]:
    """What to publish in our DHT record: our plain addresses (without ``/p2p/``; a LAN neighbour
    may reach them, and ``connect`` drops them quickly when they fail), then our circuit addresses
    (0.8.1 does not list them in ``get_addrs()``)."""
    plain = [multiaddr.Multiaddr(_without_p2p(a)) for a in host.addrs() if not is_circuit_addr(a)]
    return [*plain, *nat.circuit_addrs()]
