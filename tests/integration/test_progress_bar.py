"""What a volunteer sees: on a terminal, a progress bar of the inner phase (round, steps of H,
loss, tokens/s) that gives way to the round's line; through a pipe, the plain lines only. Real
processes on 127.0.0.1, the terminal a pseudo-terminal (``pty``); every wait is bounded."""

from __future__ import annotations

import os
import pty
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
