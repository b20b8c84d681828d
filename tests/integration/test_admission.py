"""Permissioned runs (issue 19 point 3) as a user runs them: real processes on loopback.

An allow-listed run trains among its members while a stranger that ignores its own refusal is
ignored by them (never in a group, its state requests refused), and a stranger that obeys exits
with one line; a token run takes a node with a valid token and refuses an expired one, and, as
its spec asks proof of work of identities, one whose identity has too little."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from peerproc import SWARMTRAIN
from runproc import node, round_lines, start_coordinator, wait_exit

from p2p import PeerID, identity_work, load_or_create_identity, peer_id_of


def _identity(state_dir: Path) -> str:
    state_dir.mkdir(parents=True)
    return str(peer_id_of(load_or_create_identity(state_dir / "identity.key")))


def test_an_allow_listed_run_trains_among_its_members_and_ignores_a_stranger(
    tmp_path: Path,
) -> None:
    members = [tmp_path / "m0", tmp_path / "m1"]
    ids = [_identity(d) for d in members]
    allow = "[" + ", ".join(f'"{i}"' for i in ids) + "]"
    coordinator, join = start_coordinator(
        tmp_path, 3, 5, settings={"admission": '"allowlist"', "allow": allow, "min_peers": "2"}
    )
    started = []
    try:
        # One that obeys its refusal, one that does not (the members must ignore it).
        polite = node(join, tmp_path / "polite")
        started.append(polite)
        assert wait_exit(polite, 60) == 1
        assert "is not one of them" in polite.stderr, polite.stderr[-2000:]
        # What a node does while it starts is said as it happens, not after seconds of silence.
        for step in ("starting: loading torch", "joining via ", "fetching the run spec"):
            assert step in polite.stderr, polite.stderr[-2000:]
        stranger = node(join, tmp_path / "stranger", "--ignore-admission")
        started.append(stranger)
        stranger.wait_line(lambda s: "starting at round" in s, timeout_s=60)
        peers = [node(join, d) for d in members]
        started.extend(peers)
        for peer in peers:
            assert wait_exit(peer, 100) == 0, peer.stderr[-3000:]
            lines = round_lines(peer)
            assert sorted(lines) == [0, 1, 2], peer.lines
            assert all("peers 2" in ln and "agree yes (2/2)" in ln for ln in lines.values()), lines
        assert not any("peers 3" in ln or "peers 2" in ln for ln in stranger.lines), stranger.lines
    finally:
        for peer in started:
            peer.stop()
        coordinator.stop()


def _token(tmp_path: Path, peer_id: str, expires: str) -> str:
    made = subprocess.run(
        [
            *SWARMTRAIN,
            "coordinator",
            "token",
            "--config",
            str(tmp_path / "run.toml"),
            "--identity",
            str(tmp_path / "coordinator.key"),
            "--peer",
            peer_id,
            "--expires",
            expires,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def _worked_identity(state_dir: Path, bits: int) -> str:
    """``swarmtrain id --work`` as a volunteer runs it before joining."""
    made = subprocess.run(
        [*SWARMTRAIN, "id", "--identity", str(state_dir / "identity.key"), "--work", str(bits)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    peer = made.stdout.strip()
    assert identity_work(PeerID.from_base58(peer).to_bytes()) >= bits
    return peer


def _lazy_identity(state_dir: Path, bits: int) -> str:
    """An identity with less work than ``bits`` (one in 2**bits would have it by chance)."""
    while identity_work(PeerID.from_base58(peer := _identity(state_dir)).to_bytes()) >= bits:
        (state_dir / "identity.key").unlink()
        state_dir.rmdir()
    return peer


def test_a_token_run_takes_a_valid_token_and_refuses_an_expired_one_or_a_lazy_identity(
    tmp_path: Path,
) -> None:
    coordinator, join = start_coordinator(
        tmp_path,
        2,
        5,
        settings={"admission": '"token"', "id": '"token-run"', "identity_work_bits": "6"},
    )
    started = []
    try:
        member_dir, late_dir, lazy_dir = tmp_path / "member", tmp_path / "late", tmp_path / "lazy"
        valid = _token(tmp_path, _worked_identity(member_dir, 6), "10m")
        expired = _token(tmp_path, _worked_identity(late_dir, 6), "1s")
        lazy_token = _token(tmp_path, _lazy_identity(lazy_dir, 6), "10m")
        time.sleep(1.5)
        late = node(join, late_dir, "--token", expired)
        lazy = node(join, lazy_dir, "--token", lazy_token)
        started += [late, lazy]
        member = node(join, member_dir, "--token", valid)
        started.append(member)
        assert wait_exit(late, 60) == 1
        assert "--token: the token expired at" in late.stderr, late.stderr[-2000:]
        assert wait_exit(lazy, 60) == 1
        assert "6 bits of proof of work (run.identity_work_bits)" in lazy.stderr, lazy.stderr
        assert wait_exit(member, 100) == 0, member.stderr[-3000:]
        assert any("admits token members only" in ln for ln in member.lines), member.lines
        assert sorted(round_lines(member)) == [0, 1], member.lines
    finally:
        for peer in started:
            peer.stop()
        coordinator.stop()
