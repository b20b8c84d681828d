"""Fault benchmark: one peer killed (or frozen) in the middle of an all-reduce round.

    python -m bench.allreduce_fault [--peers 4] [--numel 25000000] [--kill-after 1.0]
                                    [--signal KILL|STOP] [--rounds 3] [--vs-hivemind PYTHON]

As ../shared/bench/hivemind/bench_fault.py does it: round 0 is a warm-up with every peer. In
round 1 every peer starts; ``--kill-after`` seconds after the group formed (the first peer's
report of it) the victim's whole process group gets SIGKILL or SIGSTOP. Survivors must return by
the round's deadline (AveragerConfig defaults: peer_timeout_s 3 s, allreduce_timeout_s 60 s).
Rounds 2.. run with the survivors alone (expected peers = survivors).

Printed: how long after the fault each survivor returned, whether the survivors agree bit for bit,
whether each result equals the weighted mean over the contributors it reports (recomputed by
``swarm.reduce_part`` in the bench, compared by SHA-256), and the next round's time (call to
return, matchmaking included). A frozen victim gets SIGCONT and SIGKILL at the end. The last
stdout line is one JSON object: return_after_fault_s (the slowest survivor), survivors_agree,
result_correct, next_round_s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.allreduce import (
    HIVEMIND_DIR,
    Worker,
    collect_results,
    git_sha,
    report_failure,
    start_relay,
    start_workers,
    stop_all,
)
from bench.allreduce_worker import make_vector
from bench.progress import BenchProgress


def _expected_digest(contributors: dict[str, float], ranks: dict[str, int], numel: int) -> str:
    """SHA-256 of the weighted mean over ``contributors`` exactly as the reducers compute it."""
    from swarm import reduce_part

    contributions = {
        bytes.fromhex(peer): (make_vector(ranks[peer], numel), float(weight))
        for peer, weight in contributors.items()
    }
    out = reduce_part(contributions)
    return hashlib.sha256(memoryview(np.ascontiguousarray(out)).cast("B")).hexdigest()


def _run_ours(args: argparse.Namespace, tmp: Path, progress: BenchProgress) -> dict[str, Any]:
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP
    progress.phase(f"starting a relay and {args.peers} workers")
    relay, join = start_relay(tmp)
    workers: list[Worker] = []
    rounds: dict[int, dict[int, dict[str, Any]]] = {}
    fault: dict[str, Any] = {}
    timer: threading.Timer | None = None
    victim: Worker | None = None
    try:
        workers = start_workers(
            args.peers, join, args.numel, ["--matchmaking-timeout", str(args.match_timeout)]
        )
        victim = workers[args.victim]
        survivors = [w for w in workers if w is not victim]
        print(f"averager config: {workers[0].config}")
        config = dict(re.findall(r"(\w+_s)=([\d.]+)", workers[0].config))
        round_bound = float(config["matchmaking_timeout_s"]) + float(config["allreduce_timeout_s"])
        ranks = {w.peer_hex: w.rank for w in workers}

        def fire() -> None:
            fault["t"] = time.time()
            victim.signal_group(sig)
            print(
                f"sent SIG{args.signal} to the process group of worker {victim.rank} "
                f"{fault['t'] - fault['matched']:.3f} s after round 1's group formed",
                flush=True,
            )

        def on_event(worker: Worker, record: dict[str, Any]) -> None:
            nonlocal timer
            if record.get("event") == "matched" and record["round"] == 1 and "matched" not in fault:
                fault["matched"] = record["t"]
                timer = threading.Timer(max(0.0, record["t"] + args.kill_after - time.time()), fire)
                timer.start()

        progress.add("allreduce", args.rounds, plain_lines=False)  # a line per rank and round
        for r in range(args.rounds):
            group = workers if r <= 1 else survivors
            expected = [w.peer_hex for w in group]
            for worker in group:
                worker.send({"cmd": "average", "round": r, "expected": expected, "sample": 0})
            waited = survivors if r == 1 else group
            t_sent = time.time()
            rounds[r] = collect_results(waited, r, round_bound + 60.0, on_event)
            _print_round(r, rounds[r], fault if r == 1 else {}, t_sent)
            progress.advance("allreduce")
            if r == 1:
                if timer is not None:
                    timer.join(timeout=args.kill_after + 5)
                if "t" not in fault:
                    raise RuntimeError("round 1 ended before the fault was injected")
    except BaseException:
        report_failure([relay, *workers])
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if victim is not None and args.signal == "STOP":
            victim.signal_group(signal.SIGCONT)
            victim.signal_group(signal.SIGKILL)
        stop_all([*workers, relay])

    # Checks after every process is gone, so they do not compete for the cores.
    progress.phase("checking each result against the mean of its contributors")
    fault_round = rounds[1]
    ok = [m for m in fault_round.values() if m["ok"]]
    survivors_agree = len(ok) == len(fault_round) and len({m["digest"] for m in ok}) == 1
    correct: dict[tuple[int, int], bool] = {}
    cache: dict[tuple[tuple[str, float], ...], str] = {}
    for r, results in sorted(rounds.items()):
        for rank, m in sorted(results.items()):
            if not m["ok"]:
                continue
            key = tuple(sorted(m["contributors"].items()))
            if key not in cache:
                cache[key] = _expected_digest(m["contributors"], ranks, args.numel)
            correct[(r, rank)] = cache[key] == m["digest"]
    result_correct = bool(ok) and all(
        correct[(1, rank)] for rank, m in fault_round.items() if m["ok"]
    )
    after = [m["t_return"] - fault["t"] for m in fault_round.values()]
    next_round = rounds.get(2)
    next_round_s = (
        max(m["t_return"] for m in next_round.values())
        - min(m["t_call"] for m in next_round.values())
        if next_round and all(m["ok"] for m in next_round.values())
        else None
    )
    early = [rank for rank, m in fault_round.items() if m["t_return"] < fault["t"]]
    print()
    if early:
        print(f"WARNING: survivors {early} returned before the fault: it hit no running round")
    print(
        f"=== swarm fault probe ({git_sha()}): N={args.peers}, {args.numel * 4 / 1e6:.0f} MB "
        f"float32, SIG{args.signal} worker {args.victim} {args.kill_after:.1f} s after round 1's "
        f"group formed; {workers[0].config} ==="
    )
    for (r, rank), good in sorted(correct.items()):
        m = rounds[r][rank]
        print(
            f"round {r} rank {rank}: contributors {len(m['contributors'])}, digest "
            f"{m['digest'][:16]}, equals reduce_part over its contributors: {good}"
        )
    print(
        f"RESULT round 1 (fault): survivors returned {min(after):.2f}..{max(after):.2f} s after "
        f"the fault; errors {len(fault_round) - len(ok)}/{len(fault_round)}; distinct results "
        f"{len({m['digest'] for m in ok})}; survivors agree: {survivors_agree}; result = weighted "
        f"mean over reported contributors: {result_correct}"
    )
    if next_round_s is not None:
        print(
            f"RESULT round 2 (recovery): {len(next_round)} survivors, step (call to return, "
            f"matchmaking included) {next_round_s:.2f} s"
        )
    elif next_round:
        print(f"RESULT round 2 (recovery): FAILED {[m.get('error') for m in next_round.values()]}")
    return {
        "return_after_fault_s": max(after),
        "survivors_agree": survivors_agree,
        "result_correct": result_correct,
        "next_round_s": next_round_s,
        "returned_before_fault": early,
        "fault_round_errors": [m["error"] for m in fault_round.values() if not m["ok"]],
        "fault_round_contributors": len(ok[0]["contributors"]) if ok else 0,
        "all_results_correct": all(correct.values()),
    }


def _print_round(
    r: int, results: dict[int, dict[str, Any]], fault: dict[str, Any], t_sent: float
) -> None:
    for rank, m in sorted(results.items()):
        when = (
            f"returned {m['t_return'] - fault['t']:6.2f} s after the fault"
            if "t" in fault
            else f"step {m['t_return'] - m['t_call']:6.2f} s"
        )
        matched = m.get("t_matched")
        match_s = f"{matched - m['t_call']:6.3f} s" if matched else "  none  "
        if m["ok"]:
            what = (
                f"ok, {len(m['contributors'])} contributors, dropped {m['dropped'] or '{}'}, "
                f"digest {m['digest'][:16]}, session {m['allreduce_s']:.2f} s"
            )
        else:
            what = f"FAILED: {m['error']}"
        print(f"round {r} rank {rank}: match {match_s}  {when}  {what}", flush=True)


def _run_hivemind(python: str, args: argparse.Namespace) -> dict[str, Any]:
    script = HIVEMIND_DIR / "bench_fault.py"
    cmd = [python, str(script), "--peers", str(args.peers), "--numel", str(args.numel)]
    cmd += ["--kill-after", str(args.kill_after), "--signal", args.signal]
    cmd += ["--rounds", str(args.rounds)]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.hivemind_timeout,
            cwd=script.parent,
            start_new_session=True,
        )
        out = done.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        out += f"\n(hivemind bench ran past {args.hivemind_timeout} s)"
    keep = [
        line
        for line in out.splitlines()
        if line.startswith(("===", "RESULT", "round ", "sent SIG", "ERROR", "("))
    ]
    print("\n".join(keep))
    return {"hivemind_results": [line for line in keep if line.startswith("RESULT")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--kill-after", type=float, default=1.0)
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    parser.add_argument("--rounds", type=int, default=3, help="0 warm-up, 1 fault, 2.. survivors")
    parser.add_argument("--victim", type=int, default=None, help="rank [last]")
    parser.add_argument("--match-timeout", type=float, default=30.0, help="matchmaking_timeout_s")
    parser.add_argument("--vs-hivemind", metavar="PYTHON", default=None)
    parser.add_argument("--hivemind-timeout", type=float, default=1200.0)
    args = parser.parse_args()
    if args.peers < 3 or args.rounds < 2:
        parser.error("need --peers >= 3 and --rounds >= 2")
    args.victim = args.peers - 1 if args.victim is None else args.victim
    result: dict[str, Any] = {
        "bench": "allreduce_fault",
        "config": {
            "peers": args.peers,
            "numel": args.numel,
            "kill_after_s": args.kill_after,
            "signal": args.signal,
            "rounds": args.rounds,
            "victim": args.victim,
        },
        "git_sha": git_sha(),
    }
    with (
        BenchProgress() as progress,
        tempfile.TemporaryDirectory(prefix="bench-allreduce-fault-") as tmp,
    ):
        result.update(_run_ours(args, Path(tmp), progress))
    if args.vs_hivemind:
        result.update(_run_hivemind(args.vs_hivemind, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
