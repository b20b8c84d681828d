"""Today's averaging protocol at scale, in the simulator (``swarm.sim``): real ``Matchmaker`` and
``AllReduce`` machines on a simulated network, in virtual time.

    python -m bench.sim --peers 1000 --rounds 5 --churn 0.05 --seed 0
        [--params 1e8] [--bytes-per-param 1] [--allreduce-timeout 600]
        [--matchmaking-timeout 4] [--max-group-size 64] [--compute-s 0] [--loss 0]
        [--uplink fifo|shared] [--numel 256] [--protocol butterfly|hierarchical]
        [--pipeline-stages 4] [--pipeline-servers N] [--pipeline-seconds 120] ...

Peers' links are drawn from ``swarm.sim.NetworkConfig``'s defaults (a fifth in datacenters at
1-10 Gbit/s, the rest homes with 10-100 Mbit/s uplinks, RTT 10-300 ms, a fifth of homes behind
NATs that need a relay). Each message's time is that of its part of a ``--params`` vector at
``--bytes-per-param`` (1: int8, what run.toml's ``compression = "auto"`` sends for big tensors;
4: float32); the machines average small real vectors. ``--allreduce-timeout`` defaults to 600 s,
not run.toml's 30 s, which a 100M-parameter round over a home uplink cannot meet (the bound alone
is 2 x 100 MB over 10-100 Mbit/s: 16-160 s).

One row per round (``swarm.sim.report`` defines every column): peers that started it, peers that
left during it, groups, peers that finished, distinct result states among them, the share of
peers whose contribution is in the kept state (the one most finishers hold), round time, the
longest matchmaking, the slowest group's all-reduce time against its limit (a perfect ring over
its slowest member's link), the most connections one peer had, DHT bytes read per peer. The last
line is one JSON object: ``peers``, ``rounds_ok`` (rounds that left one state), the median
``allreduce_over_limit``, the mean ``contributed_fraction``, ``max_connections_per_peer``,
``dht_read_bytes_per_peer_round``, ``groups_per_round``, ``states_per_round_max``,
``mismatched_groups`` (groups whose finishers disagree: must be 0), and the run's cost.

The pipeline router (``swarm.sim.pipeline``: the real ``Router``, ``MicrobatchRoute`` and
``plan_move``): ``--pipeline-servers`` stage servers (default peers / 4) over
``--pipeline-stages`` stages, ``--pipeline-trainers`` trainers (default servers / 10) keeping
``--pipeline-in-flight`` microbatches each (default 4 per server over all trainers) of
``--pipeline-activation-bytes`` per hop, for ``--pipeline-seconds`` of virtual time; churn is
``--churn`` of the servers leaving (and as many joining) per ``--pipeline-round-s``. It runs
twice from the same seed, with that churn and without; the row ``pipeline`` and the JSON's
``pipeline_churn_ratio`` give churned throughput over churn-free throughput (one run and 1.0
without churn), ``pipeline_throughput_per_s`` both throughputs and ``pipeline_over_bound`` each
run's throughput over its capacity bound. ``--pipeline-servers 0`` skips it.

``--protocol hierarchical``: matchmaking forms one group of every declarer and the round runs the
hierarchical all-reduce (``swarm.averaging.hierarchical``) on rows of at most ``--max-group-size``;
the JSON adds ``sent_over_vector``, the most bytes one peer sent in a round over the vector's size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from bench.common import git_sha
from bench.progress import BenchProgress
from swarm import RoundSchedule, shard_count
from swarm.sim import (
    ButterflyConfig,
    ButterflyRounds,
    HierarchicalRounds,
    NetworkConfig,
    PipelineConfig,
    PipelineFigures,
    PipelineSim,
    SimConfig,
    Simulation,
    VectorModel,
    summary,
)


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Simulation]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--churn", type=float, default=0.0, help="share leaving per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--params", type=float, default=1e8, help="simulated vector length")
    parser.add_argument("--bytes-per-param", type=float, default=1.0)
    parser.add_argument("--allreduce-timeout", type=float, default=600.0)
    parser.add_argument("--matchmaking-timeout", type=float, default=4.0)
    parser.add_argument("--max-group-size", type=int, default=64)
    parser.add_argument("--compute-s", type=float, default=0.0, help="inner phase per round")
    parser.add_argument("--loss", type=float, default=0.0, help="message loss probability")
    parser.add_argument(
        "--uplink",
        default="shared",
        help="fifo (one message at a time) or shared (swarm.sim.network)",
    )
    parser.add_argument("--numel", type=int, default=256, help="real values each peer averages")
    parser.add_argument("--protocol", default="butterfly", choices=("butterfly", "hierarchical"))
    parser.add_argument(
        "--matchmaking",
        choices=("expected", "scheduled"),
        help="expected: rules 1-2 (butterfly's default); scheduled: RoundSchedule (hierarchical's)",
    )
    parser.add_argument(
        "--shards", type=int, help="round keys (default: shard_count(peers) when scheduled, else 1)"
    )
    parser.add_argument("--window", type=float, default=5.0, help="scheduled: least window, s")
    parser.add_argument("--spread-factor", type=float, default=2.0, help="scheduled: window/spread")
    parser.add_argument("--quorum-share", type=float, default=0.85, help="scheduled: of the hint")
    parser.add_argument("--poll", type=float, default=2.0, help="scheduled: clock-shard poll, s")
    parser.add_argument("--pipeline-stages", type=int, default=4)
    parser.add_argument("--pipeline-servers", type=int, help="default peers / 4; 0: no pipeline")
    parser.add_argument("--pipeline-trainers", type=int, help="default servers / 10")
    parser.add_argument("--pipeline-in-flight", type=int, help="per trainer; default 4 per server")
    parser.add_argument("--pipeline-activation-bytes", type=float, default=1e6)
    parser.add_argument("--pipeline-seconds", type=float, default=120.0, help="virtual")
    parser.add_argument("--pipeline-round-s", type=float, default=60.0, help="churn's span")
    args = parser.parse_args(argv)
    kind = HierarchicalRounds if args.protocol == "hierarchical" else ButterflyRounds
    if args.matchmaking is None:
        args.matchmaking = "scheduled" if args.protocol == "hierarchical" else "expected"
    scheduled = args.matchmaking == "scheduled"
    try:
        if args.shards is None:
            args.shards = shard_count(args.peers) if scheduled else 1
        schedule = (
            RoundSchedule.for_swarm(
                args.peers,
                args.shards,
                window_s=args.window,
                spread_factor=args.spread_factor,
                quorum_share=args.quorum_share,
                poll_s=args.poll,
            )
            if scheduled
            else None
        )
        protocol = kind(
            ButterflyConfig(
                max_group_size=args.max_group_size,
                matchmaking_timeout_s=args.matchmaking_timeout,
                allreduce_timeout_s=args.allreduce_timeout,
                vector=VectorModel(params=int(args.params), bytes_per_param=args.bytes_per_param),
                shards=args.shards,
                schedule=schedule,
            )
        )
        config = SimConfig(
            peers=args.peers,
            rounds=args.rounds,
            seed=args.seed,
            churn=args.churn,
            compute_s=args.compute_s,
            numel=args.numel,
            network=NetworkConfig(loss=args.loss, uplink=args.uplink),
        )
        args.pipeline = pipeline_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args, Simulation(config, protocol)


def pipeline_config(args: argparse.Namespace) -> PipelineConfig | None:
    """The pipeline scenario of ``args`` (module docstring), None for ``--pipeline-servers 0``."""
    servers = args.pipeline_servers
    if servers is None:
        servers = max(args.pipeline_stages, args.peers // 4)
    if servers == 0:
        return None
    trainers = args.pipeline_trainers or max(1, servers // 10)
    in_flight = args.pipeline_in_flight or max(1, round(4 * servers / trainers))
    return PipelineConfig(
        stages=args.pipeline_stages,
        servers=servers,
        trainers=trainers,
        in_flight=in_flight,
        seconds=args.pipeline_seconds,
        warmup_s=min(20.0, args.pipeline_seconds / 6),
        seed=args.seed,
        churn=args.churn,
        round_s=args.pipeline_round_s,
        activation_bytes=args.pipeline_activation_bytes,
    )


def run_pipeline(config: PipelineConfig) -> dict[str, object]:
    """The scenario with its churn and churn-free (one run when it has none), printed."""
    churned = PipelineSim(config).run()
    quiet = PipelineSim(replace(config, churn=0.0)).run() if config.churn else churned
    rows: list[tuple[str, PipelineFigures]] = [("churn", churned), ("no churn", quiet)]
    for name, f in rows[: 2 if config.churn else 1]:
        print(
            f"pipeline ({name}): {config.stages} stages, {config.servers} servers, "
            f"{config.trainers} trainers x {config.in_flight} in flight: "
            f"{f.throughput_per_s:.2f} microbatches/s, bound {f.bound_per_s:.2f}, "
            f"completed {f.completed}, lost {sum(f.lost.values())} {f.lost}, failovers "
            f"{f.failovers}, hop failures {f.hop_failures}, moves {f.moves}, "
            f"left {f.departures}, joined {f.joins}, servers per stage {list(f.servers_per_stage)}"
        )
    ratio = churned.throughput_per_s / quiet.throughput_per_s if quiet.throughput_per_s else 0.0
    print(f"pipeline: churned / churn-free throughput {ratio:.3f}")
    return {
        "pipeline_churn_ratio": round(ratio, 3),
        "pipeline_throughput_per_s": [
            round(churned.throughput_per_s, 2),
            round(quiet.throughput_per_s, 2),
        ],
        "pipeline_over_bound": [
            round(f.throughput_per_s / f.bound_per_s, 3) if f.bound_per_s else 0.0
            for f in (churned, quiet)
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    args, sim = parse(argv)
    print(
        f"=== bench.sim ({git_sha()}): {args.peers} peers, {args.rounds} rounds, churn "
        f"{args.churn}, {args.params:.3g} params x {args.bytes_per_param} B, seed {args.seed}, "
        f"uplink {args.uplink}, {args.protocol}, max group {args.max_group_size}, timeouts "
        f"{args.matchmaking_timeout} / {args.allreduce_timeout} s, {args.matchmaking} "
        f"matchmaking over {args.shards} key(s) ===",
        flush=True,
    )
    started, cpu = time.perf_counter(), time.process_time()
    # The newest round any peer began, out of R: a bar on a terminal, a line per tenth otherwise.
    with BenchProgress() as progress:
        progress.add("sim", args.rounds)
        figures = sim.run(on_round=lambda r: progress.reach("sim", r))
        progress.reach("sim", args.rounds)
    print(
        f"{'round':>5} {'peers':>5} {'left':>4} {'groups':>6} {'done':>5} {'states':>6} "
        f"{'contrib':>7} {'round_s':>8} {'match_s':>7} {'ar_s':>7} {'limit_s':>7} "
        f"{'ar/lim':>6} {'conns':>5} {'dht_kB':>7}"
    )
    for f in figures:
        print(
            f"{f.round:>5} {f.peers:>5} {f.left:>4} {f.groups:>6} {f.finished:>5} {f.states:>6} "
            f"{f.contributed_fraction:>7.3f} {_fmt(f.round_s):>8} {_fmt(f.match_s):>7} "
            f"{_fmt(f.allreduce_s):>7} {_fmt(f.limit_s):>7} {_fmt(f.over_limit, 2):>6} "
            f"{f.max_connections:>5} {f.dht_read_bytes_per_peer / 1000:>7.0f}"
        )
    result = summary(figures)
    if isinstance(sim.protocol, HierarchicalRounds):
        sent = [sim.protocol.sent_over_vector(f.round) for f in figures]
        result["sent_over_vector"] = round(
            max((s for s in sent if not math.isnan(s)), default=0), 3
        )
    result.update(
        matchmaking=args.matchmaking,
        shards=args.shards,
        seed=args.seed,
        churn=args.churn,
        joins=sim.joins,
        departures=sim.departures,
        dht_evicted=sim.dht.evicted,
        events=sim.clock.events_run,
        virtual_s=round(sim.clock.now, 1),
        wall_s=round(time.perf_counter() - started, 1),
        cpu_s=round(time.process_time() - cpu, 1),
    )
    if args.pipeline is not None:
        cpu = time.process_time()
        result.update(run_pipeline(args.pipeline))
        result["pipeline_cpu_s"] = round(time.process_time() - cpu, 1)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
