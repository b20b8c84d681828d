"""The simulator's clock, network and DHT models: time in order, a message's time on a link of
known rate and latency, FIFO uplinks and pairs, departures, and the DHT's limits."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from p2p.dht import records as real_records
from swarm.averaging.matchmaking import Declaration
from swarm.sim import Clock, DhtModel, Network, NetworkConfig, PeerLink, SimDht, draw_link
from swarm.sim import dht as sim_dht

A, B, C = b"a" * 38, b"b" * 38, b"c" * 38


def network(loss: float = 0.0, **links: PeerLink) -> tuple[Clock, Network, list]:
    clock = Clock()
    net = Network(clock, NetworkConfig(loss=loss, uplink="fifo"), np.random.default_rng(0))
    defaults = {
        A: PeerLink(up_bps=8e6, down_bps=80e6, leg_s=0.010, relayed=False, datacenter=False),
        B: PeerLink(up_bps=1e9, down_bps=4e6, leg_s=0.030, relayed=False, datacenter=False),
        C: PeerLink(up_bps=1e9, down_bps=1e9, leg_s=0.005, relayed=False, datacenter=True),
    }
    for peer, link in {**defaults, **{k.encode() * 38: v for k, v in links.items()}}.items():
        net.add(peer, link)
    arrivals: list = []
    return clock, net, arrivals


def test_clock_runs_in_time_order_then_scheduling_order_and_refuses_the_past() -> None:
    clock, seen = Clock(), []
    clock.at(2.0, seen.append, "late")
    clock.at(1.0, seen.append, "first")
    clock.at(1.0, seen.append, "second")
    clock.run()
    assert seen == ["first", "second", "late"] and clock.now == 2.0
    with pytest.raises(ValueError, match="before now"):
        clock.at(1.5, seen.append, "x")


def test_one_message_takes_size_over_the_bottleneck_rate_plus_latency() -> None:
    clock, net, arrivals = network()
    net.send(A, B, 1_000_000, lambda: arrivals.append(clock.now))
    clock.run()
    # 8 Mbit over min(A up 8 Mbit/s, B down 4 Mbit/s) = 2 s, plus 10 + 30 ms.
    assert arrivals == [pytest.approx(2.0 + 0.040)]


def test_an_uplink_sends_one_message_at_a_time_and_pairs_stay_in_order() -> None:
    clock, net, arrivals = network(loss=0.3)
    for i in range(40):
        net.send(A, C, 100_000, lambda i=i: arrivals.append((i, clock.now)))
    clock.run()
    assert [i for i, _ in arrivals] == list(range(40))  # loss delays, never reorders
    # 40 x 0.1 s on A's 8 Mbit/s uplink, serialised; some retransmitted (>= 0.2 s later).
    assert arrivals[-1][1] >= 40 * 0.1 + 0.015
    assert any(b - a >= 0.2 for (_, a), (_, b) in itertools.pairwise(arrivals))


def test_a_relayed_pair_is_capped_and_slower() -> None:
    relayed = PeerLink(up_bps=1e9, down_bps=1e9, leg_s=0.01, relayed=True, datacenter=False)
    clock, net, arrivals = network(x=relayed, y=relayed)
    x, y = b"x" * 38, b"y" * 38
    net.send(x, y, 2_500_000, lambda: arrivals.append(clock.now))
    clock.run()
    config = NetworkConfig()
    assert arrivals == [pytest.approx(8 * 2.5e6 / config.relay_bps + 0.02 + config.relay_latency_s)]


def test_a_peer_that_leaves_sends_nothing_more_but_what_was_on_the_wire_arrives() -> None:
    clock, net, arrivals = network()
    net.send(A, C, 1_000_000, lambda: arrivals.append("on the wire"))  # last bit out at 1 s
    net.send(A, C, 1_000_000, lambda: arrivals.append("still queued"))  # at 2 s
    clock.at(1.5, net.leave, A)
    clock.run()
    net.send(A, C, 10, lambda: arrivals.append("after"))
    clock.run()
    assert arrivals == ["on the wire"]


def test_links_are_drawn_within_the_configured_ranges() -> None:
    config = NetworkConfig()
    rng = np.random.default_rng(1)
    links = [draw_link(config, rng) for _ in range(500)]
    home = [link for link in links if not link.datacenter]
    assert all(10e6 <= link.up_bps <= 100e6 for link in home)
    assert all(1e9 <= link.up_bps <= 10e9 for link in links if link.datacenter)
    assert all(0.010 / 4 <= link.leg_s <= 0.300 / 4 for link in links)
    assert 0.1 < sum(link.datacenter for link in links) / 500 < 0.3
    with pytest.raises(ValueError, match=r"network\.loss"):
        NetworkConfig(loss=0.9)


def test_dht_limits_are_the_real_ones_and_a_full_key_keeps_its_oldest_owners() -> None:
    assert sim_dht.MAX_SUBKEYS == real_records.MAX_SUBKEYS
    assert sim_dht.MAX_RECORD_SET_BYTES == real_records.MAX_RECORD_SET_BYTES
    clock, net, _ = network()
    dht = SimDht(clock, net, DhtModel())
    key = b"run/sim/round/0"
    peers = [i.to_bytes(2, "big") * 19 for i in range(sim_dht.MAX_SUBKEYS + 5)]
    for i, peer in enumerate(peers):
        net.add(peer, PeerLink(1e8, 1e8, 0.01, False, False))
        clock.at(float(i), dht.write, peer, key, Declaration(peer, 0, 1.0, 1e9, float(i)), list)
    clock.run()
    assert set(dht.keys[key]) == set(peers[: sim_dht.MAX_SUBKEYS]) and dht.evicted == 5
    found: list = []
    dht.read(A, key, found.append)
    clock.run()
    assert len(found[0]) == sim_dht.MAX_SUBKEYS
    size = dht.bytes_read[(A, key)]
    assert size == DhtModel().replicas * dht.sizes[key]
    assert math.isclose(
        size / 3 / sim_dht.MAX_SUBKEYS, sim_dht.record_bytes(key, found[0][0]), rel_tol=0.01
    )


def test_a_shared_uplink_sends_one_instants_messages_together() -> None:
    clock = Clock()
    net = Network(clock, NetworkConfig(uplink="shared"), np.random.default_rng(0))
    fast = PeerLink(up_bps=8e6, down_bps=1e9, leg_s=0.01, relayed=False, datacenter=False)
    for peer in (A, B, C):
        net.add(peer, fast)
    arrivals: dict = {}
    net.send(A, B, 1_000_000, lambda: arrivals.setdefault("b", clock.now))
    net.send(A, C, 1_000_000, lambda: arrivals.setdefault("c", clock.now))
    clock.run()
    # Two 1 MB messages on an 8 Mbit/s uplink at once: both leave after 2 s, as two streams do.
    assert arrivals == {"b": pytest.approx(2.02), "c": pytest.approx(2.02)}
