"""Long-lived services against many strangers: real relay and coordinator processes keep accepting
connections after thousands have come and gone, and refuse a port another service holds."""

from __future__ import annotations

import os
import socket
import subprocess

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from peerproc import SWARMTRAIN, PeerProcess, python_argv, start_relay
from rpc_peer import ECHO, Echo

from p2p import Host, HostConfig, call_unary, open_host
from p2p.node import PING_PROTOCOL, PingReply, PingRequest


def _peer_id(addr: str) -> ID:
    return ID.from_base58(multiaddr.Multiaddr(addr).value_for_protocol("p2p"))


async def _connect_and_leave(host: Host, peer_id: ID, addr: str, times: int) -> None:
    network = host.libp2p.get_network()
    for i in range(times):
        try:
            await host.connect(peer_id, [multiaddr.Multiaddr(addr)])
        except Exception as exc:
            raise AssertionError(f"connection {i + 1} of {times} refused: {exc}") from exc
        await network.close_peer(peer_id)


async def test_slots_of_closed_connections_come_back() -> None:
    # A limit of 2 open at once: 0.8.1 refused the 3rd connection even after the first two closed.
    proc = PeerProcess(python_argv("tests/rpc_peer.py", "--max-connections", "2"))
    try:
        addr = proc.wait_line(timeout_s=30)
        peer_id = _peer_id(addr)
        with trio.fail_after(60):
            async with open_host(HostConfig(create_new_key_pair())) as host:
                await _connect_and_leave(host, peer_id, addr, 8)
                await host.connect(peer_id, [multiaddr.Multiaddr(addr)])
                reply = await call_unary(host, peer_id, ECHO, Echo(b"x"), Echo, deadline_s=10)
                assert reply.payload == b"x"
    finally:
        proc.stop()


async def test_a_relay_accepts_a_thousand_connections_one_after_the_other(
    tmp_path: os.PathLike[str],
) -> None:
    # 8 clients, 125 connections each, each closed before the next: never more than 8 open at
    # once, 1,000 in all against a limit of 257 (0.8.1 refused everything after the 257th).
    relay, addr = start_relay(os.path.join(tmp_path, "relay.key"))  # type: ignore[arg-type]
    peer_id = _peer_id(addr)
    try:
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(_client, peer_id, addr, 125)
            async with open_host(HostConfig(create_new_key_pair())) as host:
                await host.connect(peer_id, [multiaddr.Multiaddr(addr)])
                reply = await call_unary(
                    host, peer_id, PING_PROTOCOL, PingRequest(b"12345678"), PingReply, deadline_s=10
                )
                assert reply.nonce == b"12345678"
        assert relay.proc.poll() is None
    finally:
        relay.stop()


async def _client(peer_id: ID, addr: str, times: int) -> None:
    async with open_host(HostConfig(create_new_key_pair())) as host:
        await _connect_and_leave(host, peer_id, addr, times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["relay", "coordinator"])
async def test_a_second_service_on_a_busy_port_is_refused(
    command: str, tmp_path: os.PathLike[str]
) -> None:
    listen = f"/ip4/127.0.0.1/tcp/{_free_port()}"
    args = [*SWARMTRAIN, command, "--listen", listen]
    first = PeerProcess([*args, "--identity", os.path.join(tmp_path, "a.key")])
    try:
        line = await first.wait_line_async(lambda text: "/p2p/" in text, timeout_s=60)
        join = next(word for word in line.split() if word.startswith(listen))
        second = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [*args, "--identity", os.path.join(tmp_path, "b.key")],
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
        assert second.returncode == 1, (second.stdout, second.stderr[-2000:])
        assert (
            f"address already in use: {listen} (another swarmtrain relay or coordinator?)"
            in second.stderr
        ), second.stderr[-2000:]
        assert "/p2p/" not in second.stdout  # it never announced itself
        # The first still serves every connection to its port.
        with trio.fail_after(30):
            async with open_host(HostConfig(create_new_key_pair())) as host:
                for _ in range(3):
                    await _connect_and_leave(host, _peer_id(join), join, 1)
                await host.connect(_peer_id(join), [multiaddr.Multiaddr(join)])
                reply = await call_unary(
                    host, _peer_id(join), PING_PROTOCOL, PingRequest(b"x"), PingReply, deadline_s=10
                )
                assert reply.nonce == b"x"
        assert first.proc.poll() is None
    finally:
        first.stop()
