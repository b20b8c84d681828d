"""Helpers for tests that run a coordinator and volunteers as real processes on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from peerproc import SWARMTRAIN, PeerProcess
from prometheus_client.parser import text_string_to_metric_families

from swarmtrain.config import default_toml

ROUND_LINE = re.compile(r"^round (\d+) ")
JOIN_COMMAND = "swarmtrain node --join "
METRICS_URL = re.compile(r"serving Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics)")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_url(peer: PeerProcess, timeout_s: float = 30) -> str:
    """The URL a process started with ``--metrics-port 0`` logged."""
    text = peer.wait_stderr("serving Prometheus metrics at", timeout_s=timeout_s)
    found = METRICS_URL.search(text)
    assert found, text[-2000:]
    return found.group(1)


def scrape(url: str) -> Samples:
    """Every sample a metrics URL serves, parsed with ``prometheus_client``'s own parser, by
    (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def run_toml(
    settings: Mapping[str, object] | None = None, edits: tuple[tuple[str, str], ...] = ()
) -> str:
    """What ``swarmtrain init`` writes (test_cli runs the command), without its process (a Python
    start and the CLI's imports cost 1-3 s before every test's coordinator), edited: each of
    ``settings``' keys, which must occur once in the file, set to its TOML value; ``edits``: (a
    line of the file, exactly once there, its replacement), for a key several sections have."""
    text = default_toml()
    for key, value in (settings or {}).items():
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert count == 1, key
    for line, replacement in edits:
        text, count = re.subn(rf"(?m)^{re.escape(line)}$", replacement, text)
        assert count == 1, line
    return text


def start_coordinator(
    tmp_path: Path,
    rounds: int,
    inner_steps: int,
    matchmaking_timeout_s: float = 4.0,
    settings: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    edits: tuple[tuple[str, str], ...] = (),
) -> tuple[PeerProcess, str]:
    """``swarmtrain init``'s run.toml + ``swarmtrain coordinator`` on loopback; returns it and
    its join address, taken from the exact command it prints. ``settings``: more run.toml keys
    (each key name must occur once in the file) and their TOML values; ``edits``: (a line of
    the file, exactly once there, its replacement), for a key several sections have;
    ``extra``: more coordinator flags."""
    config = tmp_path / "run.toml"
    base = {"rounds": rounds, "inner_steps": inner_steps,
            "matchmaking_timeout_s": matchmaking_timeout_s}  # fmt: skip
    text = run_toml({**base, **(settings or {})}, edits)
    config.write_text(text)
    coordinator = PeerProcess(
        [
            *SWARMTRAIN,
            "coordinator",
            "--config",
            str(config),
            "--identity",
            str(tmp_path / "coordinator.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            *extra,
        ]
    )
    try:
        # 60 s: a verified transformers run traces one step of its model before it signs.
        line = coordinator.wait_line(lambda s: s.startswith(JOIN_COMMAND), timeout_s=60)
    except BaseException:
        coordinator.stop()
        raise
    assert f"{rounds} rounds, H={inner_steps}" in coordinator.lines[0], coordinator.lines
    return coordinator, line[len(JOIN_COMMAND) :].strip()


def node(join: str, state_dir: Path, *extra: str, env: dict[str, str] | None = None) -> PeerProcess:
    return PeerProcess(
        [
            *SWARMTRAIN,
            "node",
            "--join",
            join,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--state-dir",
            str(state_dir),
            "--threads",
            "1",
            "--json",
            str(state_dir / "summary.json"),
            *extra,
        ],
        env=env,
    )


def status_json(join: str, *extra: str) -> dict:
    """``swarmtrain status --json`` of the run behind ``join``, as a dict."""
    status = subprocess.run(
        [
            *SWARMTRAIN,
            "status",
            "--join",
            join,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stderr[-2000:]
    return json.loads(status.stdout.strip().splitlines()[-1])


def round_lines(peer: PeerProcess) -> dict[int, str]:
    return {int(m.group(1)): line for line in peer.lines if (m := ROUND_LINE.match(line))}


def wait_exit(peer: PeerProcess, timeout_s: float) -> int:
    try:
        return peer.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running after {timeout_s} s; stdout={peer.lines[-6:]}; "
            f"stderr tail={peer.stderr[-3000:]}"
        ) from None
