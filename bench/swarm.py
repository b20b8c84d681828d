"""SWARM parallelism under heterogeneity and churn: throughput of four set-ups, side by side.

Each scenario is a fresh swarm on 127.0.0.1 (a coordinator, stage servers, 2 trainers: the
``swarmtrain coordinator`` and ``swarmtrain node`` processes of ``swarmtrain local
--pipeline-stages``, set up through the hidden ``--pipeline-hook``) trained for ``--seconds``;
throughput is the trainers' completed samples per second over that window (their ``--json``
summaries):

* ``rebalanced``: stochastic wiring + failover + rebalancing, with churn;
* ``wiring_only``: the same swarm and churn, rebalancing off;
* ``no_churn``: stochastic wiring + rebalancing, nobody killed (the reference);
* ``fixed``: one server per stage, no failover: the first failure stops the pipeline (a classic
  pipeline), with the same churn.

Heterogeneity: every server is a machine of a set speed, a delay per call (``--base-ms``), and
``--slow-servers`` of them are slower (``--slow-ms``), all placed on the last stage at the start, so
the swarm starts unbalanced. Delays rather than real compute, so that the stages' capacities, not
this machine's shared cores, limit the pipeline. The fixed pipeline gets fast servers only.
Churn: every ``--churn-every-s`` a random live server is SIGKILLed and restarted (same identity,
same initial stage; it downloads that stage's parameters on joining) ``--down-s`` later.

Target (the issue): ``rebalanced_sps / no_churn_sps >= 0.8``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import git_sha
from bench.progress import BenchProgress
from swarmtrain.commands import local
from swarmtrain.pipeline.local import Child, pipeline_config, start_node, stop_all
from swarmtrain.pipeline.node import PipelineHooks


def run_scenario(
    name: str,
    args: argparse.Namespace,
    *,
    servers_n: int,
    rebalance: bool,
    churn: bool,
    fixed: bool,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    run_id = f"bench-{name}-{os.urandom(3).hex()}"
    stages = args.stages
    children: list[local.Child] = []  # the coordinator, then the nodes
    nodes: list[Child] = []
    lifetime_s = args.seconds + 120
    config = pipeline_config(
        run_id,
        stages,
        rounds=1,  # the trainers train for --seconds instead (the duration_s hook)
        microbatches=8,
        average_every_s=args.average_every_s,
        rebalance_every_s=args.rebalance_every_s if rebalance else 0.0,
    )
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp:
        workdir = Path(tmp)
        try:
            join = local.start_coordinator(workdir, config, children, lambda line: None)
            stage_of = [i % stages for i in range(servers_n)]
            last_stage = [i for i in reversed(range(servers_n)) if stage_of[i] == stages - 1]
            slow = set() if fixed else set(last_stage[: args.slow_servers])

            def start_node_(name: str, hooks: PipelineHooks, extra: list[str]) -> Child:
                child = start_node(name, workdir, join, extra=[*extra, *hooks.argv()])
                children.append(child)
                nodes.append(child)
                return child

            def start_server(i: int) -> Child:
                # Every server is a "machine" whose speed is a delay per call, so stage capacity,
                # not this box's shared CPU, is what limits the pipeline. A restart keeps its
                # state directory: the same identity, the same initial stage.
                delay = args.slow_ms if i in slow else args.base_ms
                hooks = PipelineHooks(
                    stage=stage_of[i], machine_slow_ms=delay, rebalance_after_s=4,
                    lifetime_s=lifetime_s,
                )  # fmt: skip
                return start_node_(f"s{i}", hooks, [])

            servers = [start_server(i) for i in range(servers_n)]
            for s in servers:
                s.wait_event("serving", 90)
            trainer_hooks = PipelineHooks(
                duration_s=args.seconds, in_flight=args.in_flight, hop_timeout_s=5,
                stop_on_failure=fixed or None, lifetime_s=lifetime_s,
            )  # fmt: skip
            trainers = [
                start_node_(f"t{i}", trainer_hooks, ["--role", "trainer"]) for i in range(2)
            ]
            for t in trainers:
                t.wait_event("ready", 90)
            kills = 0
            done = threading.Event()

            def churner() -> None:
                nonlocal kills
                while not done.wait(args.churn_every_s):
                    alive = [i for i, s in enumerate(servers) if s.proc.poll() is None]
                    if not alive:
                        continue
                    victim = rng.choice(alive)
                    servers[victim].proc.kill()
                    kills += 1
                    if done.wait(args.down_s):
                        return
                    servers[victim] = start_server(victim)

            thread = threading.Thread(target=churner, daemon=True)
            if churn:
                thread.start()
            for t in trainers:
                t.proc.wait(args.seconds + 90)
            done.set()
            if churn:
                thread.join(timeout=5)
            finals = [t.summary() or {} for t in trainers]
            samples = sum(int(f.get("samples", 0)) for f in finals)
            moves = sum(len(s.of("moved")) for s in nodes)
            rounds = [e for t in trainers for e in t.of("round")]
            return {
                "sps": samples / args.seconds,
                "rounds": len(rounds),
                "samples": samples,
                "kills": kills,
                "moves": moves,
                "failovers": sum(int(f.get("failovers", 0)) for f in finals),
                "stopped": any(f.get("gave_up") for f in finals),
            }
        finally:
            stop_all(list(reversed(children)), 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--servers", type=int, default=6)
    p.add_argument("--seconds", type=float, default=40.0, help="training window per scenario")
    p.add_argument("--slow-servers", type=int, default=2)
    p.add_argument("--slow-ms", type=float, default=150.0, help="delay per call, slow servers")
    p.add_argument("--base-ms", type=float, default=20.0, help="delay per call, the others")
    p.add_argument("--in-flight", type=int, default=4, help="microbatches in flight per trainer")
    p.add_argument("--churn-every-s", type=float, default=8.0)
    p.add_argument("--down-s", type=float, default=4.0)
    p.add_argument("--average-every-s", type=float, default=5.0)
    p.add_argument("--rebalance-every-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    scenarios = {
        "rebalanced": dict(servers_n=args.servers, rebalance=True, churn=True, fixed=False),
        "wiring_only": dict(servers_n=args.servers, rebalance=False, churn=True, fixed=False),
        "no_churn": dict(servers_n=args.servers, rebalance=True, churn=False, fixed=False),
        "fixed": dict(servers_n=args.stages, rebalance=False, churn=True, fixed=True),
    }
    results = {}
    progress = BenchProgress()
    for name, spec in scenarios.items():
        started = time.monotonic()
        progress.phase(f"scenario {name}: starting its servers and trainers")
        # The training window on a bar (a line per tenth of it off a terminal).
        with progress.ticking(name, args.seconds):
            results[name] = run_scenario(name, args, seed=args.seed, **spec)  # type: ignore[arg-type]
        r = results[name]
        progress.line(
            f"{name:12s} {r['sps']:7.1f} samples/s  ({r['samples']} samples, {r['kills']} kills, "
            f"{r['moves']} moves, {r['failovers']} failovers"
            f"{', stopped at its first failure' if r['stopped'] else ''}; "
            f"{time.monotonic() - started:.0f} s)"
        )
    progress.close()
    line = {
        "bench": "swarm",
        "config": {k: v for k, v in vars(args).items()},
        "git_sha": git_sha(),
        "rebalanced_sps": round(results["rebalanced"]["sps"], 2),
        "wiring_only_sps": round(results["wiring_only"]["sps"], 2),
        "no_churn_sps": round(results["no_churn"]["sps"], 2),
        "fixed_sps": round(results["fixed"]["sps"], 2),
        "ratio": round(results["rebalanced"]["sps"] / max(results["no_churn"]["sps"], 1e-9), 3),
        "target_ratio": 0.8,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
