"""The swarmtrain commands as a user runs them: real processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from peerproc import SWARMTRAIN, PeerProcess, start_relay
from runproc import JOIN_COMMAND, start_coordinator


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
    assert result.stderr == (
        f"swarmtrain id: --identity: identity {key} is readable by others (mode 0644); run "
        f"`chmod 600 {key}` if it was not leaked, or delete it to get a new identity\n"
    )


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
    # Issue 22: the text said "reachability public … all checks passed" from this self-test.
    text = _run("doctor", "--identity", str(tmp_path / "k"), "--bulk-mib", "0")
    assert text.returncode == 0, text.stderr[-3000:]
    lines = text.stdout.splitlines()
    assert lines[-1] == (
        "result        loopback self-test passed (reachability from the internet not checked)"
    )
    assert (
        "reachability  not checked (no --join: only a relay in this process on loopback was "
        "asked, which reaches anyone; give --join <a relay or coordinator address> to learn "
        "whether peers on the internet can reach us)"
    ) in lines


def test_doctor_names_the_cause_when_the_join_peer_is_down(tmp_path: Path) -> None:
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"
    result = _run("doctor", "--identity", str(tmp_path / "k"), "--join", dead, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)  # still a report: the failure and what to check
    assert report["problems"] == ["--join: no bootstrap peer could be reached"]
    assert any("/p2p/<peer id>" in hint for hint in report["hints"])
    text = _run("doctor", "--identity", str(tmp_path / "k"), "--join", dead)
    lines = text.stdout.splitlines()
    assert text.returncode == 1 and lines[-1] == "result        problems found", text.stdout
    assert "problem       --join: no bootstrap peer could be reached" in lines
    assert any(line.startswith("hint          ") for line in lines), lines
    # Mistyped addresses and ids are refused before anything dials: test_cli_messages.py.


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


def test_init_writes_a_commented_config_and_refuses_to_overwrite_it(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    made = _run("init", str(config))
    assert made.returncode == 0 and f"swarmtrain coordinator --config {config}" in made.stdout
    text = config.read_text()
    assert "[training]" in text and "inner_steps = 20" in text and "# DiLoCo's H" in text
    again = _run("init", str(config))
    assert again.returncode == 1
    assert again.stderr == f"swarmtrain init: {config} exists (--force overwrites it)\n"
    # A bad key or value in it: tests/unit/test_cli_messages.py, in process.


def test_node_refuses_a_join_peer_that_serves_no_run_spec(tmp_path: Path) -> None:
    relay, join = start_relay(tmp_path / "relay.key")
    try:
        result = _run(
            "node", "--join", join, "--listen", "/ip4/127.0.0.1/tcp/0",
            "--state-dir", str(tmp_path / "n"),
        )  # fmt: skip
        assert result.returncode == 1
        last = result.stderr.strip().splitlines()[-1]
        # ...then the reason py-libp2p gives for the refused protocol, its own words.
        assert last.startswith(
            f"swarmtrain node: no run spec from {join.rsplit('/', 1)[1]} (is --join a "
            "coordinator's address?): "
        ), last
    finally:
        relay.stop()


def test_node_refuses_a_device_it_does_not_have_before_joining(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    join = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLRPJAA5o6Z6i2qsqxa9KZZBEncVMHkNKSwqJDQRsvZS5"
    result = _run("node", "--join", join, "--device", "cuda", "--state-dir", str(tmp_path))
    assert result.returncode == 1, result
    assert result.stderr.strip().splitlines()[-1] == (
        "swarmtrain node: --device cuda: torch sees no CUDA device here (use cpu or auto)"
    ), result.stderr
    assert not (tmp_path / "identity.key").exists()  # refused before anything started


def test_a_coordinator_restarted_on_a_config_without_a_run_id_warns_that_it_is_a_new_run(
    tmp_path: Path,
) -> None:
    """Issue 22: a coordinator restarted on ``init``'s config (``[run] id = ""``) quietly
    became a new run, which the nodes' checkpoints were not of."""
    first, _ = start_coordinator(tmp_path, rounds=2, inner_steps=2)
    assert first.stop() == 130, first.stderr[-3000:]
    assert "warning" not in first.stderr, first.stderr[-3000:]
    before = first.lines[0].split()[1].rstrip(":")  # "run run-…: 2 rounds, …"
    again = PeerProcess(first.argv)  # the same run.toml and identity
    try:
        again.wait_line(lambda line: line.startswith(JOIN_COMMAND), timeout_s=60)
        stderr = again.wait_stderr("warning: ", timeout_s=10)
    finally:
        assert again.stop() == 130, again.stderr[-3000:]
    now = again.lines[0].split()[1].rstrip(":")
    config = tmp_path / "run.toml"
    assert now != before and now.startswith("run-"), (before, now)
    assert [line for line in stderr.splitlines() if "warning" in line] == [
        f"warning: {config} sets no [run] id, so this start is a new run, {now}; the last start "
        f"on it was {before}, whose nodes will not join this one. To continue that run, set "
        f'id = "{before}" under [run] in {config} and restart'
    ]
