"""A verified DiLoCo run with a cheater, as real processes: caught, left out, banned; the honest
peers train on.

Three volunteers and a coordinator on loopback, ``verify.rate = 1`` (every task from round 1 on is
re-executed by a second peer) and a small model of the default architecture so RepOps rounds
take a second. Node 2 tampers with one operator's output (one bit) at one inner step of its task
in round 1, consistently, as a cheater who committed would. Its verifier's commitment differs,
the coordinator plays the dispute game and names it; the honest peers leave its contribution out
of round 1 and it stops banned; ``swarmtrain status`` shows the verdict.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from peerproc import SWARMTRAIN
from runproc import node, round_lines, start_coordinator, wait_exit

SMALL_VERIFIED = {
    "d_model": "32",
    "n_layers": "1",
    "n_heads": "2",
    "context": "32",
    "sequence_length": "32",
    "rate": "1.0",
    "timeout_s": "30.0",
}
CHEAT_ROUND, CHEAT_STEP, CHEAT_OP = 1, 2, 10  # record 10 of a step is a linear layer's output


def test_a_cheating_peer_is_caught_excluded_and_banned_while_the_others_train_on(
    tmp_path: Path,
) -> None:
    rounds = 4
    coordinator, join = start_coordinator(
        tmp_path, rounds=rounds, inner_steps=4, matchmaking_timeout_s=6.0, settings=SMALL_VERIFIED
    )
    honest = [node(join, tmp_path / f"n{i}") for i in range(2)]
    cheat = f"{CHEAT_ROUND}:{CHEAT_STEP}:{CHEAT_OP}"
    cheater = node(join, tmp_path / "cheater", "--cheat", cheat)
    peers = [*honest, cheater]
    try:
        assert wait_exit(cheater, 90) == 3, cheater.stderr[-3000:]
        for peer in honest:
            assert wait_exit(peer, 60) == 0, peer.stderr[-3000:]
        cheater_id = json.loads((tmp_path / "cheater" / "summary.json").read_text())["peer_id"]
        summaries = [json.loads((tmp_path / f"n{i}" / "summary.json").read_text()) for i in (0, 1)]

        # The cheater: named at the round and operator it tampered with, and stopped.
        banned = next(line for line in cheater.lines if line.startswith("this peer was banned"))
        assert f"round {CHEAT_ROUND}, step {CHEAT_STEP}, operator {CHEAT_OP}" in banned, banned
        assert sorted(round_lines(cheater)) == [0], cheater.lines

        # The honest peers: round 0 with all three, from round 1 on the two of them, every round
        # applied with agreeing state hashes, and the verdict shown.
        for peer, summary in zip(honest, summaries, strict=True):
            lines = round_lines(peer)
            assert sorted(lines) == list(range(rounds)), peer.lines
            assert "peers 3" in lines[0], lines[0]
            for r in range(1, rounds):
                assert "peers 2" in lines[r] and "agree yes (2/2)" in lines[r], lines[r]
            # Round 1: the cheater's task left out, the other two agreed with their verifiers
            # (the cheater re-executed one of them honestly); then each verifies the other.
            assert lines[1].endswith(" verified 2/3 excluded 1"), lines[1]
            assert lines[2].endswith(" verified 2/2"), lines[2]
            assert summary["rounds_contributed"] == rounds and summary["banned"] == ""
            assert any(
                line.startswith("verdict: peer " + cheater_id[-8:]) for line in peer.lines
            ), peer.lines
            # After the ban the two honest peers verify each other, and agree.
            assert "round 2: 2 of 2 verified tasks agree" in peer.stderr, peer.stderr[-3000:]
        assert summaries[0]["state_hash"] == summaries[1]["state_hash"]
        assert summaries[0]["loss_last"] < summaries[0]["loss_first"]

        # The coordinator refereed once and named the cheater.
        ruled = [line for line in coordinator.lines if "verdict on the task of" in line]
        assert len(ruled) == 1 and f"cheater {cheater_id[-8:]}" in ruled[0], coordinator.lines

        status = subprocess.run(
            [*SWARMTRAIN, "status", "--join", join, "--listen", "/ip4/127.0.0.1/tcp/0", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr[-2000:]
        report = json.loads(status.stdout.strip().splitlines()[-1])
        assert report["banned"] == [cheater_id], report
        (verdict,) = report["verdicts"]
        assert verdict["cheater"] == cheater_id and verdict["round"] == CHEAT_ROUND
        assert (verdict["step"], verdict["op"]) == (CHEAT_STEP, CHEAT_OP), verdict
    finally:
        for peer in peers:
            peer.stop()
        coordinator.stop()
