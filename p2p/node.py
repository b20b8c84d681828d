"""A node: the host plus the services every swarmtrain peer runs, composed in one nursery.

``open_node(config)`` starts, in order: the host; the DHT (server side served at once); the ping
and dial-back services; for a ``relay`` node, the circuit relay v2 hop. It then joins through the
bootstrap peers, asks them to dial us back (reachability), reserves relay slots if we are private,
and publishes our addresses (``/p2p-circuit`` ones included) in our signed DHT record. The block
runs with everything up; leaving it (or cancellation) shuts all of it down.

``Node.reach(peer_id)`` finds a peer's addresses in the DHT and connects: direct first, then
through a relay, then tries to upgrade the relayed connection to a direct one (DCUtR).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from p2p.bulk.listener import BulkListener
from p2p.bulk.payload import receive_bulk, send_bulk
from p2p.bulk.transfer import BulkConfig, ReceiveBudget
from p2p.dht.kademlia import Dht, DhtConfig
from p2p.errors import P2PError, PeerUnreachable
from p2p.host import Host, HostConfig, is_direct_kind, open_host, reset_quietly
from p2p.loop_lag import watch_loop_lag
from p2p.nat.reachability import Reachability, ReachabilityVerdict
from p2p.nat.traversal import (
    NatConfig,
    NatService,
    advertised_addrs,
    establish,
    observed_addrs,
    stream_kind,
)
from p2p.rpc import RpcTimeout, call_unary, serve_unary
from p2p.wire import Message, message

log = logging.getLogger(__name__)

PING_PROTOCOL = "/swarmtrain/ping/1"
BULK_PROBE_PROTOCOL = "/swarmtrain/bulk-probe/2"  # 2: bulk control messages as p2p.wire types
MAX_BULK_PROBE_BYTES = 64 << 20
# A probe measures a link: one slower than 2 Mbit/s has told what it can.
PROBE_CONFIG = BulkConfig(
    max_bytes=MAX_BULK_PROBE_BYTES, min_rate_bytes_per_s=256 << 10, rate_grace_s=10.0
)
ADDR_RECORD_TTL_S = 600.0
REACH_RETRY_S = 0.25  # between the attempts of Node.reach(keep_trying_s=...)
T = TypeVar("T")


@message(20, max_bytes=128)
class PingRequest(Message):
    nonce: bytes


@message(21, max_bytes=128)
class PingReply(Message):
    nonce: bytes


@dataclass(frozen=True)
class NodeConfig:
    host: HostConfig
    role: Literal["relay", "peer"] = "peer"
    bootstrap: tuple[str, ...] = ()
    dht: DhtConfig = field(default_factory=DhtConfig)
    # None: derived from the role (a relay offers the circuit relay v2 hop).
    nat: NatConfig | None = None
    join_timeout_s: float = 20.0
    republish_interval_s: float = ADDR_RECORD_TTL_S / 2
    # The bulk data plane's TCP port (0: any free port; None: no listener). It is opened only on
    # a public node (or a relay): a NATed node dials out to its peers' listeners instead.
    bulk_port: int | None = 0


@dataclass(frozen=True)
class BulkProbeResult:
    mode: str  # "stream" (through the libp2p connection), "dial_receiver" or "dial_sender"
    mib_per_s: float


@dataclass(frozen=True)
class PingResult:
    peer_id: str
    ok: bool
    direct: bool | None
    rtt_ms: float | None
    error: str | None = None
    bulk: BulkProbeResult | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "peer_id": self.peer_id,
            "ok": self.ok,
            "direct": self.direct,
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
        }
        if self.bulk is not None:
            out["bulk_mode"] = self.bulk.mode
            out["bulk_MiBps"] = round(self.bulk.mib_per_s, 1)
        if self.error:
            out["error"] = self.error
        return out


class Node:
    def __init__(self, config: NodeConfig, host: Host, dht: Dht, nat: NatService) -> None:
        self.config = config
        self.host = host
        self.dht = dht
        self.nat = nat
        self.bootstrap_peers: list[PeerInfo] = []
        self.reachability = ReachabilityVerdict(Reachability.UNKNOWN, "not checked yet")
        self.bulk_listener: BulkListener | None = None
        # Anyone may offer a probe: a few at once, one per peer (each maps its bytes as they
        # arrive, so even these cost memory only at the pace the senders pay for).
        self.probe_budget = ReceiveBudget(
            max_bytes=4 * MAX_BULK_PROBE_BYTES,
            max_transfers=4,
            max_bytes_per_peer=MAX_BULK_PROBE_BYTES,
        )

    async def check_reachability(self, helpers: Sequence[PeerInfo]) -> ReachabilityVerdict:
        """Ask ``helpers`` to dial us back; if we are not public, reserve relay slots on them."""
        self.reachability = await establish(self.nat, helpers)
        return self.reachability

    def observed_addrs(self) -> list[multiaddr.Multiaddr]:
        """Our addresses as other peers see them (identify), NAT mappings included."""
        return observed_addrs(self.host.libp2p)

    def relay_addrs(self) -> list[multiaddr.Multiaddr]:
        """Our ``/p2p-circuit`` addresses, one per relay holding a slot for us."""
        return self.nat.circuit_addrs()

    async def _join(self) -> None:
        infos = []
        for addr in self.config.bootstrap:
            try:
                infos.append(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
            except Exception as exc:
                raise P2PError(f"bad --join address {addr!r}: {exc}") from exc
        self.bootstrap_peers = infos
        with trio.move_on_after(self.config.join_timeout_s) as scope:
            size = await self.dht.bootstrap(infos)
        if scope.cancelled_caught:
            raise PeerUnreachable(
                f"could not join through {', '.join(self.config.bootstrap)} "
                f"within {self.config.join_timeout_s:.0f} s"
            )
        log.info("joined the DHT: %d peers in the routing table", size)

    async def publish_addrs(self) -> int:
        """Sign and store our addresses, relay circuits included, under ``addrs/<peer id>``."""
        return await self.dht.publish_addrs(
            advertised_addrs(self.host, self.nat), time.time() + ADDR_RECORD_TTL_S
        )

    async def _republish_forever(self) -> None:
        while True:
            await trio.sleep(self.config.republish_interval_s)
            try:
                await self.publish_addrs()
            except P2PError as exc:
                log.warning("could not republish our addresses: %s", exc)

    async def find(self, peer_id: ID) -> list[multiaddr.Multiaddr]:
        known = (
            self.host.libp2p.get_peerstore().addrs(peer_id)
            if _has_addrs(self.host, peer_id)
            else []
        )
        found = await self.dht.find_addrs(peer_id)
        return list(dict.fromkeys([*found, *known]))

    async def reach(self, peer_id: ID, *, keep_trying_s: float = 0.0) -> None:
        """Connect to ``peer_id``: direct, else through a relay, then a DCUtR upgrade.

        With ``keep_trying_s``, an attempt that met silence (a dial that timed out, no address
        found) is tried again, with a fresh address lookup, until that many seconds have passed
        since the call: a peer that stalled for a moment, or whose connections just closed, is
        not given up at its first silent dial. One whose every address refused (its process is
        gone) is. An attempt already running when the time is up finishes. Raises
        ``PeerUnreachable`` naming what the last attempt tried.
        """
        await self._keep_trying(peer_id, keep_trying_s, lambda: self._reach_once(peer_id))

    async def open_stream(
        self, peer_id: ID, protocol: str, *, keep_trying_s: float = 0.0
    ) -> INetStream:
        """Reach ``peer_id`` and open a ``protocol`` stream to it, trying again as ``reach``
        does, also when the connection turns out dead at the stream's first frame (its peer
        closed it while our event loop was not running). Raises ``PeerUnreachable``."""

        async def attempt() -> INetStream:
            await self._reach_once(peer_id)
            return await self.host.open_stream(peer_id, protocol)

        return await self._keep_trying(peer_id, keep_trying_s, attempt)

    async def _keep_trying(
        self, peer_id: ID, keep_trying_s: float, attempt: Callable[[], Awaitable[T]]
    ) -> T:
        give_up = trio.current_time() + keep_trying_s
        attempts = 0
        while True:
            attempts += 1
            try:
                return await attempt()
            except PeerUnreachable as exc:
                if exc.refused or trio.current_time() + REACH_RETRY_S >= give_up:
                    if attempts > 1:
                        raise PeerUnreachable(
                            f"{exc} (attempt {attempts})", refused=exc.refused
                        ) from None
                    raise
                log.info("%s not reached yet (%s); trying again", peer_id, exc)
            await trio.sleep(REACH_RETRY_S)

    async def _reach_once(self, peer_id: ID) -> None:
        if self.host.connection_kind(peer_id) is not None:
            return
        addrs = await self.find(peer_id)
        if not addrs:
            raise PeerUnreachable(f"{peer_id} has no address in the DHT (is it online?)")
        await self.nat.connect(peer_id, addrs)

    def is_direct(self, peer_id: ID) -> bool:
        """Whether we reach ``peer_id`` without a relay (a dialed or a punched connection)."""
        return is_direct_kind(self.host.connection_kind(peer_id))

    async def measure_bulk(
        self, peer_id: ID, nbytes: int, *, deadline_s: float = 60.0
    ) -> BulkProbeResult:
        """Send ``nbytes`` over the bulk data plane to ``peer_id``: how the bytes went (a data
        connection dialed to a listener or punched between two NATed peers, or the libp2p stream
        when relayed or the punch failed) and at what rate. Raises ``P2PError``."""
        await self.reach(peer_id)
        payload = os.urandom(min(nbytes, MAX_BULK_PROBE_BYTES))
        with trio.fail_after(deadline_s):
            stream = await self.host.open_stream(peer_id, BULK_PROBE_PROTOCOL)
            try:
                start = time.perf_counter()
                # The stream's own connection decides: a relayed one's remote address is not the
                # peer's, so neither a dial nor a punch may aim at it.
                direct = stream_kind(stream) == "direct"
                mode = await send_bulk(stream, payload, direct=direct, listener=self.bulk_listener)
                seconds = time.perf_counter() - start
            finally:
                await reset_quietly(stream)
        return BulkProbeResult(mode.name.lower(), len(payload) / (1 << 20) / seconds)

    async def _serve_bulk_probe(self, stream: INetStream) -> None:
        await receive_bulk(
            stream,
            direct=stream_kind(stream) == "direct",
            listener=self.bulk_listener,
            config=PROBE_CONFIG,
            budget=self.probe_budget,
        )
        with trio.move_on_after(2):
            await stream.close()

    async def _start_bulk_listener(self, nursery: trio.Nursery) -> None:
        if self.config.bulk_port is None:
            return
        public = self.reachability.status is Reachability.PUBLIC
        if not public and self.config.role != "relay":
            log.info("not public: bulk transfers dial out to peers (no bulk listener)")
            return
        ip = _listen_ip(self.config.host.listen_addrs)
        listener = BulkListener(ip, self.config.bulk_port)
        await nursery.start(listener.run)
        self.bulk_listener = listener

    async def ping(
        self,
        peer_id: ID,
        *,
        rounds: int = 3,
        deadline_s: float = 10.0,
        keep_trying_s: float = 0.0,
    ) -> PingResult:
        """Reach the peer and measure the best of ``rounds`` request/response round trips.
        ``keep_trying_s`` as in ``open_stream``, for the first round, whose reply not coming
        within ``deadline_s`` counts as silence: its connection is closed and the peer reached
        again while time is left (a connection whose dial ran while the peer was stopped may
        never finish its handshake: seen once in CI, a stalled peer woken up and pinged on it).
        Later rounds are not tried again."""

        async def one_round(first: bool = False) -> float:
            await self._reach_once(peer_id)
            nonce = os.urandom(8)
            start = time.perf_counter()
            try:
                reply = await call_unary(
                    self.host,
                    peer_id,
                    PING_PROTOCOL,
                    PingRequest(nonce),
                    PingReply,
                    deadline_s=deadline_s,
                )
            except RpcTimeout as exc:
                if not first:
                    raise
                await self.host.libp2p.get_network().close_peer(peer_id)
                raise PeerUnreachable(str(exc)) from exc
            if reply.nonce != nonce:
                raise P2PError("ping reply carried the wrong nonce")
            return time.perf_counter() - start

        try:
            best = await self._keep_trying(peer_id, keep_trying_s, lambda: one_round(first=True))
            for _ in range(rounds - 1):
                best = min(best, await one_round())
        except P2PError as exc:
            return PingResult(str(peer_id), False, None, None, str(exc))
        direct = is_direct_kind(self.host.connection_kind(peer_id))
        return PingResult(str(peer_id), True, direct, best * 1000)


def _has_addrs(host: Host, peer_id: ID) -> bool:
    try:
        return bool(host.libp2p.get_peerstore().addrs(peer_id))
    except Exception:
        return False


def _listen_ip(listen_addrs: Sequence[str]) -> str:
    for addr in listen_addrs:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "0.0.0.0"


async def _serve_ping(peer: ID, request: PingRequest) -> PingReply:
    return PingReply(request.nonce)


@asynccontextmanager
async def open_node(config: NodeConfig) -> AsyncIterator[Node]:
    async with open_host(config.host) as host, trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop_lag)
        nat = NatService(host, config.nat or NatConfig(relay_hop=config.role == "relay"))
        await nursery.start(nat.run)
        # A peer that joins through others is a DHT client until they find it reachable: a
        # private peer must never be handed out as a server (lookups would dial it in vain).
        dht = Dht(host, config.dht, server=config.role == "relay" or not config.bootstrap)
        await nursery.start(dht.run)
        serve_unary(host, PING_PROTOCOL, PingRequest, _serve_ping)
        node = Node(config, host, dht, nat)
        node.host.set_handler(BULK_PROBE_PROTOCOL, node._serve_bulk_probe)
        if config.bootstrap:
            await node._join()
            await node.check_reachability(node.bootstrap_peers)
            if node.reachability.status is not Reachability.PRIVATE:
                await node.dht.serve()
            # Peers that joined in the same instant as us were not yet in the bootstrap peer's
            # table when it answered; they are now (the dial-back took a round trip or more).
            await node.dht.refresh()
        await node._start_bulk_listener(nursery)
        await node.publish_addrs()
        nursery.start_soon(node._republish_forever)
        try:
            yield node
        finally:
            nursery.cancel_scope.cancel()


def join_addr(node: Node, preferred: Sequence[multiaddr.Multiaddr] = ()) -> str:
    """The address others pass to ``--join``: ours, ending in ``/p2p/<id>``."""
    addrs = list(preferred) or node.host.addrs()
    return str(addrs[0])
