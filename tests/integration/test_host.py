"""The host wrapper on loopback: fast dials, shutdown by cancellation, connection kinds (direct,
punched)."""

from __future__ import annotations

import logging
import socket
import statistics
import time

import multiaddr
import pytest
import trio
import trio.testing
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import HostConfig, open_host
from p2p.loop_lag import watch_loop_lag


def _port(addr: multiaddr.Multiaddr) -> int:
    return int(addr.value_for_protocol("tcp"))


async def test_dials_skip_the_happy_eyeballs_wait() -> None:
    # py-libp2p waits ~250 ms per dial by default; ours must not (DESIGN.md). The bound is loose
    # on purpose: it separates "no wait" from "a 250 ms wait", it does not measure speed.
    durations = []
    with trio.fail_after(60):
        async with open_host(HostConfig(create_new_key_pair())) as server:
            for _ in range(5):
                async with open_host(HostConfig(create_new_key_pair())) as client:
                    start = time.perf_counter()
                    await client.connect(server.peer_id, server.addrs())
                    durations.append(time.perf_counter() - start)
                    assert client.connection_kind(server.peer_id) == "direct"
    assert statistics.median(durations) < 0.2, durations


async def test_connections_made_during_a_punch_count_as_punched_at_both_ends() -> None:
    # DCUtR's dial rounds run inside Host.punching (p2p.nat.traversal); here a plain dial stands
    # in for the punch's dial, and each end marks what it sees: the dialer (through its
    # notifee) and the acceptor (at the block's end: its connection was not there before).
    with trio.fail_after(30):
        async with (
            open_host(HostConfig(create_new_key_pair())) as a,
            open_host(HostConfig(create_new_key_pair())) as b,
            open_host(HostConfig(create_new_key_pair())) as c,
        ):
            await a.connect(c.peer_id, c.addrs())
            with a.punching(b.peer_id), b.punching(a.peer_id), a.punching(c.peer_id):
                await a.connect(b.peer_id, b.addrs())
                assert a.connection_kind(b.peer_id) == "punched"
                while b.connection_kind(a.peer_id) is None:
                    await trio.sleep(0.01)
            assert b.connection_kind(a.peer_id) == "punched"
            assert a.connection_kind(b.peer_id) == "punched"
            # Dialed before the punch began: still direct, at both ends.
            assert a.connection_kind(c.peer_id) == "direct"
            assert c.connection_kind(a.peer_id) == "direct"
            await a.libp2p.get_network().close_peer(b.peer_id)
            assert a.connection_kind(b.peer_id) is None


async def test_cancellation_shuts_the_host_down_and_frees_its_port() -> None:
    ports: list[int] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def serve(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
                async with open_host(HostConfig(create_new_key_pair())) as host:
                    ports.append(_port(host.addrs()[0]))
                    task_status.started()
                    await trio.sleep_forever()

            await nursery.start(serve)
            with socket.create_connection(("127.0.0.1", ports[0]), timeout=5):
                pass  # listening while the block runs
            nursery.cancel_scope.cancel()
    refused = False
    try:
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()
    except ConnectionRefusedError:
        refused = True
    assert refused, "port still accepting after the host's scope was cancelled"


async def test_exception_in_the_block_propagates_as_itself() -> None:
    class Boom(Exception):
        pass

    raised = False
    with trio.fail_after(30):
        try:
            async with open_host(HostConfig(create_new_key_pair())):
                raise Boom
        except Boom:
            raised = True
    assert raised


async def test_a_closed_connection_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    # When a peer's connections vanish mid-round, this line says which, whose side and how old.
    caplog.set_level(logging.INFO, logger="p2p.host")
    with trio.fail_after(30):
        async with (
            open_host(HostConfig(create_new_key_pair())) as server,
            open_host(HostConfig(create_new_key_pair())) as client,
        ):
            await client.connect(server.peer_id, server.addrs())
            (conn,) = client.libp2p.get_network().get_connections(server.peer_id)
            await conn.close()
            with trio.fail_after(5):
                while server.statistics.connections_closed < 1:
                    await trio.sleep(0.02)
            assert client.statistics.connections_closed == 1
    lines = [r.getMessage() for r in caplog.records if "closed (" in r.getMessage()]
    assert any(f"connection to {server.peer_id} closed (outbound" in line for line in lines), lines
    assert any(f"connection to {client.peer_id} closed (inbound" in line for line in lines), lines


async def test_a_stalled_event_loop_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2p.loop_lag")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_loop_lag, 0.5, 0.05)
            await trio.sleep(0.2)
            time.sleep(1.0)  # blocks the loop, as a synchronous call on it would
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.name == "p2p.loop_lag"]
    assert len(warnings) == 1 and "stalled for" in warnings[0], warnings
    stalled = float(warnings[0].split("stalled for ")[1].split()[0])
    assert 0.5 < stalled < 1.5, warnings


async def test_a_write_cancelled_as_it_gets_the_connection_leaves_the_connection_working() -> None:
    """A stream write whose deadline passes just as it gets the connection's write lock (what
    every write waiting on a stalled event loop meets when it wakes) must not break the
    connection. In py-libp2p the Noise layer encrypts the frame (spending a nonce) before its
    first checkpoint, so a Cancelled there left the peer unable to authenticate the next frame:
    it closed the connection, and every stream on it ended at once."""
    with trio.fail_after(30):
        async with (
            open_host(HostConfig(create_new_key_pair())) as server,
            open_host(HostConfig(create_new_key_pair())) as client,
        ):

            async def echo(stream: INetStream) -> None:
                while data := await stream.read(1024):
                    await stream.write(data)

            server.set_handler("/test/echo/1", echo)
            await client.connect(server.peer_id, server.addrs())
            stream = await client.open_stream(server.peer_id, "/test/echo/1")
            await stream.write(b"a")
            assert await stream.read(1024) == b"a"
            (conn,) = client.libp2p.get_network().get_connections(server.peer_id)
            write_lock = conn.muxed_conn._write_lock  # the yamux connection's frame lock
            written = trio.Event()

            async def late_writer() -> None:
                with trio.move_on_after(0.05):
                    await stream.write(b"b")
                written.set()

            await write_lock.acquire()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(late_writer)
                await trio.testing.wait_all_tasks_blocked()  # the writer waits for the lock
                write_lock.release()  # handed to the writer, which has not run yet
                time.sleep(0.1)  # the loop stalls: the writer's deadline passes meanwhile
            assert written.is_set()
            await stream.write(b"c")
            with trio.fail_after(5):
                echoed = b""
                while not echoed.endswith(b"c"):
                    echoed += await stream.read(1024)
            assert echoed == b"bc"  # the cancelled write went out whole, its Cancelled after
