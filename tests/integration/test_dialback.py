"""Dial-back reachability on loopback, with real hosts: a relay (the helper) and nodes asking it.

The NAT lab checks the same across namespaces (tests/natlab/test_reach_default.py); here it runs
on any machine: the helper sees the asker at 127.0.0.1 and dials back only that IP.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator

import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from p2p import HostConfig, NodeConfig, open_node
from p2p.dht.kademlia import Dht
from p2p.host import open_host
from p2p.nat.dialback import ask_for_dialbacks
from p2p.nat.reachability import Reachability, decide_reachability
from p2p.node import join_addr


def relay_config() -> NodeConfig:
    return NodeConfig(
        HostConfig(create_new_key_pair(), listen_addrs=("/ip4/127.0.0.1/tcp/0",)),
        role="relay",
        bulk_port=None,
    )


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connection to it is refused, and no other
    process can take it while the test runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def test_a_node_on_the_wildcard_address_and_a_random_port_is_found_public(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The default command line listens on 0.0.0.0/tcp/0. Its dial-back request once named only
    # the address the helper observed (our outbound connection's source port) and the helper
    # found nothing there: "unknown" here, "private" across a real network (issue 16).
    caplog.set_level(logging.INFO, logger="p2p")
    with trio.fail_after(60):
        async with open_node(relay_config()) as relay:
            config = NodeConfig(
                HostConfig(create_new_key_pair(), listen_addrs=("/ip4/0.0.0.0/tcp/0",)),
                bootstrap=(join_addr(relay),),
            )
            async with open_node(config) as node:
                verdict = node.reachability
                assert verdict.status is Reachability.PUBLIC, verdict
                (listening,) = node.host.libp2p.get_addrs()
                port = int(str(listening).split("/")[4])
                assert verdict.confirmed_addrs == (f"/ip4/127.0.0.1/tcp/{port}",), verdict
                assert node.relay_addrs() == []  # a public node reserves no relay slot
                assert node.bulk_listener is not None and node.bulk_listener.port > 0
    helper_said = [r.getMessage() for r in caplog.records if r.name == "p2p.nat.dialback"]
    assert any(
        f"dial-back for {node.host.peer_id} seen at 127.0.0.1" in line
        and f"/ip4/127.0.0.1/tcp/{port} ok" in line
        for line in helper_said
    ), helper_said


async def test_a_failed_dial_back_says_what_was_dialed_and_why(
    caplog: pytest.LogCaptureFixture, closed_port: int
) -> None:
    caplog.set_level(logging.INFO, logger="p2p")
    # A third party's IP in the request: the helper tries the port on the IP it sees us at,
    # never on that IP (no dial-back amplification).
    asked = (f"/ip4/127.0.0.1/tcp/{closed_port}", "/ip4/198.51.100.7/tcp/4001")
    with trio.fail_after(60):
        async with (
            open_node(relay_config()) as relay,
            open_node(NodeConfig(HostConfig(create_new_key_pair()), bulk_port=None)) as asker,
        ):
            await asker.host.connect(relay.host.peer_id, relay.host.addrs())
            reports = await ask_for_dialbacks(
                asker.host, [relay.host.peer_id], asked, deadline_s=10
            )
    (report,) = reports
    assert not report.error, report
    assert report.observed_ip == "127.0.0.1"
    assert [o.addr for o in report.outcomes] == [
        f"/ip4/127.0.0.1/tcp/{closed_port}",
        "/ip4/127.0.0.1/tcp/4001",
    ]
    assert not any(o.ok for o in report.outcomes), report
    refused = next(o for o in report.outcomes if o.addr.endswith(f"/tcp/{closed_port}"))
    assert re.search("refused", refused.error, re.IGNORECASE), refused
    verdict = decide_reachability(reports)
    assert verdict.status is Reachability.PRIVATE
    assert f"/ip4/127.0.0.1/tcp/{closed_port}: " in verdict.reason, verdict.reason
    helper_said = [r.getMessage() for r in caplog.records if r.name == "p2p.nat.dialback"]
    line = next(s for s in helper_said if f"dial-back for {asker.host.peer_id}" in s)
    assert "seen at 127.0.0.1: asked for 2 address(es)" in line, line
    assert re.search(f"/ip4/127.0.0.1/tcp/{closed_port} .*refused", line, re.IGNORECASE), line
    assert "198.51.100.7" not in line, line


async def test_a_silent_connected_peer_does_not_hold_a_node_becoming_a_kad_server() -> None:
    # A host that stopped without closing its connection (the dial-back probe did until it
    # closed it): we count it connected and its identify push waits for an answer that never
    # comes. Becoming a Kad server waited out that push, 3 s at every public node's start.
    with trio.fail_after(30):
        async with open_host(HostConfig(create_new_key_pair())) as host, trio.open_nursery() as n:
            dht = Dht(host, server=False)
            await n.start(dht.run)
            gone = new_host(key_pair=create_new_key_pair())
            async with gone.run([]):
                await gone.connect(PeerInfo(host.peer_id, host.addrs()))
            assert gone.get_id() in host.connected_peers()
            start = trio.current_time()
            await dht.serve()
            assert dht.is_server and trio.current_time() - start < 1.0
            n.cancel_scope.cancel()
