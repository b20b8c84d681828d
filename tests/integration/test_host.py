"""The host wrapper on loopback: fast dials, shutdown by cancellation, connection kinds."""

from __future__ import annotations

import socket
import statistics
import time

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import HostConfig, open_host


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
