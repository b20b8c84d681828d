"""Soak: a real relay and a real coordinator under a steady stream of clients that connect, query
and leave, as a public service meets strangers for weeks.

    python -m bench.soak --connections 5000 --minutes 10

``--clients`` clients run at once; each, again and again: connect to the relay or the
coordinator (alternately), ask it a ping, a DHT GET and (the coordinator) the run spec, each
answer timed, then close the connection. Identify runs on every connection, as libp2p does. Every
``--report-s`` a progress line: connections, failed ones, p99 answer time, the targets' RSS and
open files. Ends at ``--connections`` or ``--minutes``, whichever comes first. The last stdout
line is one JSON object: ``connections``, ``failed``, ``p99_ms``, ``rss_growth_mib`` (the larger
target's growth from the end of the warm-up, the first fifth of the run, to the end) and
``fds_growth``. Target: 0 failed, RSS flat after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from bench.common import git_sha
from bench.progress import BenchProgress
from bench.targets import Target, start, stop
from p2p import Dht, HostConfig, call_unary, open_host
from p2p.node import PING_PROTOCOL, PingReply, PingRequest
from swarmtrain.commands.coordinator import SPEC_PROTOCOL, RunSpecReply, RunSpecRequest


@dataclass
class Tally:
    connections: int = 0
    failed: int = 0
    answers_ms: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def p99_ms(self) -> float:
        if not self.answers_ms:
            return 0.0
        ordered = sorted(self.answers_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def one_connection(
    host: object, dht: Dht, target: Target, tally: Tally, timeout_s: float
) -> None:
    peer = target.peer_id
    try:
        with trio.fail_after(timeout_s):
            await host.connect(peer, [multiaddr.Multiaddr(target.addr)])  # type: ignore[attr-defined]
            queries = [
                lambda: call_unary(
                    host, peer, PING_PROTOCOL, PingRequest(b"soak"), PingReply, deadline_s=timeout_s
                ),
                lambda: dht.get_records_from(peer, "soak/probe"),
            ]
            if target.name == "coordinator":
                queries.append(
                    lambda: call_unary(
                        host, peer, SPEC_PROTOCOL, RunSpecRequest(1), RunSpecReply, deadline_s=10
                    )
                )
            for query in queries:
                started = time.perf_counter()
                await query()
                tally.answers_ms.append((time.perf_counter() - started) * 1000)
        tally.connections += 1
    except Exception as exc:
        tally.failed += 1
        reason = type(exc).__name__
        tally.failures[reason] = tally.failures.get(reason, 0) + 1
    finally:
        network = host.libp2p.get_network()  # type: ignore[attr-defined]
        with trio.move_on_after(5):
            await network.close_peer(peer)


async def client(targets: list[Target], tally: Tally, stop: trio.Event, index: int) -> None:
    async with open_host(HostConfig(create_new_key_pair())) as host:
        dht = Dht(host, server=False)
        turn = index
        while not stop.is_set():
            turn += 1
            await one_connection(host, dht, targets[turn % len(targets)], tally, 10.0)


async def soak(
    args: argparse.Namespace, targets: list[Target], progress: BenchProgress
) -> dict[str, object]:
    tally = Tally()
    stop = trio.Event()
    started = time.monotonic()
    end = started + args.minutes * 60
    warm_at = max(1, args.connections // 5)
    warm: dict[str, tuple[float, int]] = {}
    samples: list[dict[str, object]] = []

    def sample() -> dict[str, object]:
        row: dict[str, object] = {
            "t_s": round(time.monotonic() - started, 1),
            "connections": tally.connections,
            "failed": tally.failed,
            "p99_ms": round(tally.p99_ms(), 1),
        }
        for target in targets:
            row[f"{target.name}_rss_mib"] = round(target.rss_mib(), 1)
            row[f"{target.name}_fds"] = target.fds()
        return row

    async with trio.open_nursery() as nursery:
        for index in range(args.clients):
            nursery.start_soon(client, targets, tally, stop, index)
        next_report = time.monotonic() + args.report_s
        # Its report lines are the plain form; a terminal also gets a bar of connections.
        progress.add("soak", args.connections, unit="connections", plain_lines=False)
        while tally.connections + tally.failed < args.connections and time.monotonic() < end:
            await trio.sleep(0.2)
            progress.reach("soak", tally.connections + tally.failed)
            if not warm and tally.connections + tally.failed >= warm_at:
                warm = {t.name: (t.rss_mib(), t.fds()) for t in targets}
            if time.monotonic() >= next_report:
                next_report += args.report_s
                row = sample()
                samples.append(row)
                progress.line(" ".join(f"{k}={v}" for k, v in row.items()))
            if any(t.proc.poll() is not None for t in targets):
                break
        stop.set()
    final = sample()
    progress.line(" ".join(f"{k}={v}" for k, v in final.items()))
    if not warm:
        warm = {t.name: (t.rss_mib(), t.fds()) for t in targets}
    return {
        "connections": tally.connections,
        "failed": tally.failed,
        "failures": tally.failures,
        "p99_ms": round(tally.p99_ms(), 1),
        "rss_growth_mib": round(max(t.rss_mib() - warm[t.name][0] for t in targets), 1),
        "fds_growth": max(t.fds() - warm[t.name][1] for t in targets),
        "targets_alive": all(t.proc.poll() is None for t in targets),
        "seconds": round(time.monotonic() - started, 1),
        "samples": samples,
    }


def _has_addr(line: str) -> bool:
    return "/p2p/" in line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8, help="clients at once")
    parser.add_argument("--report-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0, help="unused: the load is not random")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "CRITICAL"))
    with BenchProgress() as progress, tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        progress.phase("starting a relay and a coordinator")
        workdir = Path(tmp)
        listen = ["--listen", "/ip4/127.0.0.1/tcp/0"]
        targets = [
            start("relay", ["relay", "--identity", str(workdir / "r.key"), *listen], workdir,
                  _has_addr)
        ]  # fmt: skip
        try:
            targets.append(
                start("coordinator", ["coordinator", "--identity", str(workdir / "c.key"),
                      *listen], workdir, _has_addr)
            )  # fmt: skip
            result: dict[str, object] = {
                "bench": "soak",
                "config": {
                    "connections": args.connections,
                    "minutes": args.minutes,
                    "clients": args.clients,
                },
                "git_sha": git_sha(),
            }
            result.update(trio.run(soak, args, targets, progress))
        finally:
            stop(targets)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
