"""A private peer stays reachable through its relay: real libp2p hosts on loopback.

The private peer announces an address nobody can dial back (port 9 is closed), so it finds
itself private and reserves a slot on the relay it joined through. A third host, which is in no
DHT and has no other way to the private peer, dials ``/p2p-circuit`` through the relay on a fresh
connection and pings it. py-libp2p 0.8.1's own refresher (refresh 30 s before expiry) lost the
peer when the relay restarted or forgot it, and asked the relay in a loop when the TTL was short.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2p import (
    HostConfig,
    NatConfig,
    NatService,
    Node,
    NodeConfig,
    P2PError,
    PeerUnreachable,
    Reachability,
    RelayServiceLimits,
    call_unary,
    open_host,
    open_node,
)
from p2p.host import Host, connection_kind
from p2p.nat.reservations import ReservationPolicy
from p2p.node import PING_PROTOCOL, PingReply, PingRequest

# Short waits so a lost slot is re-made in about a second; the rule itself is p2p.nat.reservations'.
FAST = ReservationPolicy(
    retry_initial_s=0.25, retry_max_s=1.0, max_refresh_interval_s=2.0, min_refresh_interval_s=0.5
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve_relay(
    key_pair: KeyPair,
    port: int,
    ttl_s: int,
    circuit_duration_s: int = 3600,
    circuit_data_bytes: int = 1 << 30,
    *,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    limits = RelayServiceLimits(
        reservation_ttl_s=ttl_s,
        circuit_duration_s=circuit_duration_s,
        circuit_data_bytes=circuit_data_bytes,
    )
    config = NodeConfig(
        HostConfig(key_pair, listen_addrs=(f"/ip4/127.0.0.1/tcp/{port}",)),
        role="relay",
        nat=NatConfig(relay_hop=True, relay_limits=limits),
        bulk_port=None,
    )
    async with open_node(config) as relay:
        task_status.started(relay)
        await trio.sleep_forever()


@asynccontextmanager
async def _private_peer(relay: Node) -> AsyncIterator[Node]:
    join = f"{relay.host.addrs()[0]}"
    config = NodeConfig(
        HostConfig(create_new_key_pair(), announce_addrs=("/ip4/127.0.0.1/tcp/9",)),
        bootstrap=(join,),
        nat=NatConfig(reservations=FAST, relay_watch_interval_s=0.1),
        bulk_port=None,
    )
    async with open_node(config) as peer:
        assert peer.reachability.status is Reachability.PRIVATE
        assert peer.relay_addrs(), "the private peer reserved no relay slot"
        yield peer


@asynccontextmanager
async def _outsider() -> AsyncIterator[tuple[Host, NatService]]:
    """A host in no DHT, without hole punching: it reaches the private peer only by circuit."""
    async with open_host(HostConfig(create_new_key_pair())) as host, trio.open_nursery() as n:
        nat = NatService(host, NatConfig(holepunch=False, dialback_server=False))
        await n.start(nat.run)
        yield host, nat
        n.cancel_scope.cancel()


async def _ping_through_relay(host: Host, nat: NatService, peer: Node) -> None:
    """Dial the peer's circuit address on a fresh connection and ping it. Raises on failure."""
    peer_id: ID = peer.host.peer_id
    await host.libp2p.get_network().close_peer(peer_id)
    circuits = [multiaddr.Multiaddr(str(a)) for a in peer.relay_addrs()]
    kind = await nat.connect(peer_id, circuits, wait_direct=False)
    assert kind == "relayed"
    await _ping(host, peer_id)


async def _ping(host: Host, peer_id: ID) -> None:
    nonce = os.urandom(8)
    reply = await call_unary(
        host, peer_id, PING_PROTOCOL, PingRequest(nonce), PingReply, deadline_s=5
    )
    assert reply.nonce == nonce


async def _reachable_within(host: Host, nat: NatService, peer: Node, seconds: float) -> float:
    """Seconds until a ping through the relay succeeds; fails the test after ``seconds``."""
    start = trio.current_time()
    errors = []
    with trio.move_on_after(seconds):
        while True:
            try:
                await _ping_through_relay(host, nat, peer)
                return trio.current_time() - start
            except PeerUnreachable as exc:
                errors.append(str(exc))
            await trio.sleep(0.25)
    raise AssertionError(f"not reachable through the relay in {seconds} s: {errors[-3:]}")


async def test_a_slot_lost_when_the_relay_restarts_is_made_again() -> None:
    key, port = create_new_key_pair(), _free_port()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            first, first_gone = trio.CancelScope(), trio.Event()

            async def first_relay(*, task_status: trio.TaskStatus[Node]) -> None:
                with first:
                    await _serve_relay(key, port, 3600, task_status=task_status)
                first_gone.set()  # its host is closed and its port free

            relay = await nursery.start(first_relay)
            async with _private_peer(relay) as peer, _outsider() as (host, nat):
                await _reachable_within(host, nat, peer, 10)
                # The relay process dies and comes back on the same identity and port: its
                # reservation table is empty, and it answers NO_RESERVATION for the peer.
                first.cancel()
                await first_gone.wait()
                # Down long enough for the peer's first attempts to fail: 0.8.1 then refused
                # every dial to the relay for 60 s, whatever the keeper's backoff said.
                await trio.sleep(2.5)
                await nursery.start(_serve_relay, key, port, 3600)
                took_s = await _reachable_within(host, nat, peer, 10)
                stats = peer.nat.reservation_statistics()
                assert stats.losses >= 1 and stats.held == 1
                logging.getLogger(__name__).info("reachable again %.1f s after the restart", took_s)
            nursery.cancel_scope.cancel()


async def test_a_relay_that_forgot_the_peer_holds_it_again_after_the_self_check() -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(_serve_relay, create_new_key_pair(), _free_port(), 3600)
            async with _private_peer(relay) as peer, _outsider() as (host, nat):
                await _reachable_within(host, nat, peer, 10)
                # The relay drops the reservation while the connection stays open (what a relay
                # whose clock runs ahead, or one that restarted behind a NAT mapping, does).
                relay.nat._relay_protocol.resource_manager._reservations.clear()
                with pytest.raises(PeerUnreachable, match="status 204"):
                    await _ping_through_relay(host, nat, peer)
                await _reachable_within(host, nat, peer, FAST.max_refresh_interval_s + 8)
            nursery.cancel_scope.cancel()


async def test_a_short_ttl_is_refreshed_before_it_expires_without_hammering_the_relay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ttl_s = 3
    caplog.set_level(logging.DEBUG, logger="libp2p.relay.circuit_v2.protocol")
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(_serve_relay, create_new_key_pair(), _free_port(), ttl_s)
            async with _private_peer(relay) as peer, _outsider() as (host, nat):
                start = trio.current_time()
                while trio.current_time() - start < 4 * ttl_s:
                    await _ping_through_relay(host, nat, peer)  # every time, never a failure
                    await trio.sleep(ttl_s / 3)
                refreshes = [r for r in caplog.records if "already has a reservation" in r.message]
                # At 2/3 of a TTL of 2-3 s (the relay rounds its expiry down): one every 1.3-2 s.
                assert 4 <= len(refreshes) <= 12, len(refreshes)
            nursery.cancel_scope.cancel()


async def test_a_source_that_hangs_up_ends_its_own_circuit_and_no_other() -> None:
    # 0.8.1's relay closed, when a circuit ended, the streams of the newest circuit to the same
    # peer: the first caller to hang up cut the second off (p2p.nat.relay_hop).
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(_serve_relay, create_new_key_pair(), _free_port(), 3600)
            async with (
                _private_peer(relay) as peer,
                _outsider() as (first, first_nat),
                _outsider() as (second, second_nat),
            ):
                peer_id = peer.host.peer_id
                await _ping_through_relay(first, first_nat, peer)
                await _ping_through_relay(second, second_nat, peer)
                circuit = second.libp2p.get_network().get_connections(peer_id)
                await first.libp2p.get_network().close_peer(peer_id)
                # Wait until the relay has ended the first circuit in both directions (each
                # direction's cleanup has run when the circuit's slot is given back).
                slot = relay.nat._relay_protocol.resource_manager.get_reservation(peer_id)
                while slot.active_connections > 1:
                    await trio.sleep(0.05)
                await _ping(second, peer_id)
                assert second.libp2p.get_network().get_connections(peer_id) == circuit
            nursery.cancel_scope.cancel()


async def _circuit_closed_within(host: Host, peer_id: ID, seconds: float) -> None:
    with trio.fail_after(seconds):
        while connection_kind(host, peer_id) is not None:
            await trio.sleep(0.05)


async def test_a_circuit_is_reset_when_its_duration_runs_out_even_when_idle() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(_serve_relay, create_new_key_pair(), _free_port(), 3600, 2)
            async with _private_peer(relay) as peer, _outsider() as (host, nat):
                await _ping_through_relay(host, nat, peer)
                # Nothing more is sent: 0.8.1 looked at the clock only when data arrived.
                await _circuit_closed_within(host, peer.host.peer_id, 10)
            nursery.cancel_scope.cancel()


async def test_a_circuit_is_reset_when_its_data_budget_runs_out() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(
                _serve_relay, create_new_key_pair(), _free_port(), 3600, 3600, 16 << 10
            )
            async with _private_peer(relay) as peer, _outsider() as (host, nat):
                peer_id = peer.host.peer_id
                await _ping_through_relay(host, nat, peer)
                with pytest.raises(P2PError):  # the stream cannot open, or ends mid-reply
                    for _ in range(2000):  # a few hundred bytes on the circuit each
                        await _ping(host, peer_id)
                await _circuit_closed_within(host, peer_id, 10)
            nursery.cancel_scope.cancel()
