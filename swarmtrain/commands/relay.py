"""``swarmtrain relay``: a long-running public helper peer.

Bootstrap and DHT server, circuit relay v2 hop and dial-back reachability service, like hivemind's
``run_dht.py`` bootstrap but also helping NATed peers. The first line on stdout is the join
address (a multiaddr ending in ``/p2p/<peer id>``); everything else goes to the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.peerinfo import PeerInfo

from p2p import HostConfig, Node, NodeConfig, Reachability, join_addr, open_node
from swarmtrain.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayOptions:
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/4002",)
    announce: tuple[str, ...] = ()
    status_interval_s: float = 60.0
    upnp: bool = False
    # Read deadline of inbound control streams (p2p.stream_deadlines).
    read_timeout_s: float = 10.0
    # ``--metrics-port`` (served already; sampled from the node once it runs); None: off.
    metrics: Metrics | None = None


async def run_relay(key_pair: KeyPair, options: RelayOptions) -> None:
    config = relay_node_config(key_pair, options)
    async with open_node(config) as node:
        if options.metrics is not None:
            options.metrics.watch_node(node)
        print(join_addr(node), flush=True)
        for addr in node.host.addrs()[1:]:
            log.info("also reachable at %s", addr)
        await keep_serving(node, options.status_interval_s)


def relay_node_config(key_pair: KeyPair, options: RelayOptions) -> NodeConfig:
    """A relay-role node (bootstrap, DHT server, circuit relay hop, dial-back)."""
    return NodeConfig(
        HostConfig(
            key_pair,
            listen_addrs=options.listen,
            announce_addrs=options.announce,
            enable_upnp=options.upnp,
            control_read_timeout_s=options.read_timeout_s,
        ),
        role="relay",
    )


async def keep_serving(node: Node, status_interval_s: float) -> None:
    """A relay's life after start: re-check reachability once peers can vouch for it, and log
    what it serves. Runs until cancelled."""
    while True:
        await trio.sleep(status_interval_s)
        if node.reachability.status is Reachability.UNKNOWN and node.host.connected_peers():
            # Nobody can vouch for a relay before peers join; then they can dial it back.
            helpers = [PeerInfo(p, []) for p in node.host.connected_peers()[:3]]
            verdict = await node.nat.check_reachability([h.peer_id for h in helpers])
            node.reachability = verdict
            if verdict.status is Reachability.PRIVATE:
                log.warning("peers cannot dial this relay back: %s", verdict.reason)
        stats = node.dht.statistics()
        log.info(
            "%d peers connected, %d in the routing table, %d keys held",
            len(node.host.connected_peers()),
            stats.routing_table_size,
            stats.keys_held,
        )
