"""``SimConfig.links``: peers on links fixed by the caller (``bench.sim_vs_real``'s lab links). A
round on equal links takes the bandwidth-optimal time, the links are used as given, and without
them the draws are the same as before (the existing figures stand)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.sim_vs_real import simulate
from swarm.averaging.session_wire import chunks_for
from swarm.sim import (
    ButterflyConfig,
    ButterflyRounds,
    NetworkConfig,
    PeerLink,
    SimConfig,
    Simulation,
    VectorModel,
    draw_link,
)

RATE = 50e6
LEG = 0.0125  # a pair's one-way latency: two legs, 25 ms


def optimal_s(peers: int, nbytes: float, rate: float, leg: float, phases: int = 2) -> float:
    """A perfect butterfly: each peer sends (n-1)/n of the vector twice over its link, and each
    of the two phases waits one pair latency (the reduced parts leave once the scatter is in)."""
    return 2 * (peers - 1) / peers * 8 * nbytes / rate + phases * (2 * leg)


def fixed(peers: int, numel: int, rounds: int = 3, **network: object) -> Simulation:
    link = PeerLink(up_bps=RATE, down_bps=RATE, leg_s=LEG, relayed=False, datacenter=False)
    vector = VectorModel(params=numel, chunks=chunks_for(numel, peers, RATE))
    return Simulation(
        SimConfig(
            peers=peers,
            rounds=rounds,
            start_skew_s=0.0,
            network=NetworkConfig(**network),  # type: ignore[arg-type]
            links=(link,) * peers,
        ),
        ButterflyRounds(ButterflyConfig(allreduce_timeout_s=600.0, vector=vector)),
    )


# fifo: a batch's copies leave one after another, so the first reduced parts are sent while
# the last scatter copies are still in flight and the phases overlap by one latency.
@pytest.mark.parametrize(("uplink", "phases"), [("shared", 2), ("fifo", 1)])
def test_a_four_peer_round_on_fixed_links_takes_the_optimal_time(uplink: str, phases: int) -> None:
    numel = 8_000_000
    sim = fixed(4, numel, uplink=uplink)
    assert all(sim.network.links[p].rate_bps == RATE for p in sim.peers)
    figures = sim.run()
    optimal = optimal_s(4, 4 * numel, RATE, LEG, phases)  # 7.68 s + 25 or 50 ms
    for f in figures:
        assert f.groups == 1 and f.finished == 4 and f.contributed_fraction == 1.0
        # Items' headers and contributor lists add ~4e-5 of the time; a latency is 3e-3 of it.
        assert f.allreduce_s == pytest.approx(optimal, rel=1e-3)


def test_the_bench_simulates_the_optimal_time_for_float32_and_int8() -> None:
    numel = 2_000_000
    times = simulate(4, RATE, 2 * LEG, numel, 4.0, rounds=2)
    assert times == pytest.approx([optimal_s(4, 4 * numel, RATE, LEG)] * 2, rel=1e-3)
    int8 = simulate(4, RATE, 2 * LEG, numel, 1 + 4 / 1024, rounds=1)
    assert int8 == pytest.approx([optimal_s(4, (1 + 4 / 1024) * numel, RATE, LEG)], rel=1e-3)


def test_without_links_the_draws_are_unchanged() -> None:
    config = SimConfig(peers=5, rounds=1, seed=3)
    sim = Simulation(config, ButterflyRounds(ButterflyConfig()))
    rng = np.random.default_rng([3, 0])
    assert [sim.network.links[p] for p in sim.peers] == [
        draw_link(config.network, rng) for _ in range(5)
    ]


def test_links_must_be_one_per_peer_with_positive_rates() -> None:
    link = PeerLink(up_bps=RATE, down_bps=RATE, leg_s=LEG, relayed=False, datacenter=False)
    with pytest.raises(ValueError, match="one per peer"):
        SimConfig(peers=3, rounds=1, links=(link, link))
    bad = PeerLink(up_bps=0.0, down_bps=RATE, leg_s=LEG, relayed=False, datacenter=False)
    with pytest.raises(ValueError, match="rates must be > 0"):
        SimConfig(peers=2, rounds=1, links=(link, bad))
