"""Elastic membership with real processes: a coordinator, volunteers that come and go.

One running swarm carries several checks, so the whole file stays around a minute on 2 cores:
a node that joins mid-run downloads the agreed state from the others and its hash equals theirs
from its first round; ``swarmtrain status`` shows the run; a node SIGKILLed mid-round does not
stop the run. Waits are keyed on printed lines and bounded; nothing sleeps to synchronize.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from peerproc import ROOT, SWARMTRAIN, PeerProcess
from runproc import ROUND_LINE, node, round_lines, start_coordinator, wait_exit


def test_joiner_syncs_and_agrees_from_its_first_round_and_a_kill_does_not_stop_the_run(
    tmp_path: Path,
) -> None:
    rounds = 9
    # A 6 s matchmaking deadline (4 s by default): on a loaded 2-core box the joiner's first
    # inner phase (torch warm-up, started about a second after the others') may end later.
    coordinator, join = start_coordinator(
        tmp_path, rounds=rounds, inner_steps=10, matchmaking_timeout_s=6.0
    )
    nodes = [node(join, tmp_path / f"n{i}") for i in range(3)]
    joiner: PeerProcess | None = None
    try:
        # Started once the swarm trains; its torch start-up takes seconds, so it joins mid-run.
        nodes[0].wait_line(lambda s: s.startswith("round 0 "), timeout_s=90)
        joiner = node(join, tmp_path / "joiner")
        synced = joiner.wait_line(lambda s: s.startswith("synced to round "), timeout_s=60)
        first = int(synced.split()[3])
        assert 1 <= first <= rounds - 3 and "from 3 peers" in synced, synced
        found = re.search(r"\(pieces ([\d/]+)\)", synced)
        assert found is not None, synced
        pieces = [int(n) for n in found.group(1).split("/")]
        assert len(pieces) >= 2, synced  # the ranges were split across several sources

        # Its very first round: all four peers averaged and its hash is the majority's.
        line = joiner.wait_line(lambda s: s.startswith(f"round {first} "), timeout_s=60)
        assert "peers 4" in line and "agree yes (4/4)" in line, (line, joiner.stderr[-3000:])

        status = subprocess.run(
            [*SWARMTRAIN, "status", "--join", join, "--listen", "/ip4/127.0.0.1/tcp/0", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr[-2000:]
        report = json.loads(status.stdout.strip().splitlines()[-1])
        assert report["rounds"] == rounds and report["peers"] == 4, report
        assert report["round"] >= first and report["loss"] > 0 and report["tokens_per_s"] > 0
        assert report["state_holders"] >= 3, report

        # SIGKILL an original node in the next inner phase: the other three finish the run.
        victim = nodes[2]
        victim.wait_line(lambda s: s.startswith(f"round {first} "), timeout_s=30)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(5)
        survivors = [nodes[0], nodes[1], joiner]
        for peer in survivors:
            assert wait_exit(peer, 80) == 0, peer.stderr[-3000:]
        summaries = [
            json.loads((tmp_path / name / "summary.json").read_text())
            for name in ("n0", "n1", "joiner")
        ]
        printed = {name: p.lines for name, p in zip(("n0", "n1", "joiner"), survivors, strict=True)}
        assert len({s["state_hash"] for s in summaries}) == 1, (summaries, printed)
        assert all(s["last_round"] == rounds - 1 for s in summaries), summaries
        assert summaries[2]["first_round"] == first and summaries[2]["syncs"] == 1
        # The joiner contributed from its first round on, each round agreeing with the others.
        joined = round_lines(joiner)
        assert sorted(joined) == list(range(first, rounds)), joiner.lines
        assert all("agree yes" in line for line in joined.values()), joined
        # After the kill the three survivors averaged together (the victim's slot was not waited
        # for past the matchmaking deadline), agreeing bit for bit.
        after = [line for r, line in round_lines(nodes[0]).items() if r > first]
        assert any("peers 3" in ln and "agree yes (3/3)" in ln for ln in after), after
    finally:
        for peer in [*nodes, joiner]:
            if peer is not None:
                peer.stop()
        coordinator.stop()


def test_tampered_run_spec_is_refused(tmp_path: Path) -> None:
    # One mode here (each node start imports torch: seconds on a loaded box); the unsigned and
    # foreign-signer cases are in tests/unit/test_runspec.py, same code path after the fetch.
    for mode, words in (("tampered", "tampered with"),):
        forger = PeerProcess(
            [
                sys.executable,
                str(ROOT / "tests" / "integration" / "spec_forger.py"),
                "--identity",
                str(tmp_path / f"{mode}.key"),
                "--mode",
                mode,
            ]
        )
        try:
            join = forger.wait_line(timeout_s=30)
            victim = node(join, tmp_path / mode)
            assert wait_exit(victim, 60) == 1
            assert "run spec refused" in victim.stderr and words in victim.stderr, victim.stderr
            assert "Traceback" not in victim.stderr
            assert not any(ROUND_LINE.match(line) for line in victim.lines)  # nothing trained
        finally:
            forger.stop()
