"""Bulk data plane vs a plain libp2p stream vs a plain TCP socket, two processes on loopback.

    python -m bench.p2p_stream [--size-mib 256] [--repeats 3] [--seed 0] [--stripes 1]
                               [--frame-kib 1024]

The parent sends, a child process receives. Each path moves ``--size-mib`` MiB ``--repeats``
times, interleaved (tcp, bulk, libp2p, tcp, ...) so drift in machine load hits all three alike.
Per transfer: wall time at the sender from first byte offered to the receiver's acknowledgement,
and CPU time (user + system, ``getrusage``) of each process over its side of the transfer; the
sums give CPU-seconds per GiB moved (sender + receiver). Every receiver writes into one
preallocated, prefaulted buffer, so no path pays page faults the others do not. Medians are
reported. The last stdout line is one JSON object; ``cpu_ratio`` (bulk over TCP, target at most 2)
and ``speed_ratio`` (bulk over TCP, target at least 0.5) are the figures of merit.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from bench.progress import BenchProgress
from p2p import BULK_PROTOCOL, BulkConfig, BulkListener, DataMode, receive_bulk, send_bulk
from p2p.host import HostConfig, open_host

RAW_PROTOCOL = "/swarmtrain/bench/raw/1"
STATS_PROTOCOL = "/swarmtrain/bench/stats/1"
CHUNK_BYTES = 1 << 20
PATHS = ("tcp", "bulk", "libp2p")


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def prefaulted(size: int) -> bytearray:
    buf = bytearray(size)
    for i in range(0, size, 4096):
        buf[i] = 1
    return buf


async def read_exactly(stream: Any, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += await stream.read(n - len(out))
    return out


# --- receiver (child process) ------------------------------------------------------------------


async def receiver_main(size: int, stripes: int, frame_bytes: int) -> None:
    dest = prefaulted(size)
    view = memoryview(dest)
    results: list[dict[str, Any]] = []
    config = BulkConfig(frame_bytes=frame_bytes, stripes=stripes, max_bytes=size)
    listener = BulkListener("127.0.0.1")
    async with open_host(HostConfig(create_new_key_pair())) as host, trio.open_nursery() as nursery:
        await nursery.start(listener.run)

        async def on_bulk(stream: Any) -> None:
            c0 = cpu_s()
            received = await receive_bulk(
                stream, direct=True, listener=listener, config=config, into=dest
            )
            results.append({"path": "bulk", "cpu_s": cpu_s() - c0, "mode": received.mode.name})
            await stream.close()

        async def on_raw(stream: Any) -> None:
            c0 = cpu_s()
            got = 0
            while got < size:
                chunk = await stream.read(min(CHUNK_BYTES, size - got))
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
            await stream.write(b"k")
            results.append({"path": "libp2p", "cpu_s": cpu_s() - c0})
            await stream.close()

        async def on_stats(stream: Any) -> None:
            await stream.write(json.dumps(results).encode())
            await stream.close()

        host.set_handler(BULK_PROTOCOL, on_bulk)
        host.set_handler(RAW_PROTOCOL, on_raw)
        host.set_handler(STATS_PROTOCOL, on_stats)

        tcp = trio.socket.socket()
        await tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)

        async def serve_tcp() -> None:
            while True:
                sock, _ = await tcp.accept()
                with sock:
                    c0 = cpu_s()
                    got = 0
                    while got < size:
                        n = await sock.recv_into(view[got:])
                        if n == 0:
                            raise EOFError("tcp sender closed early")
                        got += n
                    await sock.send(b"k")
                    results.append({"path": "tcp", "cpu_s": cpu_s() - c0})

        nursery.start_soon(serve_tcp)
        ready = {"addr": str(host.addrs()[0]), "tcp_port": tcp.getsockname()[1]}
        print(json.dumps(ready), flush=True)
        await trio.sleep_forever()


# --- sender (parent process) -------------------------------------------------------------------


async def send_all(sock: Any, data: memoryview) -> None:
    sent = 0
    while sent < len(data):
        sent += await sock.send(data[sent:])


async def sender_main(
    ready: dict[str, Any],
    size: int,
    repeats: int,
    seed: int,
    config: BulkConfig,
    progress: BenchProgress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    payload = memoryview(_payload(size, seed))
    addr = multiaddr.Multiaddr(ready["addr"])
    peer_id = ID.from_base58(addr.get_peer_id())
    runs: list[dict[str, Any]] = []
    async with open_host(HostConfig(create_new_key_pair())) as host:
        await host.connect(peer_id, [addr])
        # A line per transfer below is the plain form; a terminal also gets a bar.
        progress.add("transfers", repeats * len(PATHS), unit="transfers", plain_lines=False)
        for _ in range(repeats):
            for path in PATHS:
                c0, t0 = cpu_s(), time.perf_counter()
                with trio.fail_after(600):
                    if path == "tcp":
                        sock = trio.socket.socket()
                        with sock:
                            await sock.connect(("127.0.0.1", ready["tcp_port"]))
                            await send_all(sock, payload)
                            assert await sock.recv(1) == b"k"
                    elif path == "bulk":
                        stream = await host.open_stream(peer_id, BULK_PROTOCOL)
                        mode = await send_bulk(stream, payload, direct=True, config=config)
                        assert mode is DataMode.DIAL_RECEIVER, mode
                        await stream.close()
                    else:
                        stream = await host.open_stream(peer_id, RAW_PROTOCOL)
                        for offset in range(0, size, CHUNK_BYTES):
                            await stream.write(bytes(payload[offset : offset + CHUNK_BYTES]))
                        assert await read_exactly(stream, 1) == b"k"
                        await stream.close()
                wall = time.perf_counter() - t0
                runs.append({"path": path, "wall_s": wall, "cpu_s": cpu_s() - c0})
                progress.line(f"{path:7s} {size / wall / 2**20:8.0f} MiB/s")
                progress.advance("transfers")
        stream = await host.open_stream(peer_id, STATS_PROTOCOL)
        stats = b""
        with trio.fail_after(10):
            try:
                while True:
                    stats += await stream.read(65536)
            except Exception as exc:  # StreamEOF ends the reply
                if type(exc).__name__ != "StreamEOF":
                    raise
    return runs, json.loads(stats)


def _payload(size: int, seed: int) -> bytearray:
    # Random, so nothing on the way can profit from compressible data; seeded for reproducibility.
    import numpy as np

    return bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())


def summarize(
    runs: list[dict[str, Any]], remote: list[dict[str, Any]], size: int
) -> dict[str, Any]:
    gib = size / 2**30
    out: dict[str, Any] = {}
    for path in PATHS:
        local = [r for r in runs if r["path"] == path]
        far = [r for r in remote if r["path"] == path]
        assert len(local) == len(far), (path, len(local), len(far))
        mibps = [size / 2**20 / r["wall_s"] for r in local]
        cpu = [(a["cpu_s"] + b["cpu_s"]) / gib for a, b in zip(local, far, strict=True)]
        out[f"{path}_MiBps"] = round(statistics.median(mibps), 1)
        out[f"{path}_cpu_s_per_GiB"] = round(statistics.median(cpu), 3)
        out[f"{path}_sender_cpu_s_per_GiB"] = round(
            statistics.median(r["cpu_s"] / gib for r in local), 3
        )
        out[f"{path}_receiver_cpu_s_per_GiB"] = round(
            statistics.median(r["cpu_s"] / gib for r in far), 3
        )
    out["cpu_ratio"] = round(out["bulk_cpu_s_per_GiB"] / out["tcp_cpu_s_per_GiB"], 3)
    out["speed_ratio"] = round(out["bulk_MiBps"] / out["tcp_MiBps"], 3)
    out["libp2p_cpu_ratio"] = round(out["libp2p_cpu_s_per_GiB"] / out["tcp_cpu_s_per_GiB"], 3)
    return out


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stripes", type=int, default=1)
    parser.add_argument("--frame-kib", type=int, default=BulkConfig().frame_bytes >> 10)
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender")
    args = parser.parse_args()
    size = args.size_mib << 20
    if args.role == "receiver":
        trio.run(receiver_main, size, args.stripes, args.frame_kib << 10)
        return
    load_before = os.getloadavg()[0]
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.p2p_stream",
            "--role",
            "receiver",
            "--size-mib",
            str(args.size_mib),
            "--stripes",
            str(args.stripes),
            "--frame-kib",
            str(args.frame_kib),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            raise SystemExit("receiver process died before it was ready")
        ready = json.loads(line)
        config = BulkConfig(frame_bytes=args.frame_kib << 10, stripes=args.stripes)
        with BenchProgress() as progress:
            progress.phase(f"{args.repeats} x {args.size_mib} MiB over {', '.join(PATHS)}")
            runs, remote = trio.run(
                sender_main, ready, size, args.repeats, args.seed, config, progress
            )
    finally:
        child.terminate()
        child.wait(timeout=10)
    result = {
        "bench": "p2p_stream",
        "config": {
            "size_mib": args.size_mib,
            "repeats": args.repeats,
            "seed": args.seed,
            "stripes": args.stripes,
            "frame_bytes": args.frame_kib << 10,
            "cpus": os.cpu_count(),
            "host": socket.gethostname(),
            # Other jobs on the box inflate CPU-s per GiB unevenly: say how busy it was.
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "git_sha": git_sha(),
        **summarize(runs, remote, size),
        "targets": {"cpu_ratio_max": 2.0, "speed_ratio_min": 0.5},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
