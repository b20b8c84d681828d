"""Whole simulated rounds through the real Matchmaker and AllReduce machines: deterministic for a
seed, every peer with the same bytes equal to the exact weighted mean, and survivors of a crash
mid-round still bit-identical."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.sim import (
    ButterflyConfig,
    ButterflyRounds,
    NetworkConfig,
    SimConfig,
    Simulation,
    VectorModel,
    summary,
)


def simulation(peers: int, rounds: int = 1, seed: int = 0, **config) -> Simulation:
    protocol = ButterflyRounds(
        ButterflyConfig(allreduce_timeout_s=120.0, vector=VectorModel(params=2_000_000))
    )
    return Simulation(
        SimConfig(peers=peers, rounds=rounds, seed=seed, numel=257, **config), protocol
    )


def exact_mean(sim: Simulation, contributors, round_number: int) -> np.ndarray:
    """The all-reduce's promise: float64 sum in sorted peer order over the weight, as float32."""
    total = np.zeros(sim.config.numel, np.float64)
    weight = 0.0
    for peer, declared in sorted(contributors):
        vector, w = sim.contribution(peer, round_number)
        assert w == declared
        total += vector.astype(np.float64) * w
        weight += w
    return (total / weight).astype(np.float32)


def results(sim: Simulation, round_number: int) -> list:
    return [
        record
        for (_, r), record in sorted(sim.records.items())
        if r == round_number and record.result is not None
    ]


def test_same_seed_same_rounds_other_seed_other_rounds() -> None:
    def run(seed: int):
        sim = simulation(8, rounds=3, seed=seed, churn=0.2, network=NetworkConfig(loss=0.02))
        figures = sim.run()
        digests = [(k, r.ended_at, r.failure) for k, r in sorted(sim.records.items())]
        return figures, digests, sim.clock.events_run

    first = run(3)
    assert run(3) == first
    assert run(4) != first


def test_without_churn_every_peer_ends_with_the_exact_weighted_mean_bit_for_bit() -> None:
    for peers in (4, 8):
        sim = simulation(peers, rounds=2, seed=peers)
        figures = sim.run()
        assert [f.ok for f in figures] == [True, True]
        assert all(f.contributed_fraction == 1.0 and f.groups == 1 for f in figures)
        for r in range(2):
            done = results(sim, r)
            assert len(done) == peers
            expected = exact_mean(sim, done[0].contributors, r)
            assert {rec.result.tobytes() for rec in done} == {expected.tobytes()}
            vectors = [sim.contribution(p, r) for p in sim.peers]
            reference = np.average(
                [v.astype(np.float64) for v, _ in vectors], axis=0, weights=[w for _, w in vectors]
            )
            assert np.allclose(done[0].result, reference, rtol=1e-6, atol=1e-6)
        assert summary(figures)["rounds_ok"] == 2


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    victim=st.integers(0, 5),
    moment=st.floats(0.0, 1.0),
    froze=st.booleans(),
    seed=st.integers(0, 3),
)
def test_a_crash_mid_round_leaves_the_survivors_bit_identical(victim, moment, froze, seed) -> None:
    probe = simulation(6, seed=seed)
    probe.run()
    matched = min(r.matched_at for r in probe.records.values())
    ended = max(r.ended_at for r in probe.records.values())
    sim = simulation(6, seed=seed)
    gone = sim.peers[victim]
    sim.leave_at(gone, matched + moment * (ended - matched), froze=froze)
    sim.run()
    done = [rec for rec in results(sim, 0) if rec.peer != gone]
    assert done, "no survivor finished"
    assert len({rec.result.tobytes() for rec in done}) == 1
    assert len({rec.contributors for rec in done}) == 1
    expected = exact_mean(sim, done[0].contributors, 0)
    assert done[0].result.tobytes() == expected.tobytes()
    survivors = [p for p in sim.peers if p != gone]
    assert all(sim.records[(p, 0)].result is not None for p in survivors)


def test_bad_config_is_one_line_naming_the_key() -> None:
    import pytest

    with pytest.raises(ValueError, match="churn"):
        SimConfig(peers=4, rounds=1, churn=2.0)
    with pytest.raises(ValueError, match="allreduce_timeout_s"):
        ButterflyConfig(allreduce_timeout_s=0)
