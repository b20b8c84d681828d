"""All-reduce over shaped links: peers in network namespaces, against the bandwidth-optimal limit.

    sudo .venv/bin/python -m bench.allreduce_netlab --peers 4 --rate 100mbit --delay 25
        [--numel 25000000] [--rounds 3] [--queue-kb KB] [--compression none] [--trace]
        [--log-dir DIR] [-v]

The lab (needs root, iproute2, /dev/net/tun; built for this run and always torn down):

    peer k  198.18.k.2 --eth0==v{k}-- [ns inet: router, 198.18.k.1 on v{k}] --vb-- boot 198.18.250.2
                                          every routed packet crosses TUN "dly" once

- Every peer has its own namespace and access link (a veth pair to the "internet" namespace),
  rate-limited to ``--rate`` in BOTH directions: tbf on the peer-side egress (upload) and on the
  internet-side egress (download), each queue holding ``--queue-kb`` (default: one
  bandwidth-delay product at the round trip below, at least 150 KB).
- Delay: this kernel has no netem, so a delay line (``bench.netlab_worker delay``, a TUN device
  in the internet namespace with policy routing, as tests/natlab does) holds every packet that
  crosses the internet ``--delay`` ms, once. So the one-way delay between any two hosts is
  ``--delay`` and the round trip twice that (printed as measured with libp2p pings).
- The bootstrap (``swarmtrain relay``) has its own namespace; its link is not rate-limited (it
  carries only DHT traffic) but its packets are delayed like everyone's.

Each peer averages a vector of ``--numel`` float32 (``default_rng(1000 + rank)``); all peers are
told the full peer list, so matchmaking ends as soon as everyone declared. Round 0 is a warm-up,
then ``--rounds`` rounds are measured. A round's all-reduce time is max over peers of the return
time minus max over peers of the time its group formed (wall clock; all workers share this
machine's clock), so matchmaking is excluded. The bandwidth-optimal limit is 2(N-1)/N x bytes /
rate with bytes = 4 x numel (the float32 tensor; with a compressing codec the fraction can pass
1). ``fraction`` = limit_s / median_s. Every peer's result digest must agree. Each round's line
ends with the CPU seconds the peers used together from the call to the last return (from
/proc; ``peers_cpu_s`` in the JSON): on a shared 2-core machine 8 peers are CPU-bound.

``--trace``: each worker times every item it sends/receives, its bulk channel's opening and each
payload's data phase;
the bench prints a summary of the last measured round (and writes the raw records under
``--log-dir``). ``-v``: INFO logging in the workers (their stderr files are in ``--log-dir``,
else a temporary folder kept on failure). The last stdout line is one JSON object with
``median_s``, ``limit_s``, ``fraction`` and more.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.progress import BenchProgress

REPO = Path(__file__).resolve().parents[1]
NET = "198.18"  # RFC 2544 benchmarking range
BOOT = 250  # the bootstrap's subnet index
START_TIMEOUT_S = 120.0
SETUP_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------- helpers


def parse_rate(text: str) -> float:
    """tc-style rate in bits per second: 100mbit, 1gbit, 500kbit, 1e8."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(bit|kbit|mbit|gbit)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"rate {text!r}: use e.g. 100mbit, 1gbit, 500kbit")
    scale = {None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)]
    value = float(match.group(1)) * scale
    if value <= 0:
        raise argparse.ArgumentTypeError("rate must be positive")
    return value


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sh(*argv: str, timeout_s: float = SETUP_TIMEOUT_S, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


class Proc:
    """A process in a namespace with JSON-line stdout read by a thread; stderr to a file."""

    def __init__(self, name: str, namespace: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self._stderr = self.stderr_path.open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        # `ip netns exec` execs the command, so this pid is the command itself. A session of its
        # own: a Ctrl+C at the terminal reaches only us, and we stop the children in order.
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    def line(self, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise RuntimeError(
                f"{self.name}: no reply within {timeout_s:.0f} s\n{self.tail()}"
            ) from None
        if line is None:
            self._lines.put(None)
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()})\n{self.tail()}")
        return line

    def json(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.line(deadline - time.monotonic())
            if line.startswith("{"):
                return json.loads(line)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def tail(self, lines: int = 30) -> str:
        self._stderr.flush()
        text = self.stderr_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} stderr (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def request_stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.request_stop()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._stderr.close()


# ---------------------------------------------------------------------------- the lab


class Lab:
    """The star of namespaces (see the module docstring). ``down`` is idempotent.
    ``up_rate_bps``: the peers' upload rate when it differs from the download's ``rate_bps``
    (a home line's slow uplink), with a queue of ``max(150 KB, queue_bytes * up / down)``."""

    def __init__(
        self,
        prefix: str,
        peers: int,
        rate_bps: float,
        queue_bytes: int,
        up_rate_bps: float | None = None,
    ) -> None:
        self.prefix = prefix
        self.peers = peers
        self.rate_bps = rate_bps
        self.queue_bytes = queue_bytes
        self.up_rate_bps = rate_bps if up_rate_bps is None else up_rate_bps
        self.up_queue_bytes = max(150_000, int(queue_bytes * self.up_rate_bps / rate_bps))
        self.inet = prefix + "inet"
        self.boot = prefix + "boot"
        self.peer_ns = [f"{prefix}p{k}" for k in range(peers)]
        self.created: list[str] = []

    @staticmethod
    def ip(index: int) -> str:
        return f"{NET}.{index}.2"

    def up(self) -> None:
        for ns in (self.inet, self.boot, *self.peer_ns):
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"):
            sh("ip", "netns", "exec", self.inet, "sysctl", "-qw", key)
        sh("ip", "netns", "exec", self.inet, "sysctl", "-qw", "net.ipv4.conf.default.rp_filter=0")
        for index, ns in [(BOOT, self.boot), *enumerate(self.peer_ns)]:
            outer = "vb" if index == BOOT else f"v{index}"
            sh("ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth",
               "peer", "name", outer, "netns", self.inet)  # fmt: skip
            sh("ip", "-n", self.inet, "addr", "add", f"{NET}.{index}.1/24", "dev", outer)
            sh("ip", "-n", self.inet, "link", "set", outer, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(index)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"{NET}.{index}.1")
            if index != BOOT:
                self._shape(ns, "eth0", self.up_rate_bps, self.up_queue_bytes)  # upload
                self._shape(self.inet, outer, self.rate_bps, self.queue_bytes)  # download

    @staticmethod
    def _shape(ns: str, dev: str, rate_bps: float, queue_bytes: int) -> None:
        # burst 64 KB: tbf passes TCP's GSO packets whole; at 100 Mbit/s that is 5 ms of credit.
        sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", f"{int(rate_bps)}bit", "burst", "64kb",
           "limit", str(queue_bytes))  # fmt: skip

    def route_through_delay(self, dev: str) -> None:
        """Send every packet that enters the internet from a link through TUN ``dev`` first."""
        sh("ip", "-n", self.inet, "link", "set", dev, "up", "txqueuelen", "10000")
        sh("ip", "netns", "exec", self.inet, "sysctl", "-qw", f"net.ipv4.conf.{dev}.rp_filter=0")
        sh("ip", "-n", self.inet, "route", "add", "default", "dev", dev, "table", "100")
        sh("ip", "-n", self.inet, "rule", "add", "pref", "100", "iif", dev, "lookup", "main")
        links = ["vb", *(f"v{k}" for k in range(self.peers))]
        for pref, link in enumerate(links, start=200):
            sh("ip", "-n", self.inet, "rule", "add", "pref", str(pref), "iif", link,
               "lookup", "100")  # fmt: skip

    def tbf_stats(self) -> dict[str, list[int]]:
        """Bytes sent and packets dropped by the upload and download tbf of every peer."""
        stats: dict[str, list[int]] = {"up_bytes": [], "up_drops": [], "down_bytes": [],
                                       "down_drops": []}  # fmt: skip
        for k, ns in enumerate(self.peer_ns):
            for side, where, dev in (("up", ns, "eth0"), ("down", self.inet, f"v{k}")):
                out = sh("tc", "-s", "-n", where, "qdisc", "show", "dev", dev, check=False)
                match = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
                sent, drops = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
                stats[f"{side}_bytes"].append(sent)
                stats[f"{side}_drops"].append(drops)
        return stats

    def pids(self) -> list[int]:
        pids: list[int] = []
        for ns in self.created:
            out = sh("ip", "netns", "pids", ns, check=False, timeout_s=5)
            pids.extend(int(p) for p in out.split())
        return pids

    def down(self) -> None:
        """Kill what still runs in OUR namespaces (by pid), then delete them."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for ns in reversed(self.created):
            try:
                sh("ip", "netns", "del", ns, check=False, timeout_s=10)
            except subprocess.TimeoutExpired:
                print(f"allreduce_netlab: could not delete namespace {ns}", file=sys.stderr)
        self.created.clear()


# ---------------------------------------------------------------------------- reporting


def summarize_trace(replies: list[dict[str, Any]], t_formed: float) -> list[str]:
    """Per-peer send-side figures from ``--trace`` records of one round."""
    out = []
    for rank, reply in enumerate(replies):
        sends = [r for r in reply.get("trace", []) if r["dir"] == "send" and "t_data1" in r]
        if not sends:
            continue
        opens = [r["t_open1"] - r["t_open0"] for r in sends if "t_open1" in r] or [0.0]
        data = [r["t_data1"] - r["t_data0"] for r in sends]
        # per-destination gaps between one send's end and the next one's start
        gaps: list[float] = []
        by_peer: dict[str, list[dict[str, Any]]] = {}
        for r in sends:
            by_peer.setdefault(r["peer"], []).append(r)
        for items in by_peer.values():
            items.sort(key=lambda r: r["t0"])
            gaps += [b["t0"] - a["t_end"] for a, b in itertools.pairwise(items)]
        first = min(r["t0"] for r in sends) - t_formed
        out.append(
            f"  peer {rank}: {len(sends)} bulk sends, first {first * 1e3:.0f} ms after formed; "
            f"channel opens: median {statistics.median(opens) * 1e3:.0f} ms; "
            f"data {statistics.median(data):.2f} s median (sum {sum(data):.1f} s); "
            f"gaps between sends to one peer: median "
            f"{statistics.median(gaps) * 1e3 if gaps else 0:.0f} ms, "
            f"sum {sum(gaps):.1f} s"
        )
    return out


# ---------------------------------------------------------------------------- main


def tcp_baseline(lab: Lab, log_dir: Path, per_target: int, chunk: int) -> float:
    """Every peer sends ``per_target`` bytes to every other over plain TCP at once (``chunk``:
    a fresh connection per chunk); seconds from the start until the last byte arrived."""
    ips = [lab.ip(k) for k in range(lab.peers)]
    blasts: list[Proc] = []
    try:
        for k, ns in enumerate(lab.peer_ns):
            targets = ",".join(ip for ip in ips if ip != ips[k])
            argv = [sys.executable, "-m", "bench.netlab_worker", "blast", "--ip", ips[k],
                    "--targets", targets, "--bytes", str(per_target),
                    "--chunk", str(chunk)]  # fmt: skip
            blasts.append(Proc(f"blast{k}-{chunk}", ns, argv, log_dir))
        for blast in blasts:
            if blast.line(SETUP_TIMEOUT_S) != "READY":
                raise RuntimeError(f"{blast.name} did not start\n{blast.tail()}")
        for blast in blasts:
            blast.send({"go": True})
        times = [blast.json(600) for blast in blasts]
    finally:
        for blast in blasts:
            blast.stop()
    return max(t["t_received"] for t in times) - min(t["t_start"] for t in times)


def run(args: argparse.Namespace, log_dir: Path, progress: BenchProgress) -> dict[str, Any]:
    rate_bps = args.rate
    rtt_s = 2 * args.delay / 1000
    queue_bytes = (
        int(args.queue_kb * 1000) if args.queue_kb else max(150_000, int(rate_bps / 8 * rtt_s))
    )
    tensor_bytes = 4 * args.numel
    n = args.peers
    limit_s = 2 * (n - 1) / n * tensor_bytes / (rate_bps / 8)
    allreduce_timeout = max(60.0, 10 * limit_s)
    lab = Lab(f"sab{os.getpid()}-", n, rate_bps, queue_bytes)
    procs: list[Proc] = []
    tbf: dict[str, list[int]] = {"up_drops": [], "down_drops": []}
    baseline: dict[str, float] = {}
    py = sys.executable
    try:
        progress.phase(f"building the lab: {n} peers' namespaces and a delay line")
        lab.up()
        delay = Proc("delayline", lab.inet,
                     [py, "-m", "bench.netlab_worker", "delay", "--dev", "dly",
                      "--delay-ms", str(args.delay)], log_dir)  # fmt: skip
        procs.append(delay)
        if delay.line(SETUP_TIMEOUT_S) != "READY":
            raise RuntimeError(f"delay line did not start\n{delay.tail()}")
        lab.route_through_delay("dly")

        progress.phase(f"starting a relay and {n} peers")
        identity = log_dir / "boot.key"
        relay = Proc("boot", lab.boot,
                     [py, "-m", "swarmtrain.cli", "relay", "--identity", str(identity),
                      "--listen", f"/ip4/{lab.ip(BOOT)}/tcp/4001"], log_dir)  # fmt: skip
        procs.append(relay)
        join = relay.line(START_TIMEOUT_S).strip()
        print(f"bootstrap {join}")

        workers: list[Proc] = []
        for k, ns in enumerate(lab.peer_ns):
            argv = [py, "-m", "bench.netlab_worker", "peer", "--join", join, "--ip", lab.ip(k),
                    "--rank", str(k), "--numel", str(args.numel),
                    "--compression", args.compression,
                    "--allreduce-timeout", str(allreduce_timeout),
                    "--bandwidth-bps", str(rate_bps),
                    "--peer-timeout", str(args.peer_timeout)]  # fmt: skip
            if args.trace:
                argv.append("--trace")
            if args.verbose:
                argv.append("-v")
            if args.no_pace:
                argv.append("--no-pace")
            workers.append(Proc(f"peer{k}", ns, argv, log_dir))
        procs.extend(workers)
        ids, addrs, deadline = [], [], time.monotonic() + START_TIMEOUT_S
        for k, worker in enumerate(workers):
            ready = worker.json(deadline - time.monotonic())
            ids.append(ready["ready"])
            addrs.append(ready["addr"].split("/"))
            if not ready["bulk_listener"]:
                print(f"warning: peer {k} has no bulk listener ({ready['reachability']})")
        workers[0].send({"cmd": "ping", "peers": ids[1:]})
        rtts = [v for v in workers[0].json(60)["rtt_ms"].values() if v is not None]
        ping_ms = statistics.median(rtts) if rtts else float("nan")
        workers[0].send({"cmd": "tcp_rtt", "ip": addrs[1][2], "port": int(addrs[1][4])})
        rtt_ms = workers[0].json(60)["rtt_ms"]
        print(
            f"lab: {n} peers, {rate_bps / 1e6:g} Mbit/s each way per access link, "
            f"{args.delay:g} ms one-way, tbf queue {queue_bytes / 1e3:.0f} KB; "
            f"RTT peer0->peer1 {rtt_ms:.1f} ms (TCP connect), "
            f"libp2p ping {ping_ms:.1f} ms (median over peers)"
        )
        print(
            f"vector {args.numel} float32 = {tensor_bytes / 1e6:.1f} MB, "
            f"compression {args.compression}; limit 2(N-1)/N x bytes / rate = {limit_s:.2f} s"
        )

        times: list[float] = []
        all_identical = True
        wire: list[int] = []
        last: list[dict[str, Any]] = []
        progress.add("allreduce", args.rounds + 1, plain_lines=False)  # a line per round below
        # The peers' CPU seconds per measured round, the call to the last return (every peer)
        cpu: list[float] = []
        for r in range(args.rounds + 1):
            cpu_before = sum(cpu_s(w.proc.pid) for w in workers)
            wall_before = time.monotonic()
            for worker in workers:
                worker.send({"cmd": "average", "round": r, "expected": ids})
            deadline = time.monotonic() + allreduce_timeout + 90
            replies = [w.json(deadline - time.monotonic()) for w in workers]
            round_cpu = sum(cpu_s(w.proc.pid) for w in workers) - cpu_before
            round_wall = time.monotonic() - wall_before
            failed = [f"peer {k}: {x['error']}" for k, x in enumerate(replies) if not x["ok"]]
            if failed:
                raise RuntimeError(f"round {r} failed: {'; '.join(failed)}")
            formed = max(x["t_formed"] for x in replies)
            seconds = max(x["t_return"] for x in replies) - formed
            identical = len({x["digest"] for x in replies}) == 1
            full = all(x["contributors"] == n for x in replies)
            spread = max(x["t_formed"] for x in replies) - min(x["t_formed"] for x in replies)
            label = "warm-up" if r == 0 else f"round {r}"
            per_peer = ", ".join(f"{x['allreduce_s']:.2f}" for x in replies)
            print(
                f"{label}: all-reduce {seconds:.2f} s (fraction {limit_s / seconds:.3f}); "
                f"per peer {per_peer} s; "
                f"groups formed within {spread * 1e3:.0f} ms; "
                f"sent by return {sum(x['bytes_sent'] for x in replies) / 1e6:.1f} MB; "
                f"bit-identical {identical}; all {n} contributed {full}; "
                f"peers' CPU {round_cpu:.1f} s in {round_wall:.1f} s from the call"
            )
            progress.advance("allreduce")
            if r == 0:
                continue
            times.append(seconds)
            cpu.append(round_cpu)
            all_identical = all_identical and identical and full
            wire.append(sum(x["bytes_sent"] for x in replies))
            last = replies
            if args.trace:
                (log_dir / f"trace-round{r}.json").write_text(json.dumps(replies))
        if args.tcp_baseline:
            from swarm.averaging.session_wire import chunks_for

            chunk = tensor_bytes // n // chunks_for(args.numel, n, args.rate)
            progress.phase("plain TCP all-to-all baselines")
            for label, size in (
                ("one connection per pair", 0),
                (f"a connection per {chunk / 1e6:.2f} MB chunk", chunk),
            ):
                seconds = tcp_baseline(lab, log_dir, 2 * tensor_bytes // n, size)
                baseline[label] = seconds
                print(
                    f"plain TCP all-to-all, same bytes per link, {label}: {seconds:.2f} s "
                    f"(fraction {limit_s / seconds:.3f})"
                )
        tbf = lab.tbf_stats()
        print(
            f"tbf over the whole run: upload drops per peer {tbf['up_drops']}, "
            f"download drops {tbf['down_drops']}; upload MB {[b // 10**6 for b in tbf['up_bytes']]}"
        )
        if args.trace:
            print("trace of the last round (send side):")
            for text in summarize_trace(last, max(x["t_formed"] for x in last)):
                print(text)
    finally:
        for proc in reversed(procs):
            proc.request_stop()
        for proc in reversed(procs):
            proc.stop()
        lab.down()
    delay_stats: dict[str, Any] = {}
    for line in (log_dir / "delayline.stderr").read_text(errors="replace").splitlines():
        if line.startswith("{"):
            delay_stats = json.loads(line)
    median_s = statistics.median(times)
    return {
        "peers": n,
        "numel": args.numel,
        "rate_mbit": rate_bps / 1e6,
        "delay_ms": args.delay,
        "rtt_ms": round(rtt_ms, 1),
        "libp2p_ping_ms": round(ping_ms, 1),
        "rounds": len(times),
        "times_s": [round(t, 3) for t in times],
        "peers_cpu_s": [round(c, 2) for c in cpu],
        "median_s": round(median_s, 3),
        "limit_s": round(limit_s, 3),
        "fraction": round(limit_s / median_s, 3),
        "wire_bytes": int(statistics.median(wire)),
        "bit_identical": all_identical,
        "tbf_drops": sum(tbf["up_drops"]) + sum(tbf["down_drops"]),
        **({"tcp_baseline_s": {k: round(v, 3) for k, v in baseline.items()}} if baseline else {}),
        **delay_stats,
    }


def lab_unavailable(bench: str) -> str | None:
    """Why the lab cannot be built here (it needs root on Linux, iproute2 and a TUN device)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return (
            f"{bench}: needs root on Linux (network namespaces, tc, a TUN device); run it as "
            f"root, e.g. sudo .venv/bin/python -m bench.{bench} ..."
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing or not os.path.exists("/dev/net/tun"):
        return (
            f"{bench}: needs iproute2 (ip, tc) and /dev/net/tun; missing: "
            f"{', '.join(missing) or '/dev/net/tun'}"
        )
    return None


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, so the lab is torn down on either."""

    def terminate(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    # Ctrl+C even where SIGINT came in ignored (a background job of a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> int:
    parser = argparse.ArgumentParser(
        description="All-reduce between peers in network namespaces over shaped links."
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("100mbit"))
    parser.add_argument("--delay", type=float, default=25.0, help="one-way delay, ms")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    parser.add_argument("--queue-kb", type=float, default=0, help="tbf queue per direction")
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "int8"])
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=3.0,
        help="AveragerConfig.peer_timeout_s (its default, 3 s; a peer silent to pings that long "
        "is dropped)",
    )
    parser.add_argument("--trace", action="store_true", help="time every item in the workers")
    parser.add_argument(
        "--no-pace",
        action="store_true",
        help="do not pace the data channels (each at its share of the link: the default)",
    )
    parser.add_argument(
        "--tcp-baseline",
        action="store_true",
        help="also time plain-TCP all-to-all with the same bytes per link (the lab's ceiling)",
    )
    parser.add_argument("--log-dir", type=Path, help="keep worker logs (and traces) here")
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logs in the workers")
    args = parser.parse_args()
    if not 2 <= args.peers <= 200 or args.numel < 1 or args.rounds < 1 or args.delay < 0:
        parser.error("need 2 <= --peers <= 200, --numel >= 1, --rounds >= 1, --delay >= 0")
    unavailable = lab_unavailable("allreduce_netlab")
    if unavailable:
        print(unavailable, file=sys.stderr)
        return 2
    stop_on_signals()
    keep = args.log_dir is not None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="allreduce_netlab-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with BenchProgress() as progress:
            result = run(args, log_dir, progress)
    except KeyboardInterrupt:
        print(f"allreduce_netlab: interrupted; lab torn down; logs in {log_dir}", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"allreduce_netlab: {exc}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    if not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    print(
        f"median {result['median_s']:.2f} s over {result['rounds']} rounds "
        f"(times {result['times_s']}); limit {result['limit_s']:.2f} s; "
        f"fraction {result['fraction']:.3f} (target >= 0.9); "
        f"bit-identical {result['bit_identical']}"
    )
    print(json.dumps(result))
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
