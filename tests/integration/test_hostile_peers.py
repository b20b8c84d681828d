"""Peers that lie with well-formed, signed messages (issue 19), as real processes on loopback.

A liar's one progress record claiming a round far ahead of the swarm, with a state of its own
making that it serves, used to make every joiner (and every member about to run a round the
liar claimed to be past) adopt that state. Waits are keyed on printed lines and bounded."""

from __future__ import annotations

import sys
from pathlib import Path

from peerproc import ROOT, PeerProcess
from runproc import node, start_coordinator

ROUNDS = 40


def test_a_forged_far_ahead_progress_record_lures_neither_a_joiner_nor_the_members(
    tmp_path: Path,
) -> None:
    coordinator, join = start_coordinator(
        tmp_path, ROUNDS, inner_steps=5, settings={"min_peers": "2"}
    )
    nodes = [node(join, tmp_path / f"n{i}") for i in range(2)]
    started: list[PeerProcess] = [*nodes]
    try:
        nodes[0].wait_line(lambda s: s.startswith("round 1 "), timeout_s=90)
        forger = PeerProcess(
            [
                sys.executable,
                str(ROOT / "tests" / "integration" / "progress_forger.py"),
                "--join",
                join,
                "--identity",
                str(tmp_path / "liar.key"),
            ]
        )
        started.append(forger)
        forged = forger.wait_line(lambda s: s.startswith("FORGED "), timeout_s=60)
        forged_round, forged_hash = int(forged.split()[1]), forged.split()[2]
        assert forged_round > 10

        joiner = node(join, tmp_path / "joiner")
        started.append(joiner)
        synced = joiner.wait_line(lambda s: s.startswith("synced to round "), timeout_s=60)
        first = int(synced.split()[3])
        assert first < forged_round and "from 2 peers" in synced, synced
        line = joiner.wait_line(lambda s: s.startswith(f"round {first} "), timeout_s=60)
        assert "peers 3" in line and "agree yes (3/3)" in line, (line, joiner.stderr[-3000:])
        # The members went on with their own state all along: none adopted the forged one.
        for peer in nodes:
            peer.wait_line(lambda s: s.startswith(f"round {first} "), timeout_s=30)
            assert not any(forged_hash[:12] in ln or "synced" in ln for ln in peer.lines), (
                peer.lines
            )
        assert not any(forged_hash[:12] in ln for ln in joiner.lines), joiner.lines
    finally:
        for peer in started:
            peer.stop()
        coordinator.stop()


def test_a_flood_of_1100_throwaway_identities_in_the_round_keys_does_not_stop_the_rounds(
    tmp_path: Path,
) -> None:
    """Issue 19 point 3: a key holds 1,024 entries; 1,100 fresh identities writing the next
    rounds' matchmaking keys made every honest declaration there fail to store. The replicas
    now leave out the identities they met last, so the members' rounds go on."""
    coordinator, join = start_coordinator(
        tmp_path, 30, inner_steps=5, settings={"min_peers": "2", "id": '"flooded"'}
    )
    nodes = [node(join, tmp_path / f"n{i}") for i in range(2)]
    started: list[PeerProcess] = [*nodes]
    try:
        nodes[0].wait_line(lambda s: s.startswith("round 1 "), timeout_s=90)
        flooder = PeerProcess(
            [
                sys.executable,
                str(ROOT / "tests" / "integration" / "round_flooder.py"),
                "--join",
                join,
                "--run-id",
                "flooded",
            ]
        )
        started.append(flooder)
        flooded = flooder.wait_line(lambda s: s.startswith("FLOODED "), timeout_s=90)
        first, last = int(flooded.split()[1]), int(flooded.split()[2])
        assert not flooded.split(" ", 3)[3].startswith("[0,"), flooded  # the key was filled
        for peer in nodes:
            for r in range(first, last + 1):
                line = peer.wait_line(lambda s, r=r: s.startswith(f"round {r} "), timeout_s=60)
                assert "peers 2" in line and "agree yes (2/2)" in line, (line, peer.lines)
    finally:
        for peer in started:
            peer.stop()
        coordinator.stop()
