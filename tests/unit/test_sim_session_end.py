"""A finished round's all-reduce sessions end (at their deadline, or once every member they may
serve is settled), so a peer that leaves in a later round makes no finished round's machines act.

Before, the simulator fed a departure to every earlier round's machines forever: in a grid the
departed peer's row mates took over its columns and sent them to their rows again, round after
round, on the uplinks the current round needed (1,000 peers, 5% churn: rounds 5-9 failed at the
600 s deadline for every peer; 100 peers, seed 0: rounds 7 and 8)."""

from __future__ import annotations

import pytest

from swarm import RoundSchedule
from swarm.sim import ButterflyConfig, ButterflyRounds, SimConfig, Simulation, VectorModel
from swarm.sim.hierarchical import HierarchicalRounds

PEERS = 24
ROW = 8  # 3 rows of 8, 8 columns: every peer heads a column of round 0


def simulation(kind: type[ButterflyRounds]) -> Simulation:
    protocol = kind(
        ButterflyConfig(
            # the grid's rows; one butterfly group (Moshpit groups would each end with a state)
            max_group_size=ROW if kind is HierarchicalRounds else PEERS,
            allreduce_timeout_s=600.0,
            vector=VectorModel(params=20_000_000),
            schedule=RoundSchedule.for_swarm(PEERS, 1),
        )
    )
    return Simulation(SimConfig(peers=PEERS, rounds=2, seed=3, numel=64), protocol)


def round_end(sim: Simulation, round_number: int) -> float:
    ends = [r.ended_at for (_, n), r in sim.records.items() if n == round_number]
    assert all(t is not None for t in ends)
    return max(ends)  # type: ignore[type-var]


@pytest.mark.parametrize("kind", [HierarchicalRounds, ButterflyRounds])
def test_a_departure_in_round_1_costs_round_0_nothing(kind) -> None:
    calm = simulation(kind)
    calm.run()
    r0_end, r1_end = round_end(calm, 0), round_end(calm, 1)
    assert r0_end < r1_end

    churned = simulation(kind)
    victim = churned.peers[5]
    churned.leave_at(victim, (r0_end + r1_end) / 2)  # a crash, mid round 1
    figures = churned.run()

    def round_0(sim: Simulation) -> list:
        return sim.protocol.by_round[0]  # type: ignore[attr-defined]

    # Round 0 looks the same with or without the later departure: the same results, and no
    # machine of it sent a byte or opened a connection because of it.
    assert [r.result.tobytes() for (_, n), r in sorted(churned.records.items()) if n == 0] == [
        r.result.tobytes() for (_, n), r in sorted(calm.records.items()) if n == 0
    ]
    for calm_session, churned_session in zip(round_0(calm), round_0(churned), strict=True):
        assert calm_session.closed == set(calm_session.members)  # every session ended
        assert churned_session.contacts == calm_session.contacts
        assert churned_session.sent_bytes == calm_session.sent_bytes
    # ... and round 1 still ends with one state over everyone else
    assert figures[1].states == 1
    assert figures[1].finished == PEERS - 1
