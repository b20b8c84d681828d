"""The swarmtrain commands as a user runs them: real processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from peerproc import SWARMTRAIN, PeerProcess, start_relay


def _run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SWARMTRAIN, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_id_creates_a_private_key_and_is_stable(tmp_path: Path) -> None:
    key = tmp_path / "id.key"
    first = _run("id", "--identity", str(key))
    second = _run("id", "--identity", str(key))
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.startswith("12D3KooW")
    assert key.stat().st_mode & 0o777 == 0o600


def test_world_readable_identity_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    key = tmp_path / "id.key"
    _run("id", "--identity", str(key))
    os.chmod(key, 0o644)
    result = _run("id", "--identity", str(key))
    assert result.returncode == 1
    assert "readable by others" in result.stderr and "chmod 600" in result.stderr


def test_doctor_alone_checks_against_an_in_process_relay(tmp_path: Path) -> None:
    result = _run("doctor", "--identity", str(tmp_path / "k"), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) >= {"peer_id", "listen_addrs", "observed_addrs", "reachability", "relays"}
    (ping,) = report["pings"]
    assert ping["ok"] and ping["direct"] and ping["rtt_ms"] > 0
    # A loopback helper dials anyone back: no verdict on reachability from it.
    assert report["loopback_only"] and report["reachability"] == "not checked"
    assert "give --join" in report["reachability_how"]


def test_doctor_names_the_cause_when_the_join_peer_is_down(tmp_path: Path) -> None:
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"
    result = _run("doctor", "--identity", str(tmp_path / "k"), "--join", dead, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)  # still a report: the failure and what to check
    assert report["problems"] == ["--join: no bootstrap peer could be reached"]
    assert any("/p2p/<peer id>" in hint for hint in report["hints"])
    text = _run("doctor", "--identity", str(tmp_path / "k"), "--join", dead)
    assert "result        problems found" in text.stdout and "hint" in text.stdout
    # Mistyped addresses and ids are named before anything dials, flag and part.
    for flag, value, message in [
        ("--join", "not-an-address", "--join not-an-address: not a multiaddr"),
        ("--join", dead[:-6], "is not a peer id (cut short or mistyped? copy it whole)"),
        ("--ping", "notapeer", "--ping notapeer: 'notapeer' is not a peer id"),
    ]:
        refused = _run("doctor", "--identity", str(tmp_path / "k"), flag, value)
        assert refused.returncode == 1 and message in refused.stderr, refused.stderr


def test_doctor_upnp_is_tried_and_fails_plainly_without_a_gateway(tmp_path: Path) -> None:
    result = _run(
        "doctor", "--identity", str(tmp_path / "k"), "--upnp", "--bulk-mib", "0", "--json"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["upnp"] == {"enabled": True, "external_ip": None}


OFFLINE = "12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"  # a peer id nobody runs


def test_relay_and_two_doctors_find_and_ping_each_other(tmp_path: Path) -> None:
    relay, join = start_relay(tmp_path / "r")
    lingering = None
    try:
        assert join.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3KooW" in join
        lingering = PeerProcess(
            [
                *SWARMTRAIN,
                "doctor",
                "--identity",
                str(tmp_path / "a"),
                "--join",
                join,
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--linger",
                "60",
                "--json",
            ]
        )
        first = json.loads(lingering.wait_line(timeout_s=30))
        result = _run(
            "doctor",
            "--identity",
            str(tmp_path / "b"),
            "--join",
            join,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--ping",
            first["peer_id"],
            "--ping",
            OFFLINE,
            "--json",
        )
        report = json.loads(result.stdout.strip().splitlines()[-1])
        found, bogus = report["pings"]
        assert found["peer_id"] == first["peer_id"] and found["ok"] and found["direct"]
        # The pinged peer is public (dial-back on loopback), so it runs a bulk listener and the
        # probe's bytes went over a data connection dialed to it, not over the libp2p stream.
        assert first["reachability"] == "public"
        assert found["bulk_mode"] == "dial_receiver" and found["bulk_MiBps"] > 0
        assert not bogus["ok"] and bogus["error"]
        assert report["problems"] == [f"--ping {OFFLINE}: {bogus['error']}"]
        assert result.returncode == 1  # a failed ping is a failed check
    finally:
        if lingering is not None:
            assert lingering.stop() in (0, 130)
        assert relay.stop() in (0, 130), relay.stderr[-2000:]


def test_init_writes_a_config_and_the_coordinator_names_a_bad_key(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    made = _run("init", str(config))
    assert made.returncode == 0 and f"swarmtrain coordinator --config {config}" in made.stdout
    text = config.read_text()
    assert "[training]" in text and "inner_steps = 20" in text and "# DiLoCo's H" in text
    again = _run("init", str(config))
    assert again.returncode == 1 and "exists" in again.stderr

    key = str(tmp_path / "k")
    config.write_text(text.replace("inner_steps = 20", "inner_step = 20"))
    typo = _run("coordinator", "--identity", key, "--config", str(config))
    assert typo.returncode == 1
    assert "unknown key training.inner_step" in typo.stderr and str(config) in typo.stderr
    config.write_text(text.replace("rounds = 5", "rounds = -2"))
    bad = _run("coordinator", "--identity", key, "--config", str(config))
    assert bad.returncode == 1 and "run.rounds must be a positive integer, got -2" in bad.stderr
    flag = _run("coordinator", "--identity", key, "--rounds", "0")
    assert flag.returncode == 1 and "run.rounds must be a positive integer, got 0" in flag.stderr


def test_node_refuses_a_join_peer_that_serves_no_run_spec(tmp_path: Path) -> None:
    relay, join = start_relay(tmp_path / "relay.key")
    try:
        result = _run(
            "node", "--join", join, "--listen", "/ip4/127.0.0.1/tcp/0",
            "--state-dir", str(tmp_path / "n"),
        )  # fmt: skip
        assert result.returncode == 1
        assert "no run spec from" in result.stderr and "coordinator's address" in result.stderr
    finally:
        relay.stop()


def test_node_refuses_a_device_it_does_not_have_before_joining(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    join = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLRPJAA5o6Z6i2qsqxa9KZZBEncVMHkNKSwqJDQRsvZS5"
    result = _run("node", "--join", join, "--device", "cuda", "--state-dir", str(tmp_path))
    assert result.returncode == 1, result
    assert "--device cuda: torch sees no CUDA device here" in result.stderr, result.stderr
    assert not (tmp_path / "identity.key").exists()  # refused before anything started


def test_verify_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    rate = _run("local", "--verify-rate", "1.5", "--workdir", str(tmp_path / "a"))
    assert rate.returncode == 1 and "--verify-rate must be in [0, 1], got 1.5" in rate.stderr
    piped = _run("local", "--verify-rate", "0.5", "--pipeline-stages", "2")
    assert piped.returncode == 2 and "needs a DiLoCo run" in piped.stderr
    config = tmp_path / "run.toml"
    assert _run("init", str(config)).returncode == 0
    text = config.read_text()
    assert "[verify]" in text and "rate = 0.0" in text
    key = str(tmp_path / "k")
    config.write_text(text.replace("rate = 0.0", "rate = 0.5").replace("stages = 0", "stages = 2"))
    both = _run("coordinator", "--identity", key, "--config", str(config))
    assert both.returncode == 1 and "verify.rate (0.5) needs a DiLoCo run" in both.stderr
    config.write_text(text.replace("rate = 0.0", "rate = 2"))
    bad = _run("coordinator", "--identity", key, "--config", str(config))
    assert bad.returncode == 1 and "verify.rate must be a number in [0, 1], got 2" in bad.stderr


def test_version_and_the_help_of_identities_and_listen_addresses_say_what_is_used() -> None:
    """Issue 22: no ``--version``; ``node --help`` gave ~/.local/share/... as the identity
    default while a node uses <state-dir>/identity.key; ``id --identity`` and ``status
    --listen`` had no help."""
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.startswith("swarmtrain "), version
    assert "[<state-dir>/identity.key]" in " ".join(_run("node", "--help").stdout.split())
    assert "the Ed25519 key file" in _run("id", "--help").stdout
    assert "short-lived peer listens on" in " ".join(_run("status", "--help").stdout.split())


def test_an_address_that_is_not_a_multiaddr_is_one_line_naming_the_flag_and_the_fix() -> None:
    """Issue 22: ``coordinator --listen 127.0.0.1:4001``, ``--announce 1.2.3.4:4001`` and
    ``relay --listen 127.0.0.1:0`` printed a 40-line multiaddr traceback."""
    cases = [
        (("coordinator", "--listen", "127.0.0.1:4001"), "--listen 127.0.0.1:4001: a multiaddr "
         "is written /ip4/127.0.0.1/tcp/4001, not host:port"),
        (("coordinator", "--announce", "1.2.3.4:4001"), "--announce 1.2.3.4:4001: a multiaddr "
         "is written /ip4/1.2.3.4/tcp/4001, not host:port"),
        (("relay", "--listen", "nonsense"), "--listen nonsense: not a multiaddr"),
    ]  # fmt: skip
    for args, message in cases:
        done = _run(*args)
        assert done.returncode == 1, done
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"swarmtrain {args[0]}: {message}"), line
