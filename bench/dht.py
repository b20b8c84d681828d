"""DHT benchmark: separate peer processes on loopback, the same measurements as hivemind's.

    python -m bench.dht --peers 8 --keys 1000 [--vs-hivemind PYTHON] [--seed N]

Starts ``--peers`` processes (one bootstrap, the rest join through it), then times one more peer
joining the formed swarm (in that process: host start, connecting, lookups, until it can serve;
hivemind's figure is ``DHT(start=True)`` in its process). Peer 1 stores ``--keys`` keys of 64 bytes
one after another, then another peer gets them one after another; get latency percentiles count
only the keys the reader does not hold itself (as hivemind's bench_dht.py does). Throughput with
``--window`` operations in flight follows.

``--vs-hivemind PYTHON`` runs ../shared/bench/hivemind/bench_dht.py with that interpreter (a venv
holding hivemind 1.1.12, see that folder's README) in the same sitting, with the same peers and
keys, and adds its figures and the ratios. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import git_sha
from bench.progress import BenchProgress

REPO = Path(__file__).resolve().parents[1]
# The anchor script lives in ../shared beside the checkout (as CI and the brief lay it out).
HIVEMIND_BENCH = Path(
    os.environ.get(
        "HIVEMIND_BENCH_DHT", REPO.parent / "shared" / "bench" / "hivemind" / "bench_dht.py"
    )
)
START_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 600.0
VALUE_BYTES = 64


# ---------------------------------------------------------------------------- peer process


def _pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, as hivemind's common.pct."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


async def _peer_command(dht, host, line: str) -> dict:
    import trio
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from p2p.dht.kademlia import dht_key

    cmd, *args = line.split()
    if cmd == "join":
        size = await dht.bootstrap([info_from_p2p_addr(Multiaddr(args[0]))])
        return {"routing_table_size": size}
    if cmd in ("store_seq", "get_seq", "get_latest_seq", "store_window", "get_window"):
        prefix, count, seed = args[0], int(args[1]), int(args[2])
        window = int(args[3]) if len(args) > 3 else 1
        rng = random.Random(seed)
        values = [rng.randbytes(VALUE_BYTES) for _ in range(count)]
        keys = [f"{prefix}/{i}" for i in range(count)]
        held = [bool(dht.store_local.records(dht_key(k), time.time())) for k in keys]
        latencies: list[float] = []
        ok = [0]
        stored_at: dict[int, int] = {}
        expiration = time.time() + 600

        async def one(i: int) -> None:
            start = time.perf_counter()
            if cmd.startswith("store"):
                replicas = await dht.store(keys[i], values[i], expiration)
                stored_at[replicas] = stored_at.get(replicas, 0) + 1
                ok[0] += replicas > 0
            else:
                got = await dht.get(keys[i], latest=cmd == "get_latest_seq")
                ok[0] += list(got.values()) == [values[i]]
            latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        if window == 1:
            for i in range(count):
                await one(i)
        else:
            limiter = trio.Semaphore(window)

            async def limited(i: int) -> None:
                async with limiter:
                    await one(i)

            async with trio.open_nursery() as nursery:
                for i in range(count):
                    await limiter.acquire()
                    limiter.release()
                    nursery.start_soon(limited, i)
        elapsed = time.perf_counter() - started
        remote = (
            [lat for lat, h in zip(latencies, held, strict=True) if not h] if window == 1 else []
        )
        return {
            "ops_per_s": count / elapsed,
            "ok": ok[0],
            "replicas_histogram": stored_at,
            "p50_ms": _pct(latencies, 0.5) * 1e3,
            "p99_ms": _pct(latencies, 0.99) * 1e3,
            "remote_keys": len(remote),
            "remote_p50_ms": _pct(remote, 0.5) * 1e3,
            "remote_p99_ms": _pct(remote, 0.99) * 1e3,
        }
    return {"error": f"unknown command {cmd!r}"}


async def _peer_main(join: str | None) -> None:
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from p2p.dht.kademlia import Dht
    from p2p.host import HostConfig, open_host

    started = time.perf_counter()
    config = HostConfig(key_pair=create_new_key_pair())
    async with open_host(config) as host, trio.open_nursery() as nursery:
        dht = Dht(host)
        await nursery.start(dht.run)
        if join:
            with trio.fail_after(60):
                await dht.bootstrap([info_from_p2p_addr(Multiaddr(join))])
        join_s = time.perf_counter() - started
        print(f"READY {host.addrs()[0]} {join_s:.6f}", flush=True)
        stdin = trio.wrap_file(sys.stdin)
        while line := await stdin.readline():
            try:
                reply = await _peer_command(dht, host, line)
            except Exception as exc:
                reply = {"error": repr(exc)}
            print(json.dumps(reply), flush=True)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------- orchestrator


class _Peer:
    def __init__(self, join: str | None = None) -> None:
        cmd = [sys.executable, "-m", "bench.dht", "--role", "peer"]
        cmd += ["--join", join] if join else []
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.addr = ""
        self.join_s = float("nan")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _line(self, timeout_s: float) -> str:
        line = self._lines.get(timeout=timeout_s)
        if line is None:
            raise RuntimeError(f"peer exited with {self.proc.wait(5)}")
        return line

    def wait_ready(self) -> None:
        while not (line := self._line(START_TIMEOUT_S)).startswith("READY "):
            pass
        _, self.addr, join_s = line.split()
        self.join_s = float(join_s)

    def ask(self, *words: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._line(REPLY_TIMEOUT_S))
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _run_ours(args: argparse.Namespace, progress: BenchProgress) -> dict:
    peers: list[_Peer] = []
    try:
        progress.phase(f"starting {args.peers} peers and joining them")
        peers.extend(_Peer() for _ in range(args.peers))
        for peer in peers:
            peer.wait_ready()
        for peer in peers[1:]:
            peer.ask("join", peers[0].addr)
        progress.phase("one more peer joins (join_s)")
        extra = _Peer(join=peers[0].addr)
        peers.append(extra)
        extra.wait_ready()
        writer, reader, reader2 = peers[1], peers[-2], peers[-3]
        # Each measurement is one command to a peer process: a phase line each, a bar of five.
        progress.add("dht", 5, unit="measurements", plain_lines=False)

        def measure(peer: _Peer, what: str, *command: object) -> dict:
            progress.phase(f"{what}: {args.keys} keys")
            reply = peer.ask(*command)
            progress.advance("dht")
            return reply

        store = measure(writer, "store one by one", "store_seq", "seq", args.keys, args.seed)
        get = measure(reader, "get one by one", "get_seq", "seq", args.keys, args.seed)
        get_latest = measure(
            reader2, "get the latest", "get_latest_seq", "seq", args.keys, args.seed
        )
        store_w = measure(
            writer, f"store {args.window} at a time", "store_window", "win", args.keys,
            args.seed, args.window,
        )  # fmt: skip
        get_w = measure(
            reader2, f"get {args.window} at a time", "get_window", "win", args.keys, args.seed,
            args.window,
        )  # fmt: skip
    finally:
        for peer in peers:
            peer.stop()
    print(f"store seq:    {store}", file=sys.stderr)
    print(f"get seq:      {get}", file=sys.stderr)
    print(f"get latest:   {get_latest}", file=sys.stderr)
    print(f"store window: {store_w}", file=sys.stderr)
    print(f"get window:   {get_w}", file=sys.stderr)
    return {
        "join_s": extra.join_s,
        "get_p50_ms": get["remote_p50_ms"],
        "get_p99_ms": get["remote_p99_ms"],
        "get_remote_keys": get["remote_keys"],
        "get_ok": get["ok"],
        "store_ops": store["ops_per_s"],
        "store_p50_ms": store["p50_ms"],
        "store_ok": store["ok"],
        "get_ops": get["ops_per_s"],
        "get_latest_p50_ms": get_latest["remote_p50_ms"],
        "get_latest_ok": get_latest["ok"],
        "store_ops_window": store_w["ops_per_s"],
        "get_ops_window": get_w["ops_per_s"],
    }


def _run_hivemind(python: str, args: argparse.Namespace) -> dict:
    """Figures from hivemind's bench_dht.py output (its last lines are human-readable)."""
    cmd = [python, str(HIVEMIND_BENCH), "--peers", str(args.peers), "--keys", str(args.keys)]
    cmd += ["--concurrency", str(args.window)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, cwd=HIVEMIND_BENCH.parent
    ).stdout
    print(out, file=sys.stderr)

    def grab(pattern: str) -> float:
        match = re.search(pattern, out)
        if match is None:
            raise RuntimeError(f"hivemind output lacks {pattern!r}")
        return float(match.group(1))

    return {
        "hivemind_join_s": grab(r"one extra peer joining the swarm:\s+([\d.]+) s"),
        "hivemind_get_p50_ms": grab(r"keys NOT held by reader \(\d+\): p50\s+([\d.]+) ms"),
        "hivemind_get_p99_ms": grab(
            r"keys NOT held by reader \(\d+\): p50\s+[\d.]+ ms\s+p99\s+([\d.]+)"
        ),
        "hivemind_store_ops": grab(r"store seq\s+\(peer1\):\s+([\d.]+) ops/s"),
        "hivemind_get_ops": grab(r"get seq\s+\(peer\d+\):\s+([\d.]+) ops/s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--window", type=int, default=32, help="operations in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vs-hivemind", metavar="PYTHON", default=None)
    parser.add_argument("--role", choices=["bench", "peer"], default="bench")
    parser.add_argument("--join", default=None)
    args = parser.parse_args()
    if args.role == "peer":
        import logging

        import trio

        # py-libp2p warns on every stream a client resets; BENCH_LOG_LEVEL=DEBUG shows ours.
        logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "ERROR"))

        trio.run(_peer_main, args.join)
        return
    if args.peers < 4:
        parser.error("--peers must be at least 4 (writer and readers are different peers)")
    result: dict = {
        "bench": "dht",
        "config": {
            "peers": args.peers,
            "keys": args.keys,
            "window": args.window,
            "seed": args.seed,
            "value_bytes": VALUE_BYTES,
        },
        "git_sha": git_sha(),
    }
    with BenchProgress() as progress:
        result.update(_run_ours(args, progress))
        if args.vs_hivemind:
            progress.phase("hivemind's bench_dht.py")
    if args.vs_hivemind:
        result.update(_run_hivemind(args.vs_hivemind, args))
        # Ratios above 1 mean we are faster than the anchor.
        result["ratio_get_p50"] = result["hivemind_get_p50_ms"] / result["get_p50_ms"]
        result["ratio_join"] = result["hivemind_join_s"] / result["join_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
