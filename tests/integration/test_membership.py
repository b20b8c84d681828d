"""Membership with real processes: a late or starved volunteer re-joins the others.

``swarmtrain local`` as a user runs it, with one node started 10 s after the others (a slow
torch import, a late volunteer), and again with the machine's cores kept busy by CPU hogs in
background processes: every node must end on the same state hash (issue 16, points 2 and 5);
two live peers at different rounds, each failing alone, meet again on one round and state; and a
quick starter waits for the peers still warming up (their start announcements) instead of
running ahead of them alone.
Bounded by ``subprocess.run``'s timeout; nothing sleeps to synchronize.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from peerproc import SWARMTRAIN, PeerProcess
from runproc import ROUND_LINE, node, start_coordinator, wait_exit


def _local(
    tmp_path: Path, *extra: str, timeout_s: float, rounds: int = 5, inner_steps: int = 20
) -> dict[str, object]:
    summary_path = tmp_path / "local.json"
    result = subprocess.run(
        [*SWARMTRAIN, "local", "--peers", "3", "--rounds", str(rounds),
         "--inner-steps", str(inner_steps), "--json", str(summary_path),
         "--workdir", str(tmp_path / "work"), *extra],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    (tmp_path / "stdout.txt").write_text(result.stdout)  # kept for a failure's post-mortem
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    hashes = [n["state_hash"] for n in summary["nodes"]]
    if summary["state_hashes_agree"] is not True:
        # pytest shows a failed test's captured output in full (its assert repr truncates)
        print(result.stdout)
        for log in sorted((tmp_path / "work").glob("*.log")):
            print(f"== {log.name}", log.read_text(errors="replace")[-15000:], sep="\n")
    assert summary["state_hashes_agree"] is True, hashes
    return summary


def test_local_with_one_node_started_10_s_late_ends_with_equal_hashes(tmp_path: Path) -> None:
    # Rounds enough that the late node (10 s, then its own start-up) comes before the others'
    # end even on a quick machine: 5 rounds were over before it in CI, a case the next test
    # covers apart (nothing is left to train then).
    rounds = 10
    summary = _local(tmp_path, "--delay-node", "2:10", timeout_s=115, rounds=rounds)
    late = summary["nodes"][2]
    # It joined mid-run, synced to the others' state and trained to the end with them.
    assert late["syncs"] and 0 < late["first_round"] < rounds, late
    assert late["last_round"] == rounds - 1 and late["rounds_contributed"] > 0, late


def test_a_node_that_joins_after_the_run_ended_stops_instead_of_training_alone(
    tmp_path: Path,
) -> None:
    # The run's holders have left: its final state cannot be fetched, and training alone would
    # end on a state nobody shares (before: 5 lone "FAILED ... catching up" rounds).
    coordinator, join = start_coordinator(tmp_path, rounds=2, inner_steps=5)
    try:
        early = [node(join, tmp_path / f"n{i}") for i in range(2)]
        for peer in early:
            assert wait_exit(peer, 90) == 0, peer.stderr[-3000:]
        late = node(join, tmp_path / "late")
        assert wait_exit(late, 60) == 0, late.stderr[-3000:]
        summary = json.loads((tmp_path / "late" / "summary.json").read_text())
        assert "is over (its last round, 1, was averaged)" in summary["run_over"], summary
        assert summary["rounds_contributed"] == 0 and summary["last_round"] == -1, summary
        assert any("nothing is left to train; stopping" in line for line in late.lines)
    finally:
        coordinator.stop()


def test_local_with_the_cores_kept_busy_ends_with_equal_hashes(tmp_path: Path) -> None:
    hog = "import time\nend = time.monotonic() + 110\nwhile time.monotonic() < end: pass\n"
    hogs = [
        subprocess.Popen([sys.executable, "-c", hog], stdin=subprocess.DEVNULL)
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        # Fewer rounds than the README's defaults: the hogs slow every step several-fold.
        _local(tmp_path, timeout_s=110, rounds=3, inner_steps=10)
    finally:
        for proc in hogs:
            proc.kill()
            proc.wait(5)


def test_a_quick_starter_waits_for_peers_still_warming_up_and_joins_their_round(
    tmp_path: Path,
) -> None:
    # CI's starved run, made deterministic: b and c announce their start, then stall 20 s (a
    # slow warm-up), so a's round 0 fails alone before anyone else declares. Before, a found no
    # record, ran on alone and failed every round to the end; now it waits for the peers that
    # started, adopts their round 0 and averages every later round with them.
    rounds = 5
    # Rounds of a few seconds, as real ones are longer than a state download: with 0.4 s rounds
    # the others were two rounds on before the quick starter had fetched their round 0.
    coordinator, join = start_coordinator(tmp_path, rounds=rounds, inner_steps=30)
    slow = [node(join, tmp_path / n, "--slow-start", "20") for n in ("b", "c")]
    try:
        for peer in slow:
            peer.wait_line(lambda s: s.startswith("node "), timeout_s=60)
        quick = node(join, tmp_path / "a")
        nodes = [quick, *slow]
        for peer in nodes:
            assert wait_exit(peer, 100) == 0, peer.stderr[-3000:]
        summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in "abc"]
        for name, peer in zip("abc", nodes, strict=True):
            print(f"== {name}", *peer.lines, peer.stderr[-6000:], sep="\n")  # shown on failure
        alone = [s for s in quick.lines if "no other peer declared in time" in s]
        assert [s.split()[1] for s in alone] == ["0"], quick.lines  # only the round in flight
        a = summaries[0]
        assert a["syncs"] >= 1 and a["rounds_contributed"] >= rounds - 2, a
        assert len({s["state_hash"] for s in summaries}) == 1, summaries
    finally:
        for peer in slow:
            peer.stop()
        coordinator.stop()


def test_two_live_peers_started_at_different_rounds_converge(tmp_path: Path) -> None:
    # A trains alone first (every round fails: nobody else declares) and is rounds ahead when
    # B starts fresh at round 0; A's records are all failed, so B has nothing to sync to. Before
    # issue 16 each ran on alone for good (their rounds never line up). Now A waits for B, the
    # live peer behind it, they open a round together, and the tie on their state hashes is
    # broken the same way on both: the one off the majority adopts the other's state.
    coordinator, join = start_coordinator(tmp_path, rounds=50, inner_steps=5)
    a = node(join, tmp_path / "a")
    b: PeerProcess | None = None
    try:
        a.wait_line(lambda s: s.startswith("round 0 "), timeout_s=90)
        b = node(join, tmp_path / "b")

        def met(s: str) -> bool:
            return ROUND_LINE.match(s) is not None and "agree yes (2/2)" in s

        line = b.wait_line(met, timeout_s=100)
        r = int(line.split()[1])
        theirs = a.wait_line(lambda s: s.startswith(f"round {r} "), timeout_s=30)
        assert "agree yes (2/2)" in theirs, (theirs, a.lines[-6:])
        assert line.split(" state ")[1][:12] == theirs.split(" state ")[1][:12], (line, theirs)
    finally:
        for peer in (a, b):
            if peer is not None:
                peer.stop()
        coordinator.stop()
