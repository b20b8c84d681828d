"""Fuzz real relay, coordinator and training node processes through every protocol they serve.

    python -m bench.fuzz --inputs 100000

Targets (``--targets``): ``relay``, a ``swarmtrain relay``; ``coordinator``; ``node``, one of a
DiLoCo run's two ``swarmtrain node`` processes while the run trains (state, all-reduce, bulk);
``stage``, a pipeline run's stage server (``node --role server`` of a 2-stage run: the pipeline
protocols); ``verified``, one of a verified run's two nodes (``verify.rate = 1``: the dispute
and slice protocols, audited all-reduce). The protocols of each are the ones it lists in identify
(ours, and libp2p's: Kad, identify, ping, relay hop and stop, DCUtR). Inputs, drawn from
``random.Random(seed)``, come in categories (``--only`` picks some):

- ``random``: random bytes; ``truncated``: a well-formed frame cut short; ``oversized``: a length
  prefix far over any limit (ours 4-byte, Kad's varint);
- ``shape``: well-formed ``[version, code, body]`` messages of every registered type with fields
  of the wrong type, count or size, sent to every protocol (so also the wrong message type);
- ``slow``: a plausible prefix, then a byte now and then (the target's read deadline must end it);
- ``streams``: many streams opened at once on one connection and left; ``connections``: many
  connections opened and dropped.

``--inputs`` counts them in all, shared evenly by the targets, which are fuzzed one after the
other. Every ``--check-every`` inputs a fresh client must connect and get a ping answered within
10 s (else a *hang*), and each target must still run (else a *crash*). RSS and open files are read
from /proc after a warm-up batch and at the end; the RSS at every check is in ``rss_trace_mib``.
The last stdout line is one JSON object with ``inputs``, ``crashes``, ``hangs``,
``rss_growth_mib``, ``fds_growth``. Target: 0, 0, < 50, 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import multiaddr
import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair

import swarm  # noqa: F401  (registers the wire messages of every layer)
import swarmtrain.cli  # noqa: F401
import verify  # noqa: F401
from bench.common import git_sha
from bench.progress import BenchProgress
from bench.targets import Target, start, stop, write_run_config
from p2p import Host, HostConfig, call_unary, open_host
from p2p.node import PING_PROTOCOL, PingReply, PingRequest
from p2p.wire import PROTOCOL_VERSION, frame, registered_types

CATEGORIES = ("random", "truncated", "oversized", "shape", "slow", "streams", "connections")
# How often each category is drawn: the last three hold streams or connections for seconds.
WEIGHTS = {"random": 3, "truncated": 3, "oversized": 2, "shape": 4, "slow": 1, "streams": 1,
           "connections": 1}  # fmt: skip
KAD = "/ipfs/kad/1.0.0"


# ---- inputs ------------------------------------------------------------------------------------


def _junk(rng: random.Random) -> object:
    return rng.choice(
        [
            lambda: rng.randbytes(rng.randrange(0, 64)),
            lambda: "x" * rng.randrange(0, 64),
            lambda: rng.randrange(-(2**63), 2**64),
            lambda: rng.random() * 10 ** rng.randrange(-5, 300),
            lambda: [rng.randrange(10)] * rng.randrange(0, 8),
            lambda: {b"k": 1},
            lambda: None,
            lambda: True,
        ]
    )()


def _message_bytes(rng: random.Random) -> bytes:
    code, cls = rng.choice(sorted(registered_types().items()))
    count = len(cls._FIELDS) + rng.choice([0, 0, 0, -1, 1])
    body = [_junk(rng) for _ in range(max(count, 0))]
    version = PROTOCOL_VERSION if rng.random() < 0.9 else rng.randrange(256)
    return msgpack.packb([version, code, body], use_bin_type=True)


def make_input(category: str, protocol: str, rng: random.Random) -> bytes:
    """One hostile payload of ``category`` for ``protocol`` (``slow`` returns its prefix)."""
    kad = protocol == KAD
    if category == "random":
        return rng.randbytes(rng.randrange(0, 4096))
    if category == "truncated":
        body = _message_bytes(rng) + rng.randbytes(rng.randrange(0, 256))
        whole = varint.encode(len(body)) + body if kad else frame(body)
        return whole[: rng.randrange(0, len(whole))]
    if category == "oversized":
        return (
            varint.encode(rng.randrange(1 << 24, 1 << 40))
            if kad
            else struct.pack(">I", rng.randrange(1 << 24, 1 << 32)) + rng.randbytes(16)
        )
    if category == "shape":
        body = _message_bytes(rng)
        return varint.encode(len(body)) + body if kad else frame(body)
    if category == "slow":
        return varint.encode(64) if kad else struct.pack(">I", 64)
    raise ValueError(category)


# ---- driving -----------------------------------------------------------------------------------


@dataclass
class Counts:
    inputs: int = 0
    crashes: int = 0
    hangs: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # Each target's RSS at every check: a leak climbs to the end, a warm-up levels off.
    rss_mib: dict[str, list[float]] = field(default_factory=dict)


async def _send(host: Host, target: Target, protocol: str, payload: bytes, slow: bool) -> None:
    stream = await host.open_stream(target.peer_id, protocol)
    try:
        with trio.move_on_after(3 if slow else 0.2):
            await stream.write(payload)
            if slow:
                for _ in range(3):
                    await trio.sleep(1)
                    await stream.write(b"\x00")
            with contextlib.suppress(Exception):
                await stream.close()
            while await stream.read(4096):
                pass
    finally:
        with contextlib.suppress(Exception):
            await stream.reset()


async def _streams(host: Host, target: Target, protocol: str) -> None:
    streams = []
    with trio.move_on_after(5):
        for _ in range(32):
            streams.append(await host.open_stream(target.peer_id, protocol))
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.reset()


async def _connections(target: Target) -> None:
    async with open_host(HostConfig(create_new_key_pair())) as host:
        network = host.libp2p.get_network()
        for _ in range(4):
            await host.connect(target.peer_id, [multiaddr.Multiaddr(target.addr)])
            await network.close_peer(target.peer_id)


async def alive(target: Target) -> bool:
    """A fresh client connects and has a ping answered within 10 s."""
    if target.proc.poll() is not None:
        return False
    with trio.move_on_after(10):
        async with open_host(HostConfig(create_new_key_pair())) as host:
            await host.connect(target.peer_id, [multiaddr.Multiaddr(target.addr)])
            reply = await call_unary(
                host, target.peer_id, PING_PROTOCOL, PingRequest(b"fuzz"), PingReply, deadline_s=9
            )
            return reply.nonce == b"fuzz"
    return False


async def fuzz_target(
    target: Target,
    inputs: int,
    categories: tuple[str, ...],
    rng: random.Random,
    counts: Counts,
    check_every: int,
    on_progress: Callable[[str], None] = lambda line: None,
    concurrency: int = 32,
) -> tuple[float, int]:
    """Send ``inputs`` hostile inputs to ``target``; returns its (RSS MiB, fds) after warm-up."""
    warm: tuple[float, int] | None = None
    async with open_host(HostConfig(create_new_key_pair())) as host:
        await host.connect(target.peer_id, [multiaddr.Multiaddr(target.addr)])
        with trio.move_on_after(5):
            while not target.protocols:
                target.protocols = sorted(
                    str(p) for p in host.libp2p.get_peerstore().get_protocols(target.peer_id)
                )
                await trio.sleep(0.1)
        limiter = trio.Semaphore(concurrency)

        async def one(category: str, protocol: str, payload: bytes) -> None:
            try:
                if category == "streams":
                    await _streams(host, target, protocol)
                elif category == "connections":
                    await _connections(target)
                else:
                    await _send(host, target, protocol, payload, category == "slow")
            except Exception as exc:  # refusals and resets are the expected answers
                name = type(exc).__name__
                counts.errors[name] = counts.errors.get(name, 0) + 1
            finally:
                limiter.release()

        done = 0
        while done < inputs:
            batch = min(check_every, inputs - done)
            async with trio.open_nursery() as nursery:
                for _ in range(batch):
                    category = rng.choices(categories, [WEIGHTS[c] for c in categories])[0]
                    protocol = rng.choice(target.protocols)
                    payload = (
                        b""
                        if category in ("streams", "connections")
                        else make_input(category, protocol, rng)
                    )
                    await limiter.acquire()
                    nursery.start_soon(one, category, protocol, payload)
            done += batch
            counts.inputs += batch
            if target.proc.poll() is not None:
                counts.crashes += 1
                on_progress(f"{target.name} exited with {target.proc.returncode}")
                return warm or (0.0, 0)
            if not await alive(target):
                counts.hangs += 1
            if warm is None:
                warm = (target.rss_mib(), target.fds())
            with contextlib.suppress(Exception):  # a node may finish its run meanwhile
                counts.rss_mib.setdefault(target.name, []).append(round(target.rss_mib(), 1))
                on_progress(
                    f"{target.name}: {done}/{inputs} inputs, crashes={counts.crashes} "
                    f"hangs={counts.hangs} rss={target.rss_mib():.0f} MiB fds={target.fds()}"
                )
    return warm or (target.rss_mib(), target.fds())


# ---- processes ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A small model keeps the runs' rounds short on a 2-core machine; rounds enough for hours.
SMALL_RUN = {"rounds": "100000", "d_model": "32", "n_layers": "1", "context": "32",
             "sequence_length": "32", "inner_steps": "10"}  # fmt: skip
PIPELINE_RUN = {**SMALL_RUN, "n_layers": "2", "stages": "2", "microbatches": "2"}
VERIFIED_RUN = {**SMALL_RUN, "n_heads": "2", "rate": "1.0", "timeout_s": "30.0"}


def _run_nodes(
    workdir: Path, name: str, settings: dict[str, str], nodes: int, *extra: str
) -> list[Target]:
    """A coordinator of a run with ``settings`` (``swarmtrain init`` edited) and ``nodes``
    nodes ``NAME0``, ``NAME1``, ... started with ``extra``; returns [coordinator, nodes...]."""
    config = write_run_config(workdir / f"{name}.toml", settings)
    coordinator = start(
        f"{name}-coordinator",
        ["coordinator", "--config", str(config), "--identity", str(workdir / f"{name}-c.key"),
         "--listen", "/ip4/127.0.0.1/tcp/0"],
        workdir, lambda line: "/p2p/" in line,
    )  # fmt: skip
    return [coordinator, *(_start_node(workdir, f"{name}{i}", coordinator, *extra)
                           for i in range(nodes))]  # fmt: skip


def _start_node(workdir: Path, name: str, coordinator: Target, *extra: str) -> Target:
    """``swarmtrain node`` ``NAME`` of ``coordinator``'s run with ``extra``, on a free port."""
    port = _free_port()
    # A stage server names itself ("stage server ID starting on stage S"), then serves.
    server = "server" in extra
    node = start(
        name,
        ["node", "--join", coordinator.addr, "--listen", f"/ip4/127.0.0.1/tcp/{port}",
         "--threads", "1", "--state-dir", str(workdir / f"{name}-state"), *extra],
        workdir, lambda line: line.startswith("serving stage " if server else "node "),
        names_it=(lambda line: line.startswith("stage server ")) if server else None,
        peer_word=2 if server else 1,
    )  # fmt: skip
    node.addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{node.addr}"
    return node


def start_targets(workdir: Path, names: tuple[str, ...]) -> list[Target]:
    """The targets asked for, each with the processes its run needs; returns them all (the
    fuzzed ones are named after ``names``, see ``fuzzed_targets``)."""
    listen = ["--listen", "/ip4/127.0.0.1/tcp/0"]
    targets: list[Target] = []
    if "relay" in names:
        targets.append(
            start("relay", ["relay", "--identity", str(workdir / "r.key"), *listen], workdir,
                  lambda line: "/p2p/" in line)
        )  # fmt: skip
    if "coordinator" in names or "node" in names:
        coordinator = start(
            "coordinator",
            ["coordinator", "--identity", str(workdir / "c.key"), "--rounds", "1000", *listen],
            workdir, lambda line: "/p2p/" in line,
        )  # fmt: skip
        targets.append(coordinator)
    if "node" in names:
        targets.extend(_start_node(workdir, f"node{i}", coordinator) for i in range(2))
    if "stage" in names:
        targets.extend(_run_nodes(workdir, "stage", PIPELINE_RUN, 1, "--role", "server"))
    if "verified" in names:
        targets.extend(_run_nodes(workdir, "verified", VERIFIED_RUN, 2))
    return targets


def fuzzed_targets(targets: list[Target], names: tuple[str, ...]) -> list[Target]:
    """Of the started processes, those ``names`` asks to fuzz (a run's first node)."""
    first = {"node": "node0", "stage": "stage0", "verified": "verified0"}
    wanted = {first.get(name, name) for name in names}
    return [t for t in targets if t.name in wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="in all, shared by the targets")
    parser.add_argument("--targets", default="relay,coordinator,node,stage,verified")
    parser.add_argument("--only", default=",".join(CATEGORIES), help="input categories")
    parser.add_argument("--check-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    level = os.environ.get("BENCH_LOG_LEVEL", "CRITICAL")
    logging.basicConfig(level=level)
    logging.getLogger("libp2p").setLevel(level)  # the client's failed dials are expected
    categories = tuple(c for c in args.only.split(",") if c)
    names = tuple(n for n in args.targets.split(",") if n)
    result = {"bench": "fuzz", "config": vars(args), "git_sha": git_sha()}
    with BenchProgress() as progress:
        result.update(run(names, args.inputs, categories, args.check_every, args.seed, progress))
    print(json.dumps(result))


def run(
    names: tuple[str, ...],
    inputs: int,
    categories: tuple[str, ...],
    check_every: int,
    seed: int,
    progress: BenchProgress | None = None,
) -> dict[str, object]:
    """Fuzz the ``names`` targets with ``inputs`` inputs in all, shared evenly, one target after
    the other; the summary's figures. ``progress``: where its lines go (stdout by default)."""
    progress = progress or BenchProgress()
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        progress.phase(f"starting the targets: {', '.join(names)}")
        targets = start_targets(Path(tmp), names)
        fuzzed = fuzzed_targets(targets, names)
        try:
            counts = Counts()
            growth: dict[str, tuple[float, int]] = {}

            async def drive() -> None:
                for index, target in enumerate(fuzzed):
                    rng = random.Random(seed * 1000 + index)
                    share = inputs // len(fuzzed) + (index < inputs % len(fuzzed))
                    # Its lines (one per check) are the plain form; a terminal also gets a bar.
                    progress.add(target.name, share, unit="inputs", plain_lines=False)
                    before = counts.inputs

                    def on_progress(
                        line: str, name: str = target.name, before: int = before
                    ) -> None:
                        progress.line(line)
                        progress.reach(name, counts.inputs - before)

                    rss, fds = await fuzz_target(
                        target, share, categories, rng, counts, check_every, on_progress
                    )
                    if target.proc.poll() is None:
                        growth[target.name] = (target.rss_mib() - rss, target.fds() - fds)

            trio.run(drive)
            return {
                "inputs": counts.inputs,
                "crashes": counts.crashes,
                "hangs": counts.hangs,
                "rss_growth_mib": round(max((g[0] for g in growth.values()), default=0.0), 1),
                "fds_growth": max((g[1] for g in growth.values()), default=0),
                "per_target": {k: {"rss_growth_mib": round(v[0], 1), "fds_growth": v[1]}
                               for k, v in growth.items()},
                "rss_trace_mib": counts.rss_mib,
                "protocols": {t.name: t.protocols for t in fuzzed},
                "client_errors": counts.errors,
            }  # fmt: skip
        finally:
            stop(targets)


if __name__ == "__main__":
    main()
