"""DiLoCo against data parallel at equal wall-clock, on the real swarm over shaped slow links.

    sudo .venv/bin/python -m bench.diloco_wan [--peers 4] [--rate 100mbit] [--delay 25]
        [--budget-s 150] [--inner-steps 125] [--batch 8] [--context 128] [--inner-lr 2e-3]
        [--outer-lr 0.7] [--outer-momentum 0.9] [--compression int8|none] [--log-dir DIR] [-v]

Issue 4's "equal wall-clock over a real slow link": both methods train the embedded default
model on the swarm itself (real libp2p nodes, the real ``swarm.Averager`` matchmaking and
all-reduce) for the same wall-clock budget, and the bench prints how their held-out losses
compare.

The lab is ``bench.allreduce_netlab``'s (needs root, iproute2, /dev/net/tun; built for this run
and always torn down): every peer in its own network namespace behind an access link shaped to
``--rate`` in both directions (tbf), every packet through the internet namespace held
``--delay`` ms once by the delay line (so the round trip between peers is twice that), and a
bootstrap (``swarmtrain relay``) in a namespace of its own. Both methods run in the same sitting
of the lab, each with fresh worker processes (``bench.diloco_wan_worker``), one per namespace.

The method, the same for both: model ``ByteTransformer(seed=0)``, worker k's batches are
``bench.diloco``'s (``inner_batches`` of run seed 0, the round, ``worker-k``; ``--batch``
windows of ``--context`` bytes), inner AdamW at ``--inner-lr``, one torch thread per worker
(the workers share this machine's cores, the same for both methods). The driver sends every
worker one start time and the budget; all share this machine's clock.

- Data parallel: every step each peer computes its batch's gradient, the swarm averages the
  flat float32 gradient (no compression, all peers expected, round number = step), and AdamW
  steps with the mean, so the parameters stay identical on all peers.
- DiLoCo: ``diloco.DiLoCo`` with ``--inner-steps`` H, the outer Nesterov step at
  ``--outer-lr``/``--outer-momentum``, pseudo-gradients averaged through
  ``swarmtrain.training.swarm_average.SwarmAverage`` with int8 on the wire and error feedback
  (``bench.diloco``'s codec as ``compress``), ``--compression none`` for float32.

Equal wall clock: DiLoCo runs first and stops at the first round boundary at or past
``--budget-s``, which may be up to a round later; data parallel then runs for exactly the wall
clock DiLoCo took (it stops at the first step that ends at or past it: a second or two). Every
averaged vector carries each peer's vote (its time is up or not), so all peers read the same
verdict and stop at the same step or round; a round missing a peer's contribution is applied by
nobody (see the worker's docstring). Each worker then reports its steps and rounds, bytes sent,
time spent in averaging calls (waiting for slower peers included; matchmaking and all-reduce
separately), and the held-out loss (``eval_batches(corpus, batches=8)``, nats/byte) of the
parameters after its last successful round (DiLoCo's global parameters) with their sha256: all
peers must agree. It also reports the same for the last step or round that completed by
``--budget-s`` ("within the budget": what each method had when the nominal budget ran out).

``wan_loss_ratio`` = DiLoCo held-out loss / data-parallel held-out loss at the end of the
matched wall clock (each the median over workers, all equal when the hashes agree);
``wan_loss_ratio_within_budget`` is the same ratio for the parameters each method had at
``--budget-s`` (strict: DiLoCo's unfinished last round counts for nothing). Target:
``wan_loss_ratio`` at most 0.9. The last stdout line is one JSON object with both ratios, the
losses, the budget and the settings. ``-v``: INFO logging in the workers (their stderr files are
in ``--log-dir``, else a temporary folder kept on failure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.allreduce_netlab import (
    BOOT,
    SETUP_TIMEOUT_S,
    START_TIMEOUT_S,
    Lab,
    Proc,
    lab_unavailable,
    parse_rate,
    stop_on_signals,
)
from bench.common import git_sha
from bench.progress import BenchProgress

MATCHMAKING_TIMEOUT_S = 30.0
ALLREDUCE_TIMEOUT_S = 60.0
START_DELAY_S = 3.0  # from the start command to the common start time
METHODS = {"dp": "data parallel", "diloco": "DiLoCo"}


def run_method(
    method: str,
    args: argparse.Namespace,
    lab: Lab,
    join: str,
    log_dir: Path,
    lab_info: dict[str, Any],
    budget_s: float,
    progress: BenchProgress,
) -> dict[str, Any]:
    """Fresh workers of ``method`` in the peers' namespaces, one common start, their results.
    They stop at the first step or round boundary at or past ``budget_s``; the parameters
    reported "within" are those of the last one done by ``args.budget_s``."""
    py = sys.executable
    workers: list[Proc] = []
    try:
        for k, ns in enumerate(lab.peer_ns):
            argv = [py, "-m", "bench.diloco_wan_worker", "--method", method, "--join", join,
                    "--ip", lab.ip(k), "--rank", str(k), "--peers", str(args.peers),
                    "--inner-steps", str(args.inner_steps), "--batch", str(args.batch),
                    "--context", str(args.context), "--inner-lr", str(args.inner_lr),
                    "--outer-lr", str(args.outer_lr),
                    "--outer-momentum", str(args.outer_momentum),
                    "--compression", args.compression, "--rate-bps", str(args.rate),
                    "--matchmaking-timeout", str(MATCHMAKING_TIMEOUT_S),
                    "--allreduce-timeout", str(ALLREDUCE_TIMEOUT_S)]  # fmt: skip
            if args.verbose:
                argv.append("-v")
            workers.append(Proc(f"{method}{k}", ns, argv, log_dir))
        ids, addrs, deadline = [], [], time.monotonic() + START_TIMEOUT_S
        for k, worker in enumerate(workers):
            ready = worker.json(deadline - time.monotonic())
            ids.append(ready["ready"])
            addrs.append(ready["addr"].split("/"))
            if not ready["bulk_listener"]:
                print(f"warning: {method} peer {k} has no bulk listener")
        if "rtt_ms" not in lab_info:
            workers[0].send({"cmd": "tcp_rtt", "ip": addrs[1][2], "port": int(addrs[1][4])})
            lab_info["rtt_ms"] = workers[0].json(60)["rtt_ms"]
            print(
                f"lab: {args.peers} peers, {args.rate / 1e6:g} Mbit/s each way per access link, "
                f"{args.delay:g} ms one-way, tbf queue {lab.queue_bytes / 1e3:.0f} KB; "
                f"RTT peer0->peer1 {lab_info['rtt_ms']:.1f} ms (TCP connect)",
                flush=True,
            )
        before = lab.tbf_stats()
        t_start = time.time() + START_DELAY_S
        for worker in workers:
            worker.send(
                {
                    "cmd": "start",
                    "t_start": t_start,
                    "budget_s": budget_s,
                    "nominal_s": args.budget_s,
                    "expected": ids,
                }
            )
        # One round past the budget, plus a failed round's timeouts, plus the evaluation.
        slack = 2 * (MATCHMAKING_TIMEOUT_S + ALLREDUCE_TIMEOUT_S) + max(120.0, budget_s)
        deadline = time.monotonic() + START_DELAY_S + budget_s + slack
        progress.phase(f"{method}: {args.peers} workers train for {budget_s:.0f} s")
        with progress.ticking(method, START_DELAY_S + budget_s):
            replies = [w.json(deadline - time.monotonic()) for w in workers]
        after = lab.tbf_stats()
    finally:
        for worker in workers:
            worker.request_stop()
        for worker in workers:
            worker.stop()
    up_bytes = [a - b for a, b in zip(after["up_bytes"], before["up_bytes"], strict=True)]
    return summarize(method, replies, up_bytes)


def summarize(method: str, replies: list[dict[str, Any]], up_bytes: list[int]) -> dict[str, Any]:
    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in replies))

    return {
        "steps": [r["steps"] for r in replies],
        "rounds": [r["rounds"] for r in replies],
        "rounds_failed": [r["rounds_failed"] for r in replies],
        "tokens_per_peer": median("tokens"),
        "loss": median("loss"),
        "losses": [round(r["loss"], 5) for r in replies],
        "params_agree": len({r["param_hash"] for r in replies}) == 1,
        "steps_within": [r["steps_within"] for r in replies],
        "rounds_within": [r["rounds_within"] for r in replies],
        "loss_within": median("loss_within"),
        "params_within_agree": len({r["hash_within"] for r in replies}) == 1,
        "elapsed_s": max(r["elapsed_s"] for r in replies),
        "mb_sent_per_peer": median("bytes_sent") / 1e6,
        "tbf_upload_mb_per_peer": statistics.median(up_bytes) / 1e6,
        "comm_fraction": statistics.median(r["comm_s"] / r["elapsed_s"] for r in replies),
        "matchmaking_s_per_round": median("matchmaking_s") / max(1, median("rounds")),
        "allreduce_s_per_round": median("allreduce_s") / max(1, median("rounds")),
        "errors": [e for r in replies for e in r["errors"]][:8],
    }


def describe(method: str, s: dict[str, Any], budget_s: float) -> str:
    if method == "dp":
        work = f"{s['steps'][0]} steps (= rounds; {max(s['rounds_failed'])} failed)"
        within = f"{s['steps_within'][0]} steps"
    else:
        work = (
            f"{s['steps'][0]} inner steps, {s['rounds'][0]} rounds "
            f"({max(s['rounds_failed'])} failed)"
        )
        within = f"{s['rounds_within'][0]} rounds"
    return (
        f"{METHODS[method]:>13}: {work}, {s['tokens_per_peer']:,.0f} tokens per peer in "
        f"{s['elapsed_s']:.1f} s; held-out {s['loss']:.4f} nats/byte ({s['loss_within']:.4f} "
        f"after the {within} done by {budget_s:g} s); {s['mb_sent_per_peer']:.1f} MB sent per "
        f"peer (tbf upload {s['tbf_upload_mb_per_peer']:.1f} MB); communicating "
        f"{100 * s['comm_fraction']:.0f}% of the wall time (per round: matchmaking "
        f"{s['matchmaking_s_per_round']:.2f} s, all-reduce {s['allreduce_s_per_round']:.2f} s); "
        f"params agree {'yes' if s['params_agree'] and s['params_within_agree'] else 'NO'}"
    )


def run(args: argparse.Namespace, log_dir: Path, progress: BenchProgress) -> dict[str, Any]:
    rtt_s = 2 * args.delay / 1000
    queue_bytes = max(150_000, int(args.rate / 8 * rtt_s))
    lab = Lab(f"sdw{os.getpid()}-", args.peers, args.rate, queue_bytes)
    procs: list[Proc] = []
    py = sys.executable
    lab_info: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        progress.phase(f"building the lab: {args.peers} peers' namespaces and a delay line")
        lab.up()
        delay = Proc("delayline", lab.inet,
                     [py, "-m", "bench.netlab_worker", "delay", "--dev", "dly",
                      "--delay-ms", str(args.delay)], log_dir)  # fmt: skip
        procs.append(delay)
        if delay.line(SETUP_TIMEOUT_S) != "READY":
            raise RuntimeError(f"delay line did not start\n{delay.tail()}")
        lab.route_through_delay("dly")
        relay = Proc("boot", lab.boot,
                     [py, "-m", "swarmtrain.cli", "relay", "--identity",
                      str(log_dir / "boot.key"),
                      "--listen", f"/ip4/{lab.ip(BOOT)}/tcp/4001"], log_dir)  # fmt: skip
        procs.append(relay)
        join = relay.line(START_TIMEOUT_S).strip()
        print(f"bootstrap {join}", flush=True)
        # DiLoCo first: it stops at the first round boundary at or past the budget, up to a
        # round later; data parallel then gets exactly the wall clock DiLoCo took.
        budget_s = args.budget_s
        for method in ("diloco", "dp"):
            results[method] = run_method(
                method, args, lab, join, log_dir, lab_info, budget_s, progress
            )
            print(describe(method, results[method], args.budget_s), flush=True)
            for error in results[method]["errors"]:
                print(f"  {method} worker error: {error}")
            budget_s = max(budget_s, results[method]["elapsed_s"])
    finally:
        for proc in reversed(procs):
            proc.request_stop()
        for proc in reversed(procs):
            proc.stop()
        lab.down()
    dp, dl = results["dp"], results["diloco"]
    return {
        "wan_loss_ratio": round(dl["loss"] / dp["loss"], 4),
        "wan_loss_ratio_within_budget": round(dl["loss_within"] / dp["loss_within"], 4),
        "loss": {"data_parallel": round(dp["loss"], 4), "diloco": round(dl["loss"], 4)},
        "loss_within_budget": {
            "data_parallel": round(dp["loss_within"], 4),
            "diloco": round(dl["loss_within"], 4),
        },
        "budget_s": args.budget_s,
        "matched_wall_clock_s": dl["elapsed_s"],
        "elapsed_s": {"data_parallel": dp["elapsed_s"], "diloco": dl["elapsed_s"]},
        "steps_per_peer": {"data_parallel": dp["steps"][0], "diloco": dl["steps"][0]},
        "rounds": {"data_parallel": dp["rounds"][0], "diloco": dl["rounds"][0]},
        "rounds_failed": {
            "data_parallel": max(dp["rounds_failed"]),
            "diloco": max(dl["rounds_failed"]),
        },
        "tokens_per_peer": {
            "data_parallel": dp["tokens_per_peer"],
            "diloco": dl["tokens_per_peer"],
        },
        "mb_sent_per_peer": {
            "data_parallel": round(dp["mb_sent_per_peer"], 2),
            "diloco": round(dl["mb_sent_per_peer"], 2),
        },
        "comm_fraction": {
            "data_parallel": round(dp["comm_fraction"], 3),
            "diloco": round(dl["comm_fraction"], 3),
        },
        "params_agree": all(
            r["params_agree"] and r["params_within_agree"] for r in results.values()
        ),
        "rtt_ms": round(lab_info.get("rtt_ms", float("nan")), 1),
        "config": {
            "peers": args.peers,
            "rate_mbit": args.rate / 1e6,
            "delay_ms": args.delay,
            "inner_steps": args.inner_steps,
            "batch": args.batch,
            "context": args.context,
            "inner_lr": args.inner_lr,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "compression": args.compression,
            "cores": os.cpu_count(),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("100mbit"))
    parser.add_argument("--delay", type=float, default=25.0, help="one-way delay, ms")
    parser.add_argument("--budget-s", type=float, default=150.0, help="wall clock per method")
    parser.add_argument("--inner-steps", type=int, default=125, help="DiLoCo's H")
    parser.add_argument("--batch", type=int, default=8, help="windows per step per peer")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--inner-lr", type=float, default=2e-3, help="AdamW, both methods")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--compression", default="int8", choices=["int8", "none"])
    parser.add_argument("--log-dir", type=Path, help="keep worker logs here")
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logs in the workers")
    args = parser.parse_args()
    if not 2 <= args.peers <= 64 or args.delay < 0 or args.budget_s <= 0 or args.inner_steps < 1:
        parser.error("need 2 <= --peers <= 64, --delay >= 0, --budget-s > 0, --inner-steps >= 1")
    unavailable = lab_unavailable("diloco_wan")
    if unavailable:
        print(unavailable, file=sys.stderr)
        return 2
    stop_on_signals()
    keep = args.log_dir is not None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="diloco_wan-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    sha = git_sha()  # once: the tree may move on while the bench runs
    print(
        f"=== DiLoCo vs data parallel at equal wall-clock ({sha}): {args.peers} peers, "
        f"{args.budget_s:g} s each, H={args.inner_steps}, batch {args.batch}x{args.context}, "
        f"AdamW {args.inner_lr}, outer Nesterov lr {args.outer_lr} momentum "
        f"{args.outer_momentum}, {args.compression} pseudo-gradients; {os.cpu_count()} cores, "
        f"load average {load_before:.1f} before the run ===",
        flush=True,
    )
    try:
        with BenchProgress() as progress:
            result = run(args, log_dir, progress)
    except KeyboardInterrupt:
        print(f"diloco_wan: interrupted; lab torn down; logs in {log_dir}", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"diloco_wan: {exc}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    if not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    result["load_before"] = round(load_before, 2)
    result["git_sha"] = sha
    print(
        f"wan_loss_ratio {result['wan_loss_ratio']:.3f} (target <= 0.9); within the budget "
        f"{result['wan_loss_ratio_within_budget']:.3f}; params agree {result['params_agree']}"
    )
    print(json.dumps(result))
    return 0 if result["params_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
