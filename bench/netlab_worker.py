"""Processes that ``bench.allreduce_netlab`` runs inside its network namespaces.

    python -m bench.netlab_worker peer --join ADDR --ip IP --rank K --numel M [--trace] [-v]
    python -m bench.netlab_worker delay --dev NAME --delay-ms D
    python -m bench.netlab_worker blast --ip IP --targets IP,IP,.. --bytes B [--chunk C]

``peer``: one averaging peer (a node listening on IP, an ``Averager``), driven by JSON lines on
stdin. It first prints ``{"ready": <peer id hex>, "bulk_listener": bool, "reachability": ..}``;
then each command gets one JSON line back:

    {"cmd": "average", "round": R, "expected": [hex, ...]}
        -> {"ok": true, "digest": .., "t_return": wall s, "t_formed": wall s, "allreduce_s": ..,
            "matchmaking_s": .., "bytes_sent": .., "bytes_received": .., "contributors": n,
            "trace": [..] (with --trace)}  or {"ok": false, "error": ..}
    {"cmd": "ping", "peers": [hex, ...]}  -> {"rtt_ms": {hex: ms | null}}  (libp2p pings)
    {"cmd": "tcp_rtt", "ip": IP, "port": P}  -> {"rtt_ms": ms}  (median plain TCP connect)

The vector of rank K is ``np.random.default_rng(1000 + K).standard_normal(M, float32)``.
``t_formed`` is when this peer's group formed (its all-reduce session started), on the wall
clock: ``t_return - allreduce_s`` (the session times itself from its construction, right after
matchmaking). All processes run on one machine, so their wall clocks agree.

``--trace`` times every payload item this peer sends and receives (wall clock), and splits each
bulk send into its phases: offer until accept, dialing the data connection, moving the bytes,
waiting for the receiver's outcome. It wraps functions of ``swarm.averaging.session`` and
``p2p.bulk.channel`` in this process only; nothing else changes.

``blast``: plain-TCP all-to-all between the peers' namespaces, the lab's own ceiling (see
``blast_main``).

``delay``: a delay line on a TUN device (this kernel has no netem). It creates the device with
virtio-net headers and TSO offloads, so TCP's large GSO packets cross it whole (at 100 Mbit/s
a per-1500-byte-packet Python loop would eat a core), holds every packet ``--delay-ms`` and
writes it back, in order, at a real-time priority (SCHED_FIFO) where it may. It prints
``READY`` once the device exists, and its counters and CPU time as one JSON line on stderr when
it ends (SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import contextvars
import fcntl
import json
import logging
import os
import resource
import select
import signal
import struct
import sys
import time
from collections import deque
from typing import Any

# ---------------------------------------------------------------------------- delay line

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
READ_BYTES = 1 << 18  # a virtio-net header plus the largest GSO packet


def delay_main(dev: str, delay_s: float) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(
        fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
    )
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    # A kernel netem runs in softirq, ahead of every process; the closest a process gets is a
    # real-time priority, so other load on the machine does not stretch the emulated link.
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        realtime = True
    except (AttributeError, OSError):
        realtime = False
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("READY", flush=True)
    held: deque[tuple[float, bytes]] = deque()  # one delay for all: arrival order = due order
    packets = nbytes = dropped = max_held = 0
    largest = 0
    while not stop:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            due = time.monotonic() + delay_s
            while True:
                try:
                    packet = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                held.append((due, packet))
            max_held = max(max_held, len(held))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet = held.popleft()
            try:
                os.write(fd, packet)
                packets += 1
                nbytes += len(packet)
                largest = max(largest, len(packet))
            except OSError:
                dropped += 1
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {
        "delayline_packets": packets,
        "delayline_bytes": nbytes,
        "delayline_dropped": dropped,
        "delayline_max_held": max_held,
        "delayline_largest_packet": largest,
        "delayline_cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "delayline_realtime": realtime,
    }
    print(json.dumps(report), file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------------- plain TCP


def blast_main(ip: str, targets: list[str], per_target: int, chunk: int, port: int) -> int:
    """Send ``per_target`` bytes to every target and receive as much from each, over plain TCP
    (C-level socket loops in threads, so almost no CPU): the lab's own ceiling. ``chunk`` 0: one
    connection per target; else a fresh connection per ``chunk`` bytes, each with the round
    trips of a bulk transfer (a 1-RTT offer/accept before the data, the receiver's verdict
    after it). Prints READY, waits for a line on stdin, then prints one JSON line of times."""
    import socket
    import threading

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((ip, port))
    server.listen(256)
    expected = per_target * len(targets)
    received = [0]
    lock = threading.Lock()
    done_receiving = threading.Event()
    payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, (chunk or per_target) >> 20))

    def serve(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        with conn:
            if chunk:
                conn.recv(1)  # offer
                conn.sendall(b"a")  # accept
            got = 0
            while n := conn.recv_into(buf):
                got += n
                if chunk and got >= chunk:
                    break
            if chunk:
                conn.sendall(b"o")  # outcome
        with lock:
            received[0] += got
            if received[0] >= expected:
                done_receiving.set()

    def accept_forever() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def send_to(target: str, out: dict[str, float]) -> None:
        left = per_target
        if not chunk:
            with socket.create_connection((target, port)) as conn:
                if pacing := int(os.environ.get("BLAST_PACING_BPS", "0")):
                    conn.setsockopt(socket.SOL_SOCKET, 47, pacing // 8)  # SO_MAX_PACING_RATE
                while left:
                    n = min(left, len(payload))
                    conn.sendall(payload[:n])
                    left -= n
        while chunk and left:
            n = min(left, chunk)
            with socket.create_connection((target, port)) as conn:
                conn.sendall(b"h")
                conn.recv(1)
                sent = 0
                while sent < n:
                    m = min(n - sent, len(payload))
                    conn.sendall(payload[:m])
                    sent += m
                conn.recv(1)
            left -= n
        out[target] = time.time()

    threading.Thread(target=accept_forever, daemon=True).start()
    print("READY", flush=True)
    sys.stdin.readline()
    start = time.time()
    ends: dict[str, float] = {}
    senders = [threading.Thread(target=send_to, args=(t, ends)) for t in targets]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(600)
    done_receiving.wait(600)
    print(json.dumps({"t_start": start, "t_sent": max(ends.values()), "t_received": time.time()}))
    return 0


# ---------------------------------------------------------------------------- peer

_current: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "netlab_transfer", default=None
)


def install_trace(records: list[dict[str, Any]]) -> None:
    """Time each item send/receive, the bulk channel's opening and each payload's data phase."""
    import p2p.bulk.channel as bulk_module
    from swarm.averaging import session as session_module
    from swarm.averaging import session_links

    session = session_module.Session
    send_item, receive_item = session._send_item, session._receive_item
    open_channel, channel_send = session_links.open_channel, bulk_module.BulkChannel.send

    async def traced_send(self, rpc, direct, channel, order):  # type: ignore[no-untyped-def]
        record: dict[str, Any] = {
            "dir": "send",
            "peer": order.peer.hex()[-8:],
            "kind": type(order).__name__,
            "part": order.part_index,
            "t0": time.time(),
        }
        token = _current.set(record)
        try:
            return await send_item(self, rpc, direct, channel, order)
        finally:
            _current.reset(token)
            record["t_end"] = time.time()
            records.append(record)

    async def traced_receive(self, peer, rpc, direct, channel, item):  # type: ignore[no-untyped-def]
        record = {
            "dir": "recv",
            "peer": peer.hex()[-8:],
            "kind": item.kind,
            "part": item.part_index,
            "nbytes": item.nbytes,
            "t0": time.time(),
        }
        try:
            return await receive_item(self, peer, rpc, direct, channel, item)
        finally:
            record["t_end"] = time.time()
            records.append(record)

    def timed(original, start: str, stop: str):  # type: ignore[no-untyped-def]
        async def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            record = _current.get()
            if record is not None:
                record[start] = time.time()
            try:
                return await original(*args, **kwargs)
            finally:
                if record is not None:
                    record[stop] = time.time()

        return wrapper

    session._send_item = traced_send
    session._receive_item = traced_receive
    session_links.open_channel = timed(open_channel, "t_open0", "t_open1")
    bulk_module.BulkChannel.send = timed(channel_send, "t_data0", "t_data1")


async def tcp_rtt_ms(ip: str, port: int, tries: int = 5) -> float:
    """Median time of a plain TCP connect (one round trip), in ms."""
    import trio

    times = []
    for _ in range(tries):
        start = time.perf_counter()
        stream = await trio.open_tcp_stream(ip, port)
        times.append((time.perf_counter() - start) * 1e3)
        await stream.aclose()
    return sorted(times)[len(times) // 2]


async def peer_main(args: argparse.Namespace) -> None:
    import numpy as np
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p import HostConfig, NodeConfig, PeerID, open_node
    from swarm import Averager, AveragerConfig, AveragingFailed, Compression

    records: list[dict[str, Any]] = []
    if args.trace:
        install_trace(records)
    vector = await trio.to_thread.run_sync(
        lambda: np.random.default_rng(1000 + args.rank).standard_normal(
            args.numel, dtype=np.float32
        )
    )
    config = NodeConfig(
        host=HostConfig(create_new_key_pair(), listen_addrs=(f"/ip4/{args.ip}/tcp/0",)),
        bootstrap=(args.join,),
    )
    async with open_node(config) as node, trio.open_nursery() as nursery:
        averager = Averager(
            node,
            AveragerConfig(
                run_id=args.run_id,
                compression=Compression[args.compression.upper()],
                matchmaking_timeout_s=args.matchmaking_timeout,
                allreduce_timeout_s=args.allreduce_timeout,
                peer_timeout_s=args.peer_timeout,
                bandwidth_bps=args.bandwidth_bps,
                pace=not args.no_pace,
            ),
        )
        await nursery.start(averager.run)
        ready = {
            "ready": node.host.peer_id.to_bytes().hex(),
            "bulk_listener": node.bulk_listener is not None,
            "reachability": str(node.reachability.status.value),
            "addr": str(node.host.addrs()[0]),
        }
        print(json.dumps(ready), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if request["cmd"] == "ping":
                rtts: dict[str, float | None] = {}
                for peer in request["peers"]:
                    result = await node.ping(PeerID(bytes.fromhex(peer)), rounds=3)
                    rtts[peer] = result.rtt_ms if result.ok else None
                reply: dict[str, Any] = {"rtt_ms": rtts}
            elif request["cmd"] == "tcp_rtt":
                reply = {"rtt_ms": await tcp_rtt_ms(request["ip"], request["port"])}
            elif request["cmd"] == "average":
                records.clear()
                try:
                    result = await averager.average(
                        [vector],
                        1.0,
                        round_number=request["round"],
                        expected_peers=[bytes.fromhex(p) for p in request["expected"]],
                    )
                except AveragingFailed as exc:
                    reply = {"ok": False, "error": str(exc)}
                else:
                    t_return = time.time()
                    reply = {
                        "ok": True,
                        "digest": result.digest,
                        "t_return": t_return,
                        "t_formed": t_return - result.allreduce_s,
                        "allreduce_s": result.allreduce_s,
                        "matchmaking_s": result.matchmaking_s,
                        "bytes_sent": result.bytes_sent,
                        "bytes_received": result.bytes_received,
                        "contributors": len(result.contributors),
                        "dropped": result.dropped,
                    }
                    if args.trace:
                        # let the last sends' outcome reads land before reporting
                        await trio.sleep(0.2)
                        reply["trace"] = list(records)
            else:
                reply = {"error": f"unknown command {request['cmd']!r}"}
            print(json.dumps(reply), flush=True)
        nursery.cancel_scope.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    peer = sub.add_parser("peer")
    peer.add_argument("--join", required=True)
    peer.add_argument("--ip", required=True)
    peer.add_argument("--rank", type=int, required=True)
    peer.add_argument("--numel", type=int, required=True)
    peer.add_argument("--run-id", default="netlab")
    peer.add_argument("--compression", default="none")
    peer.add_argument("--matchmaking-timeout", type=float, default=30.0)
    peer.add_argument("--allreduce-timeout", type=float, default=120.0)
    peer.add_argument("--peer-timeout", type=float, default=3.0)
    peer.add_argument("--bandwidth-bps", type=float, default=1e9)
    peer.add_argument("--no-pace", action="store_true", help="unpaced data channels")
    peer.add_argument("--trace", action="store_true")
    peer.add_argument("-v", action="store_true", help="INFO logging on stderr")
    delay = sub.add_parser("delay")
    delay.add_argument("--dev", required=True)
    delay.add_argument("--delay-ms", type=float, required=True)
    blast = sub.add_parser("blast")
    blast.add_argument("--ip", required=True)
    blast.add_argument("--targets", required=True, help="comma-separated IPs")
    blast.add_argument("--bytes", type=int, required=True, help="bytes to send to each target")
    blast.add_argument("--chunk", type=int, default=0)
    blast.add_argument("--port", type=int, default=5201)
    args = parser.parse_args()
    if args.mode == "blast":
        targets = args.targets.split(",")
        return blast_main(args.ip, targets, args.bytes, args.chunk, args.port)
    if args.mode == "delay":
        return delay_main(args.dev, args.delay_ms / 1000)
    logging.basicConfig(
        level=logging.INFO if args.v else logging.WARNING,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    import trio

    try:
        trio.run(peer_main, args)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
