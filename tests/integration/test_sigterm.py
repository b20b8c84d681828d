"""SIGTERM (systemd, ``docker stop``) stops a node, a coordinator and a relay as Ctrl+C does:
the same cleanup (a node keeps its round boundary's checkpoint), the same line, no traceback,
and exit status 143 (128 + 15) where Ctrl+C gives 130."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from peerproc import SWARMTRAIN, PeerProcess
from runproc import node, start_coordinator, wait_exit


def test_sigterm_stops_a_node_and_its_coordinator_as_ctrl_c_does(tmp_path: Path) -> None:
    coordinator, join = start_coordinator(tmp_path, rounds=50, inner_steps=5)
    state = tmp_path / "n"
    volunteer = node(join, state)
    try:
        volunteer.wait_line(lambda line: line.startswith("round 0 "), timeout_s=60)
        volunteer.proc.send_signal(signal.SIGTERM)
        assert wait_exit(volunteer, 20) == 143, volunteer.stderr[-3000:]
        assert "Traceback" not in volunteer.stderr, volunteer.stderr[-3000:]
        assert f"stopped; checkpoints of finished rounds are in {state}" in volunteer.stderr
        assert sorted(state.glob("diloco-*.ckpt")), list(state.iterdir())
        coordinator.proc.send_signal(signal.SIGTERM)
        assert wait_exit(coordinator, 20) == 143, coordinator.stderr[-3000:]
        assert "Traceback" not in coordinator.stderr, coordinator.stderr[-3000:]
        assert coordinator.stderr.rstrip().endswith("swarmtrain: stopped"), coordinator.stderr
    finally:
        volunteer.stop()
        coordinator.stop()


def test_sigterm_stops_a_relay_and_ctrl_c_still_gives_130(tmp_path: Path) -> None:
    for sig, status in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        relay = PeerProcess(
            [*SWARMTRAIN, "relay", "--identity", str(tmp_path / "relay.key"),
             "--listen", "/ip4/127.0.0.1/tcp/0"]
        )  # fmt: skip
        try:
            relay.wait_line(timeout_s=30)
            relay.proc.send_signal(sig)
            assert wait_exit(relay, 20) == status, relay.stderr[-3000:]
            assert "Traceback" not in relay.stderr, relay.stderr[-3000:]
            assert relay.stderr.rstrip().endswith("swarmtrain: stopped"), relay.stderr
        finally:
            relay.stop()


@contextmanager
def _starting_node(tmp_path: Path) -> Iterator[PeerProcess]:
    """``swarmtrain node`` joining a peer that accepts (the kernel's backlog does) and never
    answers, so the node is still starting when the test signals it, even on a loaded machine:
    it loads torch (seconds), then dials until its timeout (about 10 s)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        peer = "12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"
        join = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{peer}"
        volunteer = PeerProcess([*SWARMTRAIN, "node", "--join", join, "--state-dir", str(tmp_path)])
        try:
            yield volunteer
        finally:
            volunteer.stop()


def _stops_on_ctrl_c(volunteer: PeerProcess) -> None:
    volunteer.proc.send_signal(signal.SIGINT)
    assert wait_exit(volunteer, 20) == 130, volunteer.stderr[-3000:]
    assert "Traceback" not in volunteer.stderr, volunteer.stderr[-3000:]
    assert volunteer.stderr.rstrip().endswith("swarmtrain: stopped"), volunteer.stderr


def test_ctrl_c_while_a_node_starts_up_stops_it_cleanly(tmp_path: Path) -> None:
    """Issue 22: Ctrl+C in the seconds a node loads torch and dials printed a
    KeyboardInterrupt traceback."""
    with _starting_node(tmp_path) as volunteer:
        first = "swarmtrain: starting: loading torch"
        assert first in volunteer.wait_stderr(first, timeout_s=30), volunteer.stderr
        _stops_on_ctrl_c(volunteer)
