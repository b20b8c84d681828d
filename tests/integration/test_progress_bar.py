"""What a volunteer sees: on a terminal, a progress bar of the inner phase (round, steps of H,
loss, tokens/s) that gives way to the round's line; through a pipe, the plain lines only. Real
processes on 127.0.0.1, the terminal a pseudo-terminal (``pty``); every wait is bounded."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import threading
from pathlib import Path

from peerproc import SWARMTRAIN
from runproc import node, start_coordinator, wait_exit


def test_a_terminal_shows_the_inner_phase_and_a_pipe_plain_lines(tmp_path: Path) -> None:
    coordinator, join = start_coordinator(tmp_path, rounds=2, inner_steps=40)
    master, slave = pty.openpty()
    seen = bytearray()

    def drain() -> None:  # the child blocks once the terminal's buffer is full: keep reading
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    piped = node(join, tmp_path / "piped")
    try:
        on_terminal = subprocess.Popen(
            [*SWARMTRAIN, "node", "--join", join, "--listen", "/ip4/127.0.0.1/tcp/0",
             "--state-dir", str(tmp_path / "tty"), "--threads", "1"],
            stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(slave)
        reader.start()
        try:
            assert on_terminal.wait(100) == 0
        finally:
            on_terminal.kill()
        assert wait_exit(piped, 60) == 0, piped.stderr[-3000:]
    finally:
        piped.stop()
        coordinator.stop()
    reader.join(10)
    os.close(master)
    text = seen.decode(errors="replace")
    assert "round 0" in text and "steps  loss" in text and "tok/s" in text, text[-2000:]
    assert "/40" in text, text[-2000:]  # the step count out of H
    # The bar gave way to the round's line, as without a terminal.
    assert "round 1 loss " in text and "done: " in text, text[-2000:]
    assert not any("\x1b[" in line or "steps  loss" in line for line in piped.lines), piped.lines


def test_swarmtrain_local_on_a_terminal_shows_a_bar_per_node(tmp_path: Path) -> None:
    """The smallest local run (2 peers, 1 round of 2 steps) on a pseudo-terminal: each node's
    bar reaches its round, and the nodes' round lines still scroll above the bars."""
    master, slave = pty.openpty()
    seen = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    local = subprocess.Popen(
        [*SWARMTRAIN, "local", "--peers", "2", "--rounds", "1", "--inner-steps", "2",
         "--workdir", str(tmp_path / "run")],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE,
    )  # fmt: skip
    os.close(slave)
    reader.start()
    try:
        assert local.wait(100) == 0, local.stderr.read() if local.stderr else ""
    finally:
        local.kill()
        if local.stderr is not None:
            local.stderr.close()
    reader.join(10)
    os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    assert "[0] round 0 loss " in text and "[1] round 0 loss " in text, text[-3000:]
    for index in (0, 1):
        assert re.search(rf"node {index} .*1/1 rounds  loss [\d.]+  peers 2", text), text[-3000:]
