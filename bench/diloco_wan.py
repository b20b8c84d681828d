"""DiLoCo against data parallel at equal wall-clock, on the real swarm over shaped slow links.

    sudo .venv/bin/python -m bench.diloco_wan [--peers 4] [--rate 100mbit] [--uplink RATE]
        [--delay 25] [--budget-s 150] [--inner-steps 125] [--batch 8] [--context 128]
        [--inner-lr 2e-3] [--outer-lr 0.7] [--outer-momentum 0.9] [--outer-momentum-warmup 0]
        [--compression int8|none|sparse] [--overlap] [bench.diloco's --sparse-* options]
        [--sparse-outer-momentum-warmup 12]
        [--log-dir DIR] [-v]

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
- Sparse DiLoCo (``--compression sparse``, issue 20; int8 DiLoCo runs beside it in the same
  sitting): ``bench.diloco.sparse_codec`` of the ``--sparse-*`` options (bench.diloco's tuned
  defaults: 1.46% of each part at 2 bits, outer lr 2.0, and like there the outer momentum ramped
  up over ``--sparse-outer-momentum-warmup`` 12 rounds) on the wire, error feedback from what
  the peers decoded, as a node with ``compression = "sparse"`` runs it. ``--overlap``: the
  method ``--compression`` names runs ``DiLoCo(overlap=True)`` (the outer step one round late,
  the averaging behind the next inner phase); with ``sparse`` the int8 run beside it stays
  synchronous, the baseline of the earlier figures.

``--uplink RATE``: the peers' upload shaped to RATE instead of ``--rate`` (which then shapes
the downloads only): a home line, e.g. ``--uplink 20mbit``. The averaging's traffic is
symmetric (each peer sends as much as it receives), so the slower side bounds it either way.

Equal wall clock: the DiLoCo runs go first, each stopping at the first round boundary at or past
``--budget-s``, which may be up to a round later; data parallel then runs for the longest wall
clock a DiLoCo run took (it stops at the first step that ends at or past it: a second or two).
Every averaging carries each peer's vote (its time is up or not), so all peers read the same
verdict and stop at the same step or round (with overlap the vote is about the next boundary,
read a round late: the worker's docstring); a round missing a peer's contribution is applied by
nobody. Each worker then reports its steps and rounds, bytes sent, time spent in averaging calls
(waiting for slower peers included; matchmaking and all-reduce separately), the part of it the
training thread waited (``exposed``), and the held-out loss (``eval_batches(corpus,
batches=8)``, nats/byte) of the parameters after its last successful round (DiLoCo's global
parameters) with their sha256: all peers must agree. It also reports the same for the last step
or round that every worker had applied by ``--budget-s`` ("within the budget": what each method
had when the nominal budget ran out; with overlap peers apply a round seconds apart, so each keeps
its last two and the driver takes the latest all of them reached).

``wan_loss_ratio`` = DiLoCo held-out loss / data-parallel held-out loss at the end of the
matched wall clock (each the median over workers, all equal when the hashes agree);
``wan_loss_ratio_within_budget`` is the same ratio for the parameters each method had at
``--budget-s`` (strict: DiLoCo's unfinished last round counts for nothing). Target:
``wan_loss_ratio`` at most 0.9. With ``--compression sparse``: ``wan_loss_ratio_sparse`` (and
``_within_budget``), sparse DiLoCo's loss over data parallel's, target at most 0.75 at 100
Mbit/s, and ``averaging_exposed_fraction``: the share of the wall clock a worker's training
thread spent waiting on averaging (median over workers; the last round's wait after the budget
included), for the method ``--compression`` names; target at most 0.02. The last stdout line is
one JSON object with the ratios, the losses, the budget and the settings. ``-v``: INFO logging
in the workers (their stderr files are in ``--log-dir``, else a temporary folder kept on
failure).
"""

from __future__ import annotations

import argparse
import json
import math
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
from bench.diloco import OUTER_MOMENTUM_WARMUP, add_sparse_options, sparse_codec
from bench.progress import BenchProgress

MATCHMAKING_TIMEOUT_S = 30.0
ALLREDUCE_TIMEOUT_S = 60.0
START_DELAY_S = 3.0  # from the start command to the common start time
METHODS = {"dp": "data parallel", "diloco": "DiLoCo", "diloco_sparse": "sparse DiLoCo"}
LABELS = {"dp": "data_parallel", "diloco": "diloco", "diloco_sparse": "diloco_sparse"}
SPARSE_OPTIONS = (
    "sparse_density", "sparse_bits", "sparse_chunk", "sparse_select", "sparse_outer_lr",
    "sparse_error_decay",
)  # fmt: skip


def worker_options(method: str, args: argparse.Namespace) -> list[str]:
    """The worker's options for ``method``: the codec and mode of that run."""
    if method == "dp":
        return ["--method", "dp"]
    compression = "sparse" if method == "diloco_sparse" else args.compression
    if compression == "sparse":
        compression = "int8" if method == "diloco" else "sparse"
    out = ["--method", "diloco", "--compression", compression]
    # --overlap is the named method's: with sparse the int8 run beside it stays synchronous.
    if args.overlap and (method == "diloco_sparse" or args.compression != "sparse"):
        out.append("--overlap")
    for name in SPARSE_OPTIONS:
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.sparse_outer_momentum is not None:
        out += ["--sparse-outer-momentum", str(args.sparse_outer_momentum)]
    return out


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
            argv = [py, "-m", "bench.diloco_wan_worker", *worker_options(method, args),
                    "--join", join,
                    "--ip", lab.ip(k), "--rank", str(k), "--peers", str(args.peers),
                    "--inner-steps", str(args.inner_steps), "--batch", str(args.batch),
                    "--context", str(args.context), "--inner-lr", str(args.inner_lr),
                    "--outer-lr", str(args.outer_lr),
                    "--outer-momentum", str(args.outer_momentum),
                    "--outer-momentum-warmup", str(args.outer_momentum_warmup),
                    "--sparse-outer-momentum-warmup", str(args.sparse_outer_momentum_warmup),
                    "--rate-bps", str(args.uplink),
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
                f"lab: {args.peers} peers, {args.uplink / 1e6:g} Mbit/s up and "
                f"{args.rate / 1e6:g} Mbit/s down per access link, "
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


def within_budget(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each worker's entry for the latest round every worker had applied by the nominal budget
    (the worker's ``Tally.within``), in worker order; an empty entry where one lacks it."""
    common = min(max(w["round"] for w in r["within"]) for r in replies)
    return [next((w for w in r["within"] if w["round"] == common), {}) for r in replies]


def summarize(method: str, replies: list[dict[str, Any]], up_bytes: list[int]) -> dict[str, Any]:
    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in replies))

    within = within_budget(replies)

    return {
        "steps": [r["steps"] for r in replies],
        "rounds": [r["rounds"] for r in replies],
        "rounds_failed": [r["rounds_failed"] for r in replies],
        "tokens_per_peer": median("tokens"),
        "loss": median("loss"),
        "losses": [round(r["loss"], 5) for r in replies],
        "params_agree": len({r["param_hash"] for r in replies}) == 1,
        "steps_within": [w.get("steps", -1) for w in within],
        "rounds_within": [w.get("rounds", -1) for w in within],
        "loss_within": float(statistics.median(w.get("loss", math.nan) for w in within)),
        "params_within_agree": len({w.get("hash") for w in within}) == 1,
        "elapsed_s": max(r["elapsed_s"] for r in replies),
        "mb_sent_per_peer": median("bytes_sent") / 1e6,
        "tbf_upload_mb_per_peer": statistics.median(up_bytes) / 1e6,
        "comm_fraction": statistics.median(r["comm_s"] / r["elapsed_s"] for r in replies),
        "exposed_fraction": statistics.median(r["exposed_s"] / r["elapsed_s"] for r in replies),
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
        f"{100 * s['comm_fraction']:.0f}% of the wall time, training waiting on it "
        f"{100 * s['exposed_fraction']:.1f}% (per round: matchmaking "
        f"{s['matchmaking_s_per_round']:.2f} s, all-reduce {s['allreduce_s_per_round']:.2f} s); "
        f"params agree {'yes' if s['params_agree'] else 'NO'} (within the budget "
        f"{'yes' if s['params_within_agree'] else 'NO'})"
    )


def run(args: argparse.Namespace, log_dir: Path, progress: BenchProgress) -> dict[str, Any]:
    rtt_s = 2 * args.delay / 1000
    queue_bytes = max(150_000, int(args.rate / 8 * rtt_s))
    lab = Lab(f"sdw{os.getpid()}-", args.peers, args.rate, queue_bytes, args.uplink)
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
        # DiLoCo first: each run stops at the first round boundary at or past the budget, up
        # to a round later; data parallel then gets the longest wall clock a DiLoCo run took.
        methods = ("diloco_sparse", "diloco") if args.compression == "sparse" else ("diloco",)
        dp_budget_s = args.budget_s
        for method in (*methods, "dp"):
            budget_s = dp_budget_s if method == "dp" else args.budget_s
            results[method] = run_method(
                method, args, lab, join, log_dir, lab_info, budget_s, progress
            )
            print(describe(method, results[method], args.budget_s), flush=True)
            for error in results[method]["errors"]:
                print(f"  {method} worker error: {error}")
            dp_budget_s = max(dp_budget_s, results[method]["elapsed_s"])
    finally:
        for proc in reversed(procs):
            proc.request_stop()
        for proc in reversed(procs):
            proc.stop()
        lab.down()
    dp, dl = results["dp"], results["diloco"]
    named = results["diloco_sparse" if args.compression == "sparse" else "diloco"]

    def each(key: str, digits: int) -> dict[str, Any]:
        return {LABELS[m]: round(r[key], digits) for m, r in results.items()}

    out: dict[str, Any] = {
        "wan_loss_ratio": round(dl["loss"] / dp["loss"], 4),
        "wan_loss_ratio_within_budget": round(dl["loss_within"] / dp["loss_within"], 4),
    }
    if "diloco_sparse" in results:
        sp = results["diloco_sparse"]
        out["wan_loss_ratio_sparse"] = round(sp["loss"] / dp["loss"], 4)
        out["wan_loss_ratio_sparse_within_budget"] = round(sp["loss_within"] / dp["loss_within"], 4)
    return {
        **out,
        "averaging_exposed_fraction": round(named["exposed_fraction"], 4),
        "exposed_fraction": each("exposed_fraction", 4),
        "loss": each("loss", 4),
        "loss_within_budget": each("loss_within", 4),
        "budget_s": args.budget_s,
        "matched_wall_clock_s": dp["elapsed_s"],
        "elapsed_s": {LABELS[m]: r["elapsed_s"] for m, r in results.items()},
        "steps_per_peer": {LABELS[m]: r["steps"][0] for m, r in results.items()},
        "rounds": {LABELS[m]: r["rounds"][0] for m, r in results.items()},
        "rounds_failed": {LABELS[m]: max(r["rounds_failed"]) for m, r in results.items()},
        "tokens_per_peer": {LABELS[m]: r["tokens_per_peer"] for m, r in results.items()},
        "mb_sent_per_peer": each("mb_sent_per_peer", 3),
        "comm_fraction": each("comm_fraction", 3),
        "params_agree": all(
            r["params_agree"] and r["params_within_agree"] for r in results.values()
        ),
        "rtt_ms": round(lab_info.get("rtt_ms", float("nan")), 1),
        "config": {
            "peers": args.peers,
            "rate_mbit": args.rate / 1e6,
            "uplink_mbit": args.uplink / 1e6,
            "delay_ms": args.delay,
            "inner_steps": args.inner_steps,
            "batch": args.batch,
            "context": args.context,
            "inner_lr": args.inner_lr,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "outer_momentum_warmup": args.outer_momentum_warmup,
            "sparse_outer_momentum_warmup": args.sparse_outer_momentum_warmup,
            "compression": args.compression,
            "overlap": args.overlap,
            "sparse": args.sparse_name,
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
    parser.add_argument(
        "--outer-momentum-warmup", type=int, default=0, help="rounds (int8/none DiLoCo)"
    )
    parser.add_argument(
        "--sparse-outer-momentum-warmup", type=int, default=OUTER_MOMENTUM_WARMUP,
        help="rounds (sparse DiLoCo; bench.diloco's, under which its settings were chosen)",
    )  # fmt: skip
    parser.add_argument(
        "--uplink", type=parse_rate, help="the peers' upload rate (default --rate): a home line"
    )
    parser.add_argument(
        "--compression", default="int8", choices=["int8", "none", "sparse"],
        help="sparse: sparse DiLoCo and int8 DiLoCo side by side",
    )  # fmt: skip
    parser.add_argument(
        "--overlap", action="store_true",
        help="the named method's DiLoCo with the one-round-delayed outer step",
    )  # fmt: skip
    add_sparse_options(parser)
    parser.add_argument("--log-dir", type=Path, help="keep worker logs here")
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logs in the workers")
    args = parser.parse_args()
    if not 2 <= args.peers <= 64 or args.delay < 0 or args.budget_s <= 0 or args.inner_steps < 1:
        parser.error("need 2 <= --peers <= 64, --delay >= 0, --budget-s > 0, --inner-steps >= 1")
    args.uplink = args.rate if args.uplink is None else args.uplink
    try:
        args.sparse_name = sparse_codec(args).name if args.compression == "sparse" else None
    except ValueError as error:
        parser.error(str(error))
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
        f"{args.outer_momentum}, {args.compression} pseudo-gradients"
        + (f" ({args.sparse_name}, outer lr {args.sparse_outer_lr})" if args.sparse_name else "")
        + (" with overlap" if args.overlap else "")
        + f"; {os.cpu_count()} cores, load average {load_before:.1f} before the run ===",
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
    result["load_after"] = round(os.getloadavg()[0], 2)
    result["git_sha"] = sha
    print(
        f"wan_loss_ratio {result['wan_loss_ratio']:.3f} (target <= 0.9); within the budget "
        f"{result['wan_loss_ratio_within_budget']:.3f}; params agree {result['params_agree']}"
    )
    if "wan_loss_ratio_sparse" in result:
        print(
            f"wan_loss_ratio_sparse {result['wan_loss_ratio_sparse']:.3f} (target <= 0.75 at "
            f"100 Mbit/s); within the budget {result['wan_loss_ratio_sparse_within_budget']:.3f}"
        )
    print(f"averaging_exposed_fraction {result['averaging_exposed_fraction']:.4f} (target <= 0.02)")
    print(json.dumps(result))
    return 0 if result["params_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
