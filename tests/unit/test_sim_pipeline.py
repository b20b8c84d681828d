"""The SWARM pipeline in the simulator (``swarm.sim.pipeline``): the real ``Router``,
``MicrobatchRoute`` and ``plan_move`` on the virtual clock. Deterministic for a seed; churn-free
throughput near the bottleneck's capacity; a departed server's microbatches rerouted and every
started microbatch accounted for; the rebalancer staffing an understaffed stage, small or
large."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swarm.pipeline.routing import penalizes
from swarm.sim.pipeline import PipelineConfig, PipelineSim

SMALL = PipelineConfig(
    stages=3, servers=18, trainers=3, in_flight=16, seconds=100.0, warmup_s=20.0, seed=3
)


def accounted(sim: PipelineSim) -> None:
    """Every microbatch started is done, lost with a reason, or still in flight at the end."""
    f = sim.figures()
    assert f.started == f.completed + sum(f.lost.values()) + f.in_flight
    ends = [mb.ended for mb in sim.records.values()]
    assert ends.count("done") == f.completed and ends.count(None) == f.in_flight
    for kind, count in f.lost.items():
        assert ends.count(f"lost:{kind}") == count and kind in ("deadline", "attempts", "no_server")


def test_same_seed_same_figures_and_another_seed_differs() -> None:
    config = replace(SMALL, churn=0.3, round_s=20.0)
    first, second = PipelineSim(config).run(), PipelineSim(config).run()
    assert first == second
    assert first.departures > 0 and first.joins > 0 and first.completed > 100
    assert PipelineSim(replace(config, seed=4)).run() != first


def test_churn_free_throughput_is_near_the_bottleneck_bound() -> None:
    # Small activations: compute binds. The bound is an upper bound (no stage finishes more
    # than the sum of its servers' rates); throughput falls short of it when a bottleneck
    # server's queue runs empty. With 48 microbatches in flight over 3 stages of near-equal
    # capacity (random rates), the queues spread over the stages: over seeds 0-9 this config
    # gave 0.91-0.99 of the bound, and for seed 5 (0.91) every server of the two stages tied
    # at the bottleneck was busy 0.87-0.94 of the window, so the gap is the closed loop, not
    # lost work. Hence 0.9 below; above, 1.02 for work queued before the window that finishes
    # inside it.
    config = replace(SMALL, activation_bytes=1e4, rebalance_every_s=None, seconds=200.0)
    for seed in (0, 1):
        sim = PipelineSim(replace(config, seed=seed))
        f = sim.run()
        assert f.lost == {} and f.moves == 0
        assert 0.9 * f.bound_per_s <= f.throughput_per_s <= 1.02 * f.bound_per_s, f
        capacities = [0.0] * config.stages
        for server in sim.servers.values():
            capacities[server.stage] += server.rate
        assert f.bound_per_s == pytest.approx(min(capacities))  # compute binds here
        accounted(sim)


def test_links_bind_the_bound_when_activations_are_large() -> None:
    # 4 MB a hop: a home server's 10-100 Mbit/s uplink sends its two activations a microbatch
    # slower than some compute. The link term is a loose bound (a hop also waits its latency
    # and the trainer's uplink; measured 0.35-0.55 of it here), but never exceeded.
    sim = PipelineSim(replace(SMALL, activation_bytes=4e6, rebalance_every_s=None))
    f = sim.run()
    capacities = [0.0] * SMALL.stages
    for server in sim.servers.values():
        capacities[server.stage] += server.rate
    assert f.bound_per_s < 0.8 * min(capacities)
    assert 0 < f.throughput_per_s <= 1.02 * f.bound_per_s
    accounted(sim)


@pytest.mark.parametrize("froze", [False, True])
def test_a_departed_servers_microbatches_are_rerouted_and_complete(froze: bool) -> None:
    sim = PipelineSim(replace(SMALL, rebalance_every_s=None, seconds=120.0))
    # stage 1's two fastest servers: the most work pending on them
    victims = sorted((s for s in sim.servers.values() if s.stage == 1), key=lambda s: -s.rate)
    for victim in victims[:2]:
        sim.leave_at(victim.peer, 30.0, froze=froze)
    f = sim.run()
    gone = {v.peer for v in victims[:2]}
    hit = [mb_id for peer in gone for mb_id in sim.hit[peer]]
    assert len(hit) >= 4, "too little was pending on the victims when they left"
    kind = "hop_timeout" if froze else "connection"
    assert f.hop_failures.get(kind, 0) >= len(hit) and f.failovers >= len(hit)
    for mb_id in hit:
        mb = sim.records[mb_id]
        assert mb.ended == "done", mb.ended
        assert mb.path[1] not in gone  # its hop at stage 1 was redone by another server
    # Nobody finishes through a server after it left (a backward it held is redone elsewhere).
    for mb in sim.records.values():
        if mb.ended == "done" and mb.finished_at > 30.0 + SMALL.hop_timeout_s:
            assert not gone & set(mb.path)
    assert f.lost == {} and f.departures == 2 and f.servers_per_stage[1] == 4
    accounted(sim)


def test_the_rebalancer_moves_servers_to_an_understaffed_stage() -> None:
    stages = (0,) * 7 + (1,)  # stage 1 has one server: the bottleneck
    config = PipelineConfig(
        stages=2, servers=8, trainers=2, in_flight=8, seconds=120.0, warmup_s=60.0,
        rate_range=(1.0, 1.0), initial_stages=stages, stage_bytes=1e7, seed=1,
    )  # fmt: skip
    still = PipelineSim(replace(config, rebalance_every_s=None)).run()
    assert still.servers_per_stage == (7, 1)
    sim = PipelineSim(config)
    moved = sim.run()
    assert moved.moves >= 2 and moved.servers_per_stage in ((4, 4), (5, 3))
    assert moved.throughput_per_s > 2.5 * still.throughput_per_s
    assert moved.bound_per_s > 2.5 * still.bound_per_s
    accounted(sim)


def test_a_large_skewed_pipeline_is_restaffed_over_time() -> None:
    """40 servers on stage 0 beside 70 on each other stage, all at 1 microbatch/s: one server
    adds 2.5% to the bottleneck, which a threshold relative to the stage's capacity never let
    through. Moves, one per epoch and a quiet epoch pair, bring it near 62.5 a stage; small
    activations keep it compute-bound, so the bottleneck's 40/s is the unrebalanced ceiling
    (the pipeline ran at 39.6/s without rebalancing, 50.8/s with it)."""
    layout = (0,) * 40 + (1,) * 70 + (2,) * 70 + (3,) * 70
    config = PipelineConfig(
        stages=4, servers=len(layout), trainers=10, in_flight=60, seconds=240.0,
        warmup_s=180.0, rate_range=(1.0, 1.0), initial_stages=layout, activation_bytes=1e5,
        stage_bytes=1e7, seed=2,
    )  # fmt: skip
    sim = PipelineSim(config)
    f = sim.run()
    assert f.moves >= 18 and min(f.servers_per_stage) >= 58, f
    assert f.bound_per_s > 55.0 and f.throughput_per_s > 1.2 * 40.0, f
    assert f.lost == {}
    accounted(sim)


def test_only_a_lost_context_goes_unpenalized() -> None:
    assert not penalizes("unknown-microbatch")
    assert penalizes(None) and penalizes("wrong-stage") and penalizes("timeout")


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="initial_stages"):
        PipelineConfig(stages=2, servers=2, initial_stages=(0, 2))
    with pytest.raises(ValueError, match="warmup_s"):
        PipelineConfig(seconds=10.0, warmup_s=10.0)
