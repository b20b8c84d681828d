"""A column headed by takeover goes to the row through relays (``GridAllReduce._gather``): the
successor of a lost head sends about sqrt(n) copies of the column, not a second broadcast of n,
and a relay lost before it forwarded is replaced by direct sends; every survivor still ends with
the same bytes, equal to the exact weighted mean over the contributors it reports."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_hierarchical import check_one_state, check_random_losses

from swarm.sim import ButterflyConfig, SimConfig, Simulation, VectorModel
from swarm.sim.hierarchical import HierarchicalRounds, SimGrid

ROW = 16
PEERS = 48  # 3 rows of 16, 16 columns: each peer heads the column of its place in the row


def grid(seed: int) -> tuple[Simulation, HierarchicalRounds]:
    protocol = HierarchicalRounds(
        ButterflyConfig(
            max_group_size=ROW, allreduce_timeout_s=600.0, vector=VectorModel(params=4_000_000)
        )
    )
    return Simulation(SimConfig(peers=PEERS, rounds=1, seed=seed, numel=64), protocol), protocol


def test_a_lost_heads_successor_sends_its_column_to_a_few_relays_not_the_whole_row() -> None:
    calm, calm_protocol = grid(seed=4)
    calm.run()
    (calm_grid,) = calm_protocol.by_round[0]
    plan = calm_grid.sized
    head = plan.peers[plan.bounds[1] + 3]  # row 1's head of column 3
    successor = plan.peers[plan.bounds[1] + 4]

    sim, protocol = grid(seed=4)
    sim.leave_at(head, calm_grid.joined_at[head] + 0.1)  # a crash before its slices went out
    sim.run()
    done = check_one_state(sim, {head})
    assert len(done) == PEERS - 1
    (churned,) = protocol.by_round[0]
    assert isinstance(churned, SimGrid)
    column = plan.part(3)[1] - plan.part(3)[0]
    broadcast = (ROW - 1) * column * protocol.config.vector.bytes_per_param  # to the row, once
    extra = churned.sent_bytes[successor] - calm_grid.sent_bytes[successor]
    # Its column 3 as head (the chain's float64 sums, the reduced sub-parts up) plus 4 relays'
    # copies of 14: well under the second broadcast it sent before.
    assert 0 < extra < 0.6 * broadcast  # before: 1.13 of it (17.0 MB)


def test_a_relay_frozen_before_it_forwarded_is_replaced_by_direct_sends() -> None:
    calm, calm_protocol = grid(seed=4)
    calm.run()
    (calm_grid,) = calm_protocol.by_round[0]
    plan = calm_grid.sized
    head, successor = plan.peers[plan.bounds[1] + 3], plan.peers[plan.bounds[1] + 4]
    start = calm_grid.joined_at[head]
    first, protocol = grid(seed=4)
    first.leave_at(head, start + 0.1)
    first.run()
    (churned,) = protocol.by_round[0]
    relays = list(churned.machines[successor]._relayed)  # whom it chose
    assert len(relays) == 4  # ceil(sqrt(14))

    sim, protocol = grid(seed=4)
    sim.leave_at(head, start + 0.1)
    # Frozen after its slices went out, 16 s in: still alive to the successor when it picks
    # its relays (a freeze shows after the 10 s peer timeout), gone before it forwards.
    relay = relays[1]
    sim.leave_at(relay, start + 16.0, froze=True)
    sim.run()
    done = check_one_state(sim, {head, relay})
    assert len(done) == PEERS - 2  # its run got column 3 from the successor directly
    (grid_run,) = protocol.by_round[0]
    assert relay not in grid_run.machines[successor]._relayed  # replaced
    assert {p for p, _ in done[0].contributors} >= {relay}  # lost after its slices: a contributor


# Derandomized: the same examples every run, never flaky.
@settings(
    max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(seed=st.integers(0, 10_000), data=st.data())
def test_heads_and_relays_lost_at_random_moments_leave_one_exact_mean(seed, data) -> None:
    check_random_losses(grid(seed)[0], data, victims=4, latest_s=60.0, fewest=2)
