"""The simulator against reality: one all-reduce scenario in real processes over shaped links and
in ``swarm.sim`` with links fixed to the same rates and latency (issue 21 point 5).

    sudo .venv/bin/python -m bench.sim_vs_real --peers 4 --rate 50mbit --delay-ms 25
        [--numel 8000000] [--rounds 3] [--compression none,int8] [--peer-timeout 10]
        [--raw-rate] [--tcp-baseline] [--log-dir DIR]

Real: ``bench.allreduce_netlab``'s lab and workers, unchanged (each peer in its own network
namespace, its access link shaped by tbf to ``--rate`` both ways, every packet delayed
``--delay-ms`` once by the lab's delay line; the peers pace their data channels at their share
of the rate and run the real ``Averager``). A round's all-reduce time is the part after the group
formed: max over peers of the return time minus max over peers of the time its group formed.
Round 0 warms up (it opens the data channels), ``--rounds`` are measured; the median is kept.

Simulated: ``swarm.sim`` with today's protocol (``ButterflyRounds``: the real ``Matchmaker`` and
``AllReduce``), ``--peers`` peers whose links are fixed (``SimConfig.links``): up and down at the
rate TCP payload gets of ``--rate``, each one-way leg ``--delay-ms / 2`` (a pair's latency is the
lab's one crossing of the delay line), no relay, no loss; the same vector (``--numel`` values at
4 bytes, or int8's 1 + 4/1024), the same chunks per part (``chunks_for`` of the rate every real
peer declares), ``--rounds`` + 1 rounds; the simulated time is the median group all-reduce time
(last join to last finish) over the same rounds.

Why the payload rate: tbf counts whole Ethernet frames, and a full TCP segment carries 1448 bytes
of payload (1500-byte IP packet less 20 + 20 + 12 bytes of IP, TCP and timestamp option) in a
1514-byte frame, so a link shaped to R moves at most R x 1448/1514 = 0.956 R of payload. The
simulator's rates are payload rates (a message of ``size`` bytes takes ``8 size / rate``), so the
bench converts; ``--raw-rate`` gives it the tc rate instead. What the simulator does not model
here: the sessions' pacing (``session_links.PACING_SHARE``, 0.97 of the rate over all channels),
the round's two opening round trips and CPU time (encode, sum, decode) on this machine.

``--tcp-baseline`` (float32 only): plain TCP all-to-all moving the same bytes per link in the same
lab, each connection paced as a session paces its channels: sim / TCP compares the network model
with the lab's network alone, without the averaging processes (on this 2-core machine 8 real
peers are CPU-bound: README "Benchmarks").

Per setting (each ``--compression``) it prints the real median (and the peers' CPU seconds per
round, all together), the simulated time and sim / real; the last line is one JSON object:
``peers``, ``real_allreduce_s``, ``sim_allreduce_s``, ``sim_over_real`` (of the first setting),
``within_20pct`` (every setting within 20%), the load average at the start (3) and the end (1),
and ``settings`` with each one's figures (``tcp_s`` and ``sim_over_tcp`` with the baseline).
Needs root (the lab's namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import allreduce_netlab
from bench.common import git_sha
from bench.progress import BenchProgress
from swarm.averaging.codec import INT8_BLOCK_SIZE
from swarm.averaging.session_links import PACING_SHARE
from swarm.averaging.session_wire import chunks_for
from swarm.sim import (
    ButterflyConfig,
    ButterflyRounds,
    NetworkConfig,
    PeerLink,
    SimConfig,
    Simulation,
    VectorModel,
)

# A full TCP segment's payload over its Ethernet frame, as tbf counts it (module docstring).
TCP_PAYLOAD_SHARE = 1448 / 1514
BYTES_PER_PARAM = {"none": 4.0, "int8": 1.0 + 4.0 / INT8_BLOCK_SIZE}
TOLERANCE = 0.2


def simulate(
    peers: int,
    rate_bps: float,
    delay_s: float,
    numel: int,
    bytes_per_param: float,
    rounds: int,
) -> list[float]:
    """Each measured round's simulated all-reduce time (round 0 left out, as in the lab)."""
    link = PeerLink(up_bps=rate_bps, down_bps=rate_bps, leg_s=delay_s / 2, relayed=False,
                    datacenter=False)  # fmt: skip
    vector = VectorModel(
        params=numel, bytes_per_param=bytes_per_param, chunks=chunks_for(numel, peers, rate_bps)
    )
    protocol = ButterflyRounds(
        # The lab's timeouts: a round never runs into them.
        ButterflyConfig(allreduce_timeout_s=3600.0, vector=vector)
    )
    config = SimConfig(
        peers=peers,
        rounds=rounds + 1,
        start_skew_s=0.0,
        network=NetworkConfig(loss=0.0, relayed_share=0.0),
        links=(link,) * peers,
    )
    figures = Simulation(config, protocol).run()
    return [f.allreduce_s for f in figures[1:]]


def real(
    args: argparse.Namespace, compression: str, log_dir: Path, progress: BenchProgress
) -> dict[str, Any]:
    """``bench.allreduce_netlab``'s run of this setting (its lab, built and torn down)."""
    # The plain-TCP baseline paced as the sessions pace their channels.
    pacing = PACING_SHARE * args.rate / (args.peers - 1)
    os.environ.setdefault("BLAST_PACING_BPS", str(int(pacing)))
    lab_args = argparse.Namespace(
        peers=args.peers,
        rate=args.rate,
        delay=args.delay_ms,
        numel=args.numel,
        rounds=args.rounds,
        queue_kb=0,
        compression=compression,
        peer_timeout=args.peer_timeout,
        trace=False,
        no_pace=False,
        # The baseline moves float32's bytes: no comparison for a compressed setting.
        tcp_baseline=args.tcp_baseline and compression == "none",
        verbose=False,
    )
    return allreduce_netlab.run(lab_args, log_dir, progress)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", type=allreduce_netlab.parse_rate, default="50mbit")
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay, ms")
    parser.add_argument("--numel", type=int, default=8_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    parser.add_argument(
        "--compression", default="none", help="comma-separated settings: none, int8 [none]"
    )
    parser.add_argument(
        "--raw-rate",
        action="store_true",
        help="give the simulator the tc rate, not its TCP payload share",
    )
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=10.0,
        help="AveragerConfig.peer_timeout_s [its default, 10 s: 8 peers on 2 busy cores may "
        "leave a ping unanswered for 3 s, allreduce_netlab's value]",
    )
    parser.add_argument(
        "--tcp-baseline",
        action="store_true",
        help="also time plain TCP all-to-all moving the same bytes per link in the same lab, "
        "paced as the sessions pace (the lab's network without the averaging processes)",
    )
    parser.add_argument("--log-dir", type=Path, help="keep the workers' logs here")
    args = parser.parse_args()
    settings = args.compression.split(",")
    unknown = [s for s in settings if s not in BYTES_PER_PARAM]
    if unknown:
        parser.error(f"--compression: unknown {unknown}; use {sorted(BYTES_PER_PARAM)}")
    if not 2 <= args.peers <= 16 or args.numel < 1 or args.rounds < 1 or args.delay_ms < 0:
        parser.error("need 2 <= --peers <= 16, --numel >= 1, --rounds >= 1, --delay-ms >= 0")
    unavailable = allreduce_netlab.lab_unavailable("sim_vs_real")
    if unavailable:
        print(unavailable, file=sys.stderr)
        return 2
    allreduce_netlab.stop_on_signals()
    sim_rate = args.rate if args.raw_rate else args.rate * TCP_PAYLOAD_SHARE
    load = os.getloadavg()
    print(
        f"=== bench.sim_vs_real ({git_sha()}): {args.peers} peers, {args.rate / 1e6:g} Mbit/s "
        f"each way, {args.delay_ms:g} ms one-way, {args.numel} values, {args.rounds} rounds, "
        f"settings {settings}; simulated links {sim_rate / 1e6:.2f} Mbit/s; load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ===",
        flush=True,
    )
    keep = args.log_dir is not None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="sim_vs_real-"))
    rows: list[dict[str, Any]] = []
    try:
        with BenchProgress() as progress:
            for setting in settings:
                progress.phase(f"{setting}: real peers in the lab")
                sub = log_dir / setting
                sub.mkdir(parents=True, exist_ok=True)
                measured = real(args, setting, sub, progress)
                sim_times = simulate(
                    args.peers,
                    sim_rate,
                    args.delay_ms / 1000,
                    args.numel,
                    BYTES_PER_PARAM[setting],
                    args.rounds,
                )
                sim_s = statistics.median(sim_times)
                real_s = measured["median_s"]
                rows.append(
                    {
                        "compression": setting,
                        "real_allreduce_s": real_s,
                        "real_times_s": measured["times_s"],
                        "real_peers_cpu_s": measured["peers_cpu_s"],
                        "sim_allreduce_s": round(sim_s, 3),
                        "sim_over_real": round(sim_s / real_s, 3),
                        "limit_s": measured["limit_s"],
                        "bit_identical": measured["bit_identical"],
                        "tbf_drops": measured["tbf_drops"],
                    }
                )
                baseline = measured.get("tcp_baseline_s", {})
                tcp_s = next(iter(baseline.values()), None)  # one connection per pair
                if tcp_s is not None:
                    rows[-1].update(tcp_s=tcp_s, sim_over_tcp=round(sim_s / tcp_s, 3))
                progress.line(
                    f"{setting}: real median {real_s:.2f} s (rounds {measured['times_s']}; "
                    f"peers' CPU per round {measured['peers_cpu_s']} s), "
                    f"simulated {sim_s:.2f} s, sim/real {sim_s / real_s:.3f}"
                    + (
                        f"; plain TCP all-to-all {tcp_s:.2f} s, sim/TCP {sim_s / tcp_s:.3f}"
                        if tcp_s
                        else ""
                    )
                )
    except KeyboardInterrupt:
        print(f"sim_vs_real: interrupted; lab torn down; logs in {log_dir}", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"sim_vs_real: {exc}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    if not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    end_load = os.getloadavg()
    print(f"{'setting':>8} {'real_s':>8} {'sim_s':>8} {'sim/real':>8}")
    for row in rows:
        print(
            f"{row['compression']:>8} {row['real_allreduce_s']:>8.2f} "
            f"{row['sim_allreduce_s']:>8.2f} {row['sim_over_real']:>8.3f}"
        )
    first = rows[0]
    result = {
        "peers": args.peers,
        "real_allreduce_s": first["real_allreduce_s"],
        "sim_allreduce_s": first["sim_allreduce_s"],
        "sim_over_real": first["sim_over_real"],
        "within_20pct": all(abs(r["sim_over_real"] - 1) <= TOLERANCE for r in rows),
        "rate_mbit": args.rate / 1e6,
        "sim_rate_mbit": round(sim_rate / 1e6, 3),
        "delay_ms": args.delay_ms,
        "numel": args.numel,
        "load_avg": [round(x, 1) for x in (*load, *end_load[:1])],
        "settings": rows,
    }
    print(json.dumps(result))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
