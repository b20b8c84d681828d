"""Churn soak: a swarm whose peers are SIGKILLed and started at random while it trains, as PCCL
tests its library.

    python -m bench.churn --peers 8 --minutes 10 [--seed S] [--inner-steps H]
                          [--spawn 0.6 --kill 0.4] [--workdir DIR]

A coordinator and ``--initial`` (default ``--peers``) ``swarmtrain node`` processes on loopback,
as ``swarmtrain local`` starts them, on the default run with a schedule longer than the soak and
``--inner-steps`` H (small, so rounds are short). Once the swarm averaged its first round, every
step (``--step-s`` seconds, drawn between half and one and a half of it) two draws: with
probability ``--spawn`` a new node starts with a fresh state directory (it joins mid-run) while
fewer than ``--peers`` live, and with probability ``--kill`` a random live node is SIGKILLed while
more than ``--min-alive`` live. Each node's stdout is read live (``bench.churn_tally`` parses its
round lines); a line per churn event and per swarm round is printed while it runs, a table at
the end, and as the last line one JSON object: ``rounds`` (averaged by the swarm), ``max_stall_s``
(the longest gap between two successive averaged rounds, the end of the soak included),
``round_deadline_s`` (the spec's matchmaking plus all-reduce deadlines), ``hash_disagreements``
(rounds whose peers' state hashes differed and still did one round later), ``joins``, ``kills``,
``failed_rounds``, ``lost_rounds``, ``syncs`` and more. Target: ``max_stall_s`` at most
``round_deadline_s``, ``hash_disagreements`` 0. Every process is killed at the end; with
``--workdir`` each node's stdout (``nodeI.out``), log (``nodeI.log``) and state stay there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from bench.churn_tally import Event, Figures, Kind, RoundRow, figures, parse_line, round_rows
from bench.common import git_sha
from bench.progress import BenchProgress
from swarmtrain.commands.local import (
    Child,
    LocalOptions,
    node_argv,
    start_coordinator,
    work_directory,
)

# Far more rounds than any soak averages: the run must not end (and linger) under it.
SCHEDULE_ROUNDS = 100_000
POLL_S = 0.5


class Soak:
    """The processes of one soak and the events their lines reported."""

    def __init__(self, workdir: Path, join: str, started: float, verbose: bool) -> None:
        self.workdir = workdir
        self.join = join
        self.started = started
        self.verbose = verbose
        self.live: dict[int, Child] = {}
        self.all: list[Child] = []
        self.events: list[Event] = []
        self.exits: list[tuple[int, int]] = []  # (node, status): nodes that ended by themselves
        self._outs: list[IO[str]] = []
        self._lock = threading.Lock()
        self._next = 0

    def now(self) -> float:
        return time.monotonic() - self.started

    def spawn(self) -> int:
        index = self._next
        self._next += 1
        out = (self.workdir / f"node{index}.out").open("w")
        self._outs.append(out)
        argv = node_argv(self.join, self.workdir / f"node{index}", 1, verbose=self.verbose)
        child = Child(f"node {index}", argv, self.workdir / f"node{index}.log",
                      self._reader(index, out))  # fmt: skip
        self.live[index] = child
        self.all.append(child)
        return index

    def _reader(self, index: int, out: IO[str]) -> Callable[[str], None]:
        def on_line(line: str) -> None:
            t = self.now()
            out.write(f"{t:9.2f} {line}\n")
            out.flush()
            event = parse_line(line, t, index)
            if event is not None:
                with self._lock:
                    self.events.append(event)

        return on_line

    def kill(self, index: int) -> None:
        child = self.live.pop(index)
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        child.stop()  # joins the reader, closes the log

    def reap(self) -> list[tuple[int, int]]:
        """Nodes that exited on their own since the last call (a crash, a run over, a ban)."""
        ended = [(i, c.proc.returncode) for i, c in self.live.items() if c.proc.poll() is not None]
        for index, status in ended:
            self.live.pop(index).stop()
            self.exits.append((index, status))
        return ended

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        """SIGKILL every node still alive (the soak's end is one more crash, not a clean stop)."""
        for index in list(self.live):
            self.kill(index)
        for out in self._outs:
            out.close()


def _row_line(row: RoundRow) -> str:
    when = f"{row.t:7.1f} s" if row.t is not None else "      - "
    gap = f"{row.gap_s:5.1f} s" if row.gap_s is not None else "    - "
    hashes = " ".join(f"{h[:8]}x{n}" for h, n in sorted(row.hashes.items(), key=lambda x: -x[1]))
    return (
        f"round {row.round:4d}  at {when}  gap {gap}  averaged {row.averaged}  "
        f"failed {row.failed}  states {hashes or '-'}"
    )


def run(args: argparse.Namespace, workdir: Path, progress: BenchProgress) -> dict[str, object]:
    rng = random.Random(args.seed)
    run_id = f"churn-{args.seed}-{os.urandom(3).hex()}"
    options = LocalOptions(peers=args.initial, rounds=SCHEDULE_ROUNDS, inner_steps=args.inner_steps)
    config = options.run_config(run_id)
    deadline_s = config.swarm.matchmaking_timeout_s + config.swarm.allreduce_timeout_s
    started = time.monotonic()
    end = started + args.minutes * 60
    coordinator: list[Child] = []
    joins = kills = 0
    printed = -1  # rows up to this round were printed
    with ExitStack() as stack:
        stack.callback(lambda: [c.stop() for c in coordinator])
        progress.phase(f"starting a coordinator and {args.initial} nodes")
        join = start_coordinator(workdir, config, coordinator, lambda line: print(line, flush=True))
        soak = Soak(workdir, join, started, args.verbose)
        stack.callback(soak.close)  # before the coordinator's stop (LIFO)
        for _ in range(args.initial):
            soak.spawn()
        print(f"{soak.now():7.1f} s  started {args.initial} nodes; churn starts after round 0",
              flush=True)  # fmt: skip
        next_step: float | None = None
        # Seconds of the soak; the lines below (joins, kills, rounds) are its plain progress.
        progress.add("churn", round(args.minutes * 60), unit="s", plain_lines=False)
        while time.monotonic() < end:
            time.sleep(POLL_S)
            progress.reach("churn", int(time.monotonic() - started))
            for index, status in soak.reap():
                print(f"{soak.now():7.1f} s  node {index} exited with status {status} "
                      f"(live {len(soak.live)})", flush=True)  # fmt: skip
            events = soak.snapshot()
            averaged = [e.round for e in events if e.kind is Kind.AVERAGED]
            if averaged:
                newest = max(averaged)
                for row in round_rows(events):
                    if printed < row.round < newest:
                        print(_row_line(row), flush=True)
                        printed = row.round
                if next_step is None:
                    next_step = time.monotonic()
            if next_step is None or time.monotonic() < next_step:
                continue
            next_step = time.monotonic() + args.step_s * rng.uniform(0.5, 1.5)
            # Both draws every step, whatever the live count: the seed fixes the sequence.
            spawn, kill, pick = rng.random(), rng.random(), rng.random()
            if spawn < args.spawn and len(soak.live) < args.peers:
                index = soak.spawn()
                joins += 1
                print(f"{soak.now():7.1f} s  join: node {index} started "
                      f"(live {len(soak.live)})", flush=True)  # fmt: skip
            if kill < args.kill and len(soak.live) > args.min_alive:
                victims = sorted(soak.live)
                index = victims[int(pick * len(victims))]
                soak.kill(index)
                kills += 1
                print(f"{soak.now():7.1f} s  kill: node {index} SIGKILLed "
                      f"(live {len(soak.live)})", flush=True)  # fmt: skip
        end_t = soak.now()
        progress.phase("stopping the nodes and tallying the rounds")
        soak.reap()
        live_at_end = len(soak.live)
    events = [e for e in soak.snapshot() if e.t <= end_t]
    rows = round_rows(events)
    for row in rows:
        if row.round > printed:
            print(_row_line(row), flush=True)
    # A row printed live may lack a group that reported its round later (two groups averaging
    # the same rounds side by side): the rounds worth a look again, from every event.
    notable = [row for row in rows if len(row.hashes) > 1 or row.failed or not row.averaged]
    if notable:
        print("rounds with differing states or failures, from every line:", flush=True)
        for row in notable:
            print(_row_line(row), flush=True)
    found = figures(events, end_t)
    return _result(args, found, deadline_s, joins, kills, live_at_end, soak.exits, end_t)


def _result(
    args: argparse.Namespace,
    found: Figures,
    deadline_s: float,
    joins: int,
    kills: int,
    live_at_end: int,
    exits: list[tuple[int, int]],
    seconds: float,
) -> dict[str, object]:
    return {
        "bench": "churn",
        "config": {
            "peers": args.peers,
            "initial": args.initial,
            "minutes": args.minutes,
            "seed": args.seed,
            "inner_steps": args.inner_steps,
            "spawn": args.spawn,
            "kill": args.kill,
            "step_s": args.step_s,
            "min_alive": args.min_alive,
        },
        "git_sha": git_sha(),
        "rounds": found.rounds,
        "first_round": found.first_round,
        "last_round": found.last_round,
        "max_stall_s": round(found.max_stall_s, 1),
        "stall_after_round": found.stall_after_round,
        "round_deadline_s": deadline_s,
        "hash_disagreements": found.hash_disagreements,
        "disagreeing_rounds": found.disagreeing_rounds,
        "split_rounds": found.split_rounds,
        "joins": joins,
        "kills": kills,
        "syncs": found.syncs,
        "foreign_syncs": found.foreign_syncs,
        "failed_rounds": found.failed_rounds,
        "lost_rounds": found.lost_rounds,
        "exits": [f"node {i}: {s}" for i, s in exits],
        "live_at_end": live_at_end,
        "seconds": round(seconds, 1),
        "target_met": found.max_stall_s <= deadline_s and found.hash_disagreements == 0,
    }


def _summary(result: dict[str, object]) -> str:
    return (
        f"{result['rounds']} rounds averaged ({result['first_round']}..{result['last_round']}) "
        f"in {result['seconds']} s; {result['joins']} joins, {result['kills']} kills, "
        f"{result['syncs']} syncs; longest stall {result['max_stall_s']} s after round "
        f"{result['stall_after_round']} (deadline {result['round_deadline_s']} s); "
        f"{result['hash_disagreements']} hash disagreements ({result['split_rounds']} rounds "
        f"with differing states); {result['failed_rounds']} failed node-rounds, "
        f"{result['lost_rounds']} lost rounds"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=8, help="most nodes alive at once")
    parser.add_argument("--initial", type=int, help="nodes started at first (default --peers)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inner-steps", type=int, default=5, help="H: inner steps a round")
    parser.add_argument("--spawn", type=float, default=0.6, help="chance a step starts a node")
    parser.add_argument("--kill", type=float, default=0.4, help="chance a step kills a node")
    parser.add_argument("--step-s", type=float, default=5.0, help="mean seconds between steps")
    parser.add_argument("--min-alive", type=int, default=2, help="never kill below this many")
    parser.add_argument("--workdir", type=Path, help="keep every node's output and state here")
    parser.add_argument("--verbose", action="store_true", help="nodes log at INFO (node*.log)")
    args = parser.parse_args(argv)
    if args.initial is None:
        args.initial = args.peers
    for name in ("peers", "initial", "inner_steps", "min_alive"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.initial > args.peers:
        parser.error("--initial must be at most --peers")
    for name in ("spawn", "kill"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name} must be in [0, 1]")
    if args.minutes <= 0 or args.step_s <= 0:
        parser.error("--minutes and --step-s must be positive")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds ``run``'s exit stack: every node SIGKILLed, the coordinator stopped.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with ExitStack() as stack:
        workdir = work_directory(stack, args.workdir, "churn-")
        progress = stack.enter_context(BenchProgress())  # closed first: before the summary
        result = run(args, workdir, progress)
    print(_summary(result), flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
