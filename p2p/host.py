"""The libp2p host a node runs in its own process: TCP + Noise + yamux, no sidecar daemon.

``open_host(config)`` is an async context manager: the host listens when it is entered and is torn
down when the enclosing scope exits or is cancelled (cancellation is the shutdown path; there is no
``stop()``). The wrapper adds what 0.8.1 lacks or gets wrong:

- dials without the ~250 ms happy-eyeballs wait (``max_connections_per_peer=1``, measured in
  DESIGN.md), and bounded by a deadline;
- a connection limit that holds: libp2p's limit is passed through *and* enforced by a notifee that
  closes any connection beyond ``max_connections`` (the resource manager's count is off by one),
  and an inbound connection's slot comes back when it closes (``p2p.inbound``: 0.8.1 returns it
  only when the host stops);
- stream handlers that never let an exception escape: in 0.8.1 an exception leaving a handler
  kills the whole host, so every handler is wrapped, counted and its stream reset; rejected input
  is logged at most once per peer and kind a minute, never echoing what was sent
  (``p2p.rejections``);
- a read deadline on every inbound stream, libp2p's protocols included
  (``p2p.stream_deadlines``);
- ``connection_kind(peer)``: how our connection to a peer was made: dialed or accepted
  directly, through a relay circuit, or punched (DCUtR, ``p2p.nat.traversal``, marks the
  connections its hole punches make: ``punching``).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.connection_types import ConnectionType
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.utils.address_validation import expand_wildcard_address

from p2p.errors import AddressInUse, P2PError, PeerUnreachable
from p2p.inbound import return_slots_on_close
from p2p.muxer import use_cancel_safe_yamux
from p2p.rejections import RejectionLog
from p2p.stream_deadlines import DEFAULT_CONTROL_S, StreamDeadlineExceeded, bound_reads

log = logging.getLogger(__name__)

# How a connection was made: dialed or accepted directly, through a relay circuit, or by a hole
# punch (direct too, but only because both NATs were opened for it: worth counting apart).
ConnectionKind = Literal["direct", "punched", "relayed"]
StreamHandler = Callable[[INetStream], Awaitable[None]]


@dataclass(frozen=True)
class HostConfig:
    key_pair: KeyPair
    listen_addrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    # Replace the listen addresses in what we advertise (a public IP behind port forwarding).
    announce_addrs: tuple[str, ...] = ()
    max_connections: int = 256
    dial_timeout_s: float = 10.0
    # Read deadline of inbound control streams (p2p.stream_deadlines): idle and per message.
    control_read_timeout_s: float = DEFAULT_CONTROL_S
    enable_upnp: bool = False
    extra_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class HostStatistics:
    handler_failures: int = 0
    connections_refused_over_limit: int = 0
    connections_closed: int = 0
    # Rejected inbound input by kind (the protocol, "<protocol> deadline" for read deadlines).
    rejections: dict[str, int] = field(default_factory=dict)


def is_relayed(conn: Any) -> bool:
    """Whether a connection runs through a circuit relay.

    Both signals: 0.8.1 types the connections it builds for circuits as RELAYED, and tags them
    with /p2p-circuit addresses; an inbound circuit can miss the type, an outbound the tag.
    """
    try:
        if conn.get_connection_type() is ConnectionType.RELAYED:
            return True
    except Exception:
        pass
    try:
        return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    except Exception:
        return False


def _closed(conn: INetConn) -> bool:
    return bool(getattr(conn, "is_closed", False))


def connection_kind(host: IHost | Host, peer_id: ID) -> ConnectionKind | None:
    """How we are connected to ``peer_id`` now, None when not connected: ``direct`` if a live
    connection is direct and was not punched, else ``punched`` if one was punched, else
    ``relayed`` (all go through a relay).

    Only our ``Host`` knows which connections were punched; given libp2p's ``IHost`` (no
    record), a punched connection counts as ``direct``.
    """
    raw = host.libp2p if isinstance(host, Host) else host
    conns = [c for c in raw.get_network().get_connections(peer_id) if not _closed(c)]
    if not conns:
        return None
    direct = [c for c in conns if not is_relayed(c)]
    if not direct:
        return "relayed"
    punched: Container[INetConn] = host.punched if isinstance(host, Host) else ()
    return "direct" if any(c not in punched for c in direct) else "punched"


def is_direct_kind(kind: ConnectionKind | None) -> bool:
    """Whether a connection of this kind reaches the peer without a relay (dialed or punched)."""
    return kind in ("direct", "punched")


class _ConnectionNotifee(INotifee):
    """Closes connections beyond the limit as soon as they are established, and logs every
    connection that ends: a peer whose connections vanish mid-round is otherwise a mystery."""

    def __init__(self, host: Host) -> None:
        self._host = host

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        log.debug("connection to %s opened (%s)", conn.muxed_conn.peer_id, _direction(conn))
        if conn.muxed_conn.peer_id in self._host._punching and not is_relayed(conn):
            self._host.punched.add(conn)
        total = sum(len(conns) for conns in network.get_connections_map().values())
        if total > self._host.config.max_connections:
            self._host.statistics.connections_refused_over_limit += 1
            log.warning(
                "closing connection from %s: %d connections > limit %d",
                conn.muxed_conn.peer_id,
                total,
                self._host.config.max_connections,
            )
            self._host._nursery.start_soon(_close_quietly, conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._host.statistics.connections_closed += 1
        created = getattr(conn, "_created_at", None)
        age = f"{time.time() - created:.1f} s" if isinstance(created, float) else "?"
        log.info(
            "connection to %s closed (%s, open %s, %d left to it)",
            conn.muxed_conn.peer_id,
            _direction(conn),
            age,
            len(network.get_connections(conn.muxed_conn.peer_id)),
        )

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass


def _direction(conn: INetConn) -> str:
    return str(getattr(conn, "direction", "unknown"))


async def _close_quietly(conn: INetConn) -> None:
    with trio.move_on_after(2):
        try:
            await conn.close()
        except Exception as exc:
            log.debug("closing connection failed: %r", exc)


class Host:
    """A running libp2p host. Create it with ``open_host``."""

    def __init__(
        self,
        config: HostConfig,
        libp2p_host: IHost,
        nursery: trio.Nursery,
        rejections: RejectionLog | None = None,
    ) -> None:
        self.config = config
        self.libp2p = libp2p_host
        self.peer_id: ID = libp2p_host.get_id()
        self.rejections = rejections or RejectionLog()
        self.statistics = HostStatistics(rejections=self.rejections.counts)
        self._nursery = nursery
        # Connections made by hole punching (weak: a closed connection leaves on its own), and
        # the peers a punch is under way with, by how many sessions (both ends may run one).
        self.punched: weakref.WeakSet[INetConn] = weakref.WeakSet()
        self._punching: dict[ID, int] = {}

    def reject(self, peer: object, kind: str, detail: str) -> None:
        """Count input refused from ``peer``; logged at most once per peer and kind a minute."""
        line = self.rejections.record(str(peer), kind, detail, trio.current_time())
        if line is not None:
            log.warning("%s", line)

    def addrs(self) -> list[multiaddr.Multiaddr]:
        """Our dialable addresses, each ending in ``/p2p/<peer id>``, loopback last.

        A wildcard listen address (0.0.0.0) is expanded to every interface address: a peer
        cannot dial 0.0.0.0, and publishing it would waste every dialer's first attempt.
        """
        suffix = f"/p2p/{self.peer_id}"
        out: list[str] = []
        for addr in self.libp2p.get_addrs():
            text = str(addr).removesuffix(suffix)
            if text.startswith("/ip4/0.0.0.0/") or text.startswith("/ip6/::/"):
                out.extend(str(a) for a in expand_wildcard_address(multiaddr.Multiaddr(text)))
            else:
                out.append(text)
        unique = sorted(dict.fromkeys(out), key=lambda a: a.startswith(("/ip4/127.", "/ip6/::1/")))
        return [multiaddr.Multiaddr(a + suffix) for a in unique]

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve ``protocol``; an exception from ``handler`` is logged and resets the stream."""

        async def guarded(stream: INetStream) -> None:
            try:
                await handler(stream)
            except StreamDeadlineExceeded:
                await reset_quietly(stream)  # counted and logged where it was raised
            except Exception as exc:
                self.statistics.handler_failures += 1
                self.reject(_peer_of(stream), f"{protocol} (handler failed)", repr(exc))
                await reset_quietly(stream)

        self.libp2p.set_stream_handler(TProtocol(protocol), guarded)

    async def connect(
        self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr], *, own_backoff: bool = False
    ) -> None:
        """Connect to ``peer_id`` at one of ``addrs``; raises ``PeerUnreachable``.

        ``own_backoff``: the caller spaces its attempts itself, so dial even when 0.8.1's
        negative cache holds the peer (every dial to a peer whose addresses all failed is
        refused for 60 s: a relay back after a 2 s restart stayed out of reach for a minute).
        """
        network = self.libp2p.get_network()
        if network.get_connections(peer_id):
            return
        if own_backoff:
            failed = getattr(network, "_negative_peer_cache", None)
            if failed is not None:
                failed.evict(str(peer_id))
        try:
            with trio.fail_after(self.config.dial_timeout_s):
                await self.libp2p.connect(PeerInfo(peer_id, list(addrs)))
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"dialing {peer_id} timed out") from exc
        except Exception as exc:
            raise PeerUnreachable(f"cannot dial {peer_id}: {exc}") from exc

    async def open_stream(self, peer_id: ID, protocol: str) -> INetStream:
        try:
            with trio.fail_after(self.config.dial_timeout_s):
                network = self.libp2p.get_network()
                listed = network.get_connections(peer_id)
                if listed and all(_closed(c) for c in listed):
                    # py-libp2p keeps a closed connection listed for a while; new_stream then
                    # neither uses it nor dials ("no valid connections"), so dial a new one.
                    await network.dial_peer_replacement(peer_id)
                return await self.libp2p.new_stream(peer_id, [TProtocol(protocol)])
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"opening {protocol} to {peer_id} timed out") from exc
        except Exception as exc:
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: {exc}") from exc

    def connected_peers(self) -> list[ID]:
        return list(self.libp2p.get_network().get_connections_map())

    def connection_kind(self, peer_id: ID) -> ConnectionKind | None:
        return connection_kind(self, peer_id)

    @contextmanager
    def punching(self, peer_id: ID) -> Iterator[None]:
        """Count the direct connections to ``peer_id`` that appear in this block as punched.

        The hole punch wraps its dial rounds in it. Marked twice over: when a connection
        opens in the block (so it is ``punched`` before the punch's caller learns it exists,
        and at the end that accepted it as well), and, when the block ends, every direct
        connection that was not there when it began (a connection registered just before the
        punch saw it can have its ``connected`` notification still pending then).
        """
        network = self.libp2p.get_network()

        def direct_now() -> list[INetConn]:
            return [c for c in network.get_connections(peer_id) if not is_relayed(c)]

        before = set(direct_now())
        self._punching[peer_id] = self._punching.get(peer_id, 0) + 1
        try:
            yield
        finally:
            left = self._punching.pop(peer_id) - 1
            if left:
                self._punching[peer_id] = left
            for conn in direct_now():
                if conn not in before and not _closed(conn):
                    self.punched.add(conn)


async def reset_quietly(stream: INetStream) -> None:
    with trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception as exc:
            log.debug("stream reset failed: %r", exc)


def build_libp2p_host(config: HostConfig, rejections: RejectionLog | None = None) -> IHost:
    limit = config.max_connections
    connection_config = ConnectionConfig(
        # One connection per peer is what removes the 250 ms dial wait (DESIGN.md).
        max_connections_per_peer=1,
        # libp2p's own limit admits one fewer than asked; ours (the notifee) is exact.
        max_connections=limit + 1,
        high_watermark=limit + 1,
        low_watermark=min(limit, 100),
        min_connections=0,
        dial_timeout=config.dial_timeout_s,
    )
    libp2p_host = new_host(
        key_pair=config.key_pair,
        connection_config=connection_config,
        enable_upnp=config.enable_upnp,
        announce_addrs=[multiaddr.Multiaddr(a) for a in config.announce_addrs] or None,
        **config.extra_options,
    )

    # The auto-connector redials every peer in the peerstore until the connection count reaches
    # the watermarks' midpoint: hundreds of dials to NATed and departed peers. Whom to connect to
    # is the DHT's and the node's decision.
    async def no_auto_dials() -> None:
        return None

    use_cancel_safe_yamux(libp2p_host)
    network = libp2p_host.get_network()
    return_slots_on_close(network)
    network.auto_connector.maybe_connect = no_auto_dials  # type: ignore[method-assign]

    # Every inbound stream, for every protocol (libp2p's own identify, ping, relay and kad
    # handlers included), passes through here: nothing a remote peer sends can raise out of it.
    dispatch = libp2p_host._swarm_stream_handler  # type: ignore[attr-defined]

    rejected = rejections or RejectionLog()

    async def on_deadline(stream: INetStream, protocol: str) -> None:
        line = rejected.record(
            str(_peer_of(stream)), f"{protocol} deadline", "read deadline", trio.current_time()
        )
        if line is not None:
            log.warning("%s", line)

    async def guarded_dispatch(stream: INetStream) -> None:
        bound_reads(stream, config.control_read_timeout_s, on_deadline)
        try:
            await dispatch(stream)
        except StreamDeadlineExceeded:
            await reset_quietly(stream)
        except Exception as exc:
            line = rejected.record(
                str(_peer_of(stream)), "inbound stream", repr(exc), trio.current_time()
            )
            if line is not None:
                log.info("%s", line)
            await reset_quietly(stream)

    network.set_stream_handler(guarded_dispatch)
    return libp2p_host


def _peer_of(stream: INetStream) -> object:
    try:
        return stream.muxed_conn.peer_id
    except Exception:
        return "?"


@asynccontextmanager
async def open_host(config: HostConfig) -> AsyncIterator[Host]:
    """Run a host listening on ``config.listen_addrs`` for the duration of the block.

    An exception from the block propagates as itself (libp2p's nurseries would otherwise wrap it
    in nested exception groups).
    """
    for addr in config.listen_addrs:
        check_port_free(addr)
    rejections = RejectionLog()
    libp2p_host = build_libp2p_host(config, rejections)
    listen = [multiaddr.Multiaddr(a) for a in config.listen_addrs]
    try:
        async with trio.open_nursery() as nursery:
            # Cancel our nursery only after libp2p's run() has exited: cancelling earlier makes
            # its teardown raise Cancelled, which replaces (and so swallows) the block's error.
            try:
                async with libp2p_host.run(listen):
                    host = Host(config, libp2p_host, nursery, rejections)
                    libp2p_host.get_network().register_notifee(_ConnectionNotifee(host))
                    yield host
            finally:
                nursery.cancel_scope.cancel()
                await _close_listeners(libp2p_host)
    except BaseExceptionGroup as group:
        raise _sole_leaf(group) from None


def check_port_free(addr: str) -> None:
    """Raise ``AddressInUse`` if another socket listens on ``addr``'s TCP port.

    0.8.1 binds its listeners with SO_REUSEPORT (hole punching dials out from the listening port),
    so its own bind succeeds next to another process's listener and the kernel then splits the
    incoming connections between the two. A probe bound without SO_REUSEPORT fails on such a
    port; SO_REUSEADDR lets it bind over our own previous run's TIME_WAIT connections. Port 0
    (any free port) and non-TCP addresses are never in use.
    """
    parts = addr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or parts[4] == "0":
        return
    family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts[2], int(parts[4])))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(addr) from None
            raise P2PError(f"cannot listen on {addr}: {exc.strerror or exc}") from None


async def _close_listeners(libp2p_host: IHost) -> None:
    # 0.8.1 leaves its TCP listeners open after run() exits: the port keeps accepting into the
    # kernel backlog with nobody serving, and a restarted node cannot bind it.
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        for listener in list(libp2p_host.get_network().listeners.values()):
            try:
                await listener.close()
            except Exception as exc:
                log.debug("closing listener failed: %r", exc)


def _sole_leaf(group: BaseExceptionGroup) -> BaseException:
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group
