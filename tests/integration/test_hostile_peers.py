"""Peers that lie with well-formed, signed messages (issue 19), as real processes on loopback.

A liar's one progress record claiming a round far ahead of the swarm, with a state of its own
making that it serves, used to make every joiner (and every member about to run a round the
liar claimed to be past) adopt that state. Waits are keyed on printed lines and bounded."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from peerproc import ROOT, PeerProcess
from runproc import node, start_coordinator

ROUNDS = 40


@contextmanager
def _two_members_and(
    tmp_path: Path, rounds: int, settings: dict[str, str], script: str, *args: str
) -> Iterator[tuple[str, list[PeerProcess], list[PeerProcess]]]:
    """A coordinator and two members training (round 1 seen), then ``script`` (a liar in
    tests/integration) started with ``--join`` and ``args``: (join, members, started), where
    the test appends what it starts itself; everything is stopped at the end."""
    coordinator, join = start_coordinator(tmp_path, rounds, inner_steps=5, settings=settings)
    members = [node(join, tmp_path / f"n{i}") for i in range(2)]
    started: list[PeerProcess] = [*members]
    try:
        members[0].wait_line(lambda s: s.startswith("round 1 "), timeout_s=90)
        liar = str(ROOT / "tests" / "integration" / script)
        started.append(PeerProcess([sys.executable, liar, "--join", join, *args]))
        yield join, members, started
    finally:
        for peer in started:
            peer.stop()
        coordinator.stop()


def test_a_forged_far_ahead_progress_record_lures_neither_a_joiner_nor_the_members(
    tmp_path: Path,
) -> None:
    liar = ("--identity", str(tmp_path / "liar.key"))
    settings = {"min_peers": "2"}
    with _two_members_and(tmp_path, ROUNDS, settings, "progress_forger.py", *liar) as (
        join, nodes, started,
    ):  # fmt: skip
        forged = started[-1].wait_line(lambda s: s.startswith("FORGED "), timeout_s=60)
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


def test_a_flood_of_1100_throwaway_identities_in_the_round_keys_does_not_stop_the_rounds(
    tmp_path: Path,
) -> None:
    """Issue 19 point 3: a key holds 1,024 entries; 1,100 fresh identities writing the next
    rounds' matchmaking keys made every honest declaration there fail to store. The replicas
    now leave out the identities they met last, so the members' rounds go on."""
    settings = {"min_peers": "2", "id": '"flooded"'}
    with _two_members_and(tmp_path, 30, settings, "round_flooder.py", "--run-id", "flooded") as (
        _, nodes, started,
    ):  # fmt: skip
        flooded = started[-1].wait_line(lambda s: s.startswith("FLOODED "), timeout_s=90)
        first, last = int(flooded.split()[1]), int(flooded.split()[2])
        assert not flooded.split(" ", 3)[3].startswith("[0,"), flooded  # the key was filled
        for peer in nodes:
            for r in range(first, last + 1):
                line = peer.wait_line(lambda s, r=r: s.startswith(f"round {r} "), timeout_s=60)
                assert "peers 2" in line and "agree yes (2/2)" in line, (line, peer.lines)
