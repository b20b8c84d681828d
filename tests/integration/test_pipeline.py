"""SWARM pipelines with real processes on 127.0.0.1: a coordinator, stage servers and 2 trainers.

Every process is what ``swarmtrain local --pipeline-stages`` runs: ``swarmtrain coordinator`` on
a pipeline spec and ``swarmtrain node`` servers (pinned to their stages by the hidden
``--pipeline-hook``) and trainers, through ``pipeline_peer.py``, which adds faults that happen for
real. What the tests see is what the nodes show: their lines (read back by
``swarmtrain.pipeline.lines.read_line``, timed on arrival) and their ``--json`` summaries.
Checks: loss falls and the servers of each stage hold bit-identical parameters after every
averaging round; a server SIGKILLed inside a forward costs the microbatch a retry on another
server and training goes on; a deliberately slowed stage gets a server moved to it within
bounded time and the pipeline gets faster.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from p2p import HostConfig, NodeConfig, load_or_create_identity, open_node
from swarmtrain.commands import local
from swarmtrain.pipeline.local import (
    Child,
    pipeline_config,
    start_node,
    stop_all,
    summarize,
)
from swarmtrain.pipeline.node import PipelineHooks
from swarmtrain.pipeline.progress import pipeline_status

PEER = (sys.executable, str(Path(__file__).with_name("pipeline_peer.py")))
START_S = 60.0
# pipeline.average_every_s must be positive: an epoch this long never comes within a test.
NEVER_S = 1e7
LIFETIME_S = 300.0  # every node stops by itself after this, should the test die first
pytestmark = pytest.mark.timeout(150)


@dataclass
class Swarm:
    servers: list[Child]
    trainers: list[Child]
    stages: int
    join: str
    run_id: str


@contextmanager
def pipeline(
    tmp_path: Path,
    stages: int,
    server_stages: Sequence[int],
    *,
    rounds: int,
    microbatches: int,
    average_every_s: float = NEVER_S,
    rebalance_every_s: float = 0.0,
    server_hooks: dict[str, Any] | None = None,
    per_server: dict[int, list[str]] | None = None,
    trainer_hooks: dict[str, Any] | None = None,
    trainers_after_servers: bool = True,
    verbose: bool = False,
) -> Iterator[Swarm]:
    run_id = f"test-{os.urandom(3).hex()}"
    config = pipeline_config(
        run_id,
        stages,
        rounds,
        microbatches,
        average_every_s=average_every_s,
        rebalance_every_s=rebalance_every_s,
    )
    children: list[local.Child] = []  # the coordinator, then the nodes
    with ExitStack() as stack:
        stack.callback(lambda: stop_all(list(reversed(children)), 5))
        join = local.start_coordinator(tmp_path, config, children, lambda line: None)

        def node(name: str, extra: list[str]) -> Child:
            child = start_node(name, tmp_path, join, extra=extra, verbose=verbose, program=PEER)
            children.append(child)
            return child

        servers = [
            node(
                f"server{i}",
                [
                    *PipelineHooks(
                        stage=stage, lifetime_s=LIFETIME_S, **(server_hooks or {})
                    ).argv(),
                    *(per_server or {}).get(i, []),
                ],
            )
            for i, stage in enumerate(server_stages)
        ]
        # Trainers start once every server serves, so their first read of the DHT sees all of
        # them: a trainer that knew only the server about to die would fail a microbatch over
        # to nobody (it retries it after a refresh, but the kill test counts such failures).
        for s in servers if trainers_after_servers else ():
            s.wait_event("serving", START_S)
        trainers = [
            node(
                f"trainer{i}",
                [
                    "--role",
                    "trainer",
                    *PipelineHooks(lifetime_s=LIFETIME_S, **(trainer_hooks or {})).argv(),
                ],
            )
            for i in range(2)
        ]
        for s in servers:
            s.wait_event("serving", START_S)
        yield Swarm(servers, trainers, stages, join, run_id)


async def status_of(swarm: Swarm, identity: Path) -> list[dict]:
    config = NodeConfig(
        HostConfig(load_or_create_identity(identity), listen_addrs=("/ip4/127.0.0.1/tcp/0",)),
        bootstrap=(swarm.join,),
    )
    with trio.fail_after(30):
        async with open_node(config) as node:
            return await pipeline_status(node.dht, swarm.run_id, swarm.stages)


def finish(trainers: Sequence[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in trainers:
        t.proc.wait(max(0.1, deadline - time.monotonic()))
        assert t.proc.returncode == 0, (t.name, t.last_log_line(), t.lines[-3:])


def events(child: Child, kind: str) -> list[dict]:
    return child.of(kind)


def test_loss_falls_and_stage_hashes_agree_after_every_averaging(tmp_path: Path) -> None:
    with pipeline(
        tmp_path,
        3,
        [0, 1, 2, 0, 1, 2],
        # pipeline_config's learning rate, the default: see the two-stage CLI test for what 6e-3
        # did
        average_every_s=3,
        rounds=4,
        microbatches=5,
    ) as swarm:
        finish(swarm.trainers, 90)
        # Servers average on clock epochs whether or not trainers are busy: wait for one more
        # round everywhere, so every stage has averaged at least once after training.
        counts = [len(events(s, "averaged")) for s in swarm.servers]
        for server, count in zip(swarm.servers, counts, strict=True):
            deadline = time.monotonic() + 20
            while len(events(server, "averaged")) <= count and time.monotonic() < deadline:
                time.sleep(0.1)
        rows = trio.run(status_of, swarm, tmp_path / "status.key")
        stop_all(swarm.servers)  # a server writes its summary then
        summary = summarize(3, swarm.servers, swarm.trainers)
    # what swarmtrain status shows, read from the DHT by an outside node
    assert [r["servers"] for r in rows] == [2, 2, 2], rows
    assert all(r["capacity"] > 0 and r["relayed"] == 0 for r in rows), rows
    assert summary["servers_per_stage"] == [2, 2, 2]
    assert summary["loss_last"] < summary["loss_first"] - 0.3, summary
    assert summary["stage_hashes_agree"], [events(s, "averaged") for s in swarm.servers]
    by_stage = {e["stage"] for s in swarm.servers for e in events(s, "averaged")}
    assert by_stage == {0, 1, 2}
    # every averaged round of a stage had both of its servers in the group
    assert all(e["group"] == 2 for s in swarm.servers for e in events(s, "averaged"))
    assert summary["rebalances"] == 0


def test_server_killed_mid_microbatch_costs_a_retry_not_the_run(tmp_path: Path) -> None:
    with pipeline(
        tmp_path,
        2,
        [0, 1, 0, 1, 0],
        per_server={1: ["--fault", "kill-after-forwards:3"]},
        rounds=4,
        microbatches=6,
        trainer_hooks={"hop_timeout_s": 10},
        verbose=True,
    ) as swarm:
        finish(swarm.trainers, 90)
        victim = swarm.servers[1]
        assert victim.proc.wait(5) == -9, "the faulty server died by SIGKILL"
        assert "dying" in victim.lines
        summary = summarize(2, swarm.servers, swarm.trainers)  # the trainers' summaries
    finals = [t.summary() or {} for t in swarm.trainers]
    rounds = [events(t, "round") for t in swarm.trainers]
    # no microbatch was lost: every round of every trainer completed all of them
    assert all(r["microbatches"] == 6 for trainer in rounds for r in trainer)
    failures = [e for t in swarm.trainers for e in events(t, "microbatch_failed")]
    assert all(f["failed"] == 0 for f in finals), [f["reason"] for f in failures]
    assert summary["failovers"] >= 1, summary
    assert summary["loss_last"] < summary["loss_first"], summary


def test_slowed_stage_gets_a_server_and_the_pipeline_speeds_up(tmp_path: Path) -> None:
    with pipeline(
        tmp_path,
        2,
        [0, 0, 0, 1],
        rebalance_every_s=2,
        server_hooks={"rebalance_after_s": 6, "slow_stage": 1, "slow_ms": 150},
        rounds=14,
        microbatches=4,
        # rebalancing starts 6 s after the servers do: trainers starting with them see the
        # slow pipeline for a few rounds before the first move
        trainers_after_servers=False,
    ) as swarm:
        ready = max(s.wait_event("serving", 1)["at"] for s in swarm.servers)
        finish(swarm.trainers, 100)
        stop_all(swarm.servers)  # a server writes its summary then
        summary = summarize(2, swarm.servers, swarm.trainers)
    moves = sorted((e for s in swarm.servers for e in events(s, "moved")), key=lambda e: e["at"])
    assert moves and all((m["from_stage"], m["to_stage"]) == (0, 1) for m in moves), moves
    assert summary["servers_per_stage"][1] >= 2, summary
    # bounded: rebalancing starts 6 s after a server starts, epochs are 2 s
    assert moves[0]["at"] - ready < 30, (moves[0], ready)
    # throughput: rounds run wholly after the last move beat rounds that ended before the first
    rounds = [r for t in swarm.trainers for r in events(t, "round")]
    before = [r["samples_per_s"] for r in rounds if r["at"] < moves[0]["at"]]
    after = [r["samples_per_s"] for r in rounds if r["at"] - r["seconds"] > moves[-1]["at"]]
    print("samples/s before the first move", before, "after the last", after, "moves", moves)
    assert before and after, (rounds, moves)
    assert sum(after) / len(after) > 1.3 * sum(before) / len(before), (before, after)


def test_restarted_server_rejoins_with_the_stage_parameters(tmp_path: Path) -> None:
    """A server SIGKILLed and restarted (same identity, same stage) downloads its stage's last
    averaged parameters, hash-checked, instead of starting over; the stage then averages with it
    and its servers agree again."""
    with pipeline(
        tmp_path,
        2,
        [0, 1, 0, 1],
        average_every_s=3,
        rounds=6,
        microbatches=4,
        verbose=True,
    ) as swarm:
        victim, peer = swarm.servers[3], swarm.servers[1]
        # Kill only once both servers of stage 1 hold a round: killed as soon as it alone
        # finished one, the victim can cost its peer that round (a lone survivor fails), and the
        # peer then rightly serves its previous parameters.
        deadline = time.monotonic() + 60
        common: set[int] = set()
        while not common and time.monotonic() < deadline:
            time.sleep(0.1)
            common = {e["round"] for e in events(victim, "averaged")} & {
                e["round"] for e in events(peer, "averaged")
            }
        assert common, (events(victim, "averaged"), events(peer, "averaged"))
        first = max(common)
        victim.proc.kill()
        assert victim.proc.wait(5) == -9
        reborn = Child(  # the same command: the same state directory, identity and stage
            "server3-again",
            victim.proc.args,  # type: ignore[arg-type]
            tmp_path / "server3-again.log",
            victim.summary_path,
        )
        swarm.servers.append(reborn)
        try:
            joined = reborn.wait_event("joined", 60)
            deadline = time.monotonic() + 30
            while not events(reborn, "averaged") and time.monotonic() < deadline:
                time.sleep(0.1)
            finish(swarm.trainers, 90)
        finally:
            reborn.stop()
        stop_all(swarm.servers)  # a server writes its summary then
        summary = summarize(2, swarm.servers, swarm.trainers)
    assert joined["stage"] == 1 and joined["round"] >= first, (joined, first)
    after = events(reborn, "averaged")
    assert after, "the restarted server averaged with its stage"
    digests = {e["round"]: e["digest"] for e in events(peer, "averaged")}
    assert any(digests.get(e["round"]) == e["digest"] for e in after), (after, digests)
    assert summary["stage_hashes_agree"], summary
