"""``Node.reach`` and ``Node.ping`` against a real peer process that stalls (SIGSTOP) unconnected.

A stopped process's kernel still accepts the TCP connection, so the dial hangs in the handshake
until the direct dial's 3 s run out. One attempt gives up then; with ``keep_trying_s`` the node
looks the peer up again and dials again until the peer answers or the time is over.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from peerproc import PeerProcess, start_relay

from p2p import HostConfig, Node, NodeConfig, PeerID, PeerUnreachable, open_node

PEER = Path(__file__).with_name("averager_peer.py")


@pytest.fixture
def stalled_peer(tmp_path: Path) -> Iterator[tuple[str, PeerProcess]]:
    relay, join = start_relay(tmp_path / "relay.key")
    peer = PeerProcess([sys.executable, str(PEER), "--join", join])
    try:
        peer.wait_line(lambda line: line.startswith("READY"), timeout_s=60)
        yield join, peer
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        peer.proc.stdin.close()  # type: ignore[union-attr]
        peer.stop()
        relay.stop()


@asynccontextmanager
async def stopped_and_unconnected(
    join: str, peer: PeerProcess, how: signal.Signals = signal.SIGSTOP
) -> AsyncIterator[tuple[Node, PeerID]]:
    """A node of our own joined through ``join``, no connection to ``peer``, ``peer`` stopped
    (or killed: ``how``)."""
    target = PeerID(bytes.fromhex(peer.lines[0].split()[1]))
    config = NodeConfig(host=HostConfig(create_new_key_pair()), bootstrap=(join,))
    async with open_node(config) as node:
        for conn in node.host.libp2p.get_network().get_connections(target):
            await conn.close()  # joining may have connected us to it
        peer.proc.send_signal(how)
        if how == signal.SIGKILL:
            peer.proc.wait(10)
        yield node, target


@pytest.mark.parametrize("call", ["reach", "ping"])
async def test_reach_and_ping_keep_trying_a_peer_that_stalled(
    stalled_peer: tuple[str, PeerProcess], caplog: pytest.LogCaptureFixture, call: str
) -> None:
    # The all-reduce pings a member it has not heard from: a ping that gave up at its first
    # dial dropped a stalled member its sender was still (rightly) trying to reach.
    caplog.set_level(logging.INFO, logger="p2p.node")
    peer = stalled_peer[1]

    async def wake_after_a_failed_attempt() -> None:
        while not any("trying again" in r.getMessage() for r in caplog.records):
            await trio.sleep(0.05)
        peer.proc.send_signal(signal.SIGCONT)

    with trio.fail_after(60):
        async with stopped_and_unconnected(*stalled_peer) as (node, target):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wake_after_a_failed_attempt)
                if call == "reach":
                    await node.reach(target, keep_trying_s=30)
                else:
                    result = await node.ping(target, rounds=1, deadline_s=5, keep_trying_s=30)
                    assert result.ok, result.error
            assert node.host.connection_kind(target) == "direct"
    failed = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert failed and "no answer in 3.0 s" in failed[0], failed


async def test_reach_gives_up_when_the_time_to_keep_trying_is_over(
    stalled_peer: tuple[str, PeerProcess],
) -> None:
    with trio.fail_after(60):
        async with stopped_and_unconnected(*stalled_peer) as (node, target):
            started = trio.current_time()
            with pytest.raises(PeerUnreachable, match=r"\(attempt [2-9]\)"):
                await node.reach(target, keep_trying_s=12)
            # An attempt takes 3-9 s here: the address lookup may wait for the stopped peer (it
            # is in our routing table), then the dial's 3 s. The last one started within 12 s.
            assert 12 <= trio.current_time() - started < 26


async def test_reach_gives_up_at_once_on_a_peer_whose_process_is_gone(
    stalled_peer: tuple[str, PeerProcess],
) -> None:
    # Its port refuses: that is an answer, not silence, so there is nothing to wait for.
    with trio.fail_after(60):
        async with stopped_and_unconnected(*stalled_peer, signal.SIGKILL) as (node, target):
            started = trio.current_time()
            with pytest.raises(PeerUnreachable) as caught:
                await node.reach(target, keep_trying_s=30)
            assert caught.value.refused, caught.value
            assert trio.current_time() - started < 8
