"""``swarmtrain local``'s display (``swarmtrain.commands.local_progress``): the node round lines
it reads, its lines unchanged through a pipe, and a bar per node on a terminal. The real command
on a pseudo-terminal: ``tests/integration/test_progress_bar.py``."""

from __future__ import annotations

import io
import re

from swarmtrain.commands.local_progress import LocalProgress, RoundDone, read_round_line

AVERAGED = (
    "[1] round 2 loss 3.101 5120 tok/s peers 3 sent 4.45 MiB recv 4.45 MiB allreduce 0.91 s "
    "exposed 0.91 s state 0123456789ab agree yes (3/3) 9.8 s"
)
FAILED = "[0] round 1 loss 3.500 4800 tok/s FAILED (no group formed); exposed 0.00 s state ab 3.0 s"
OVERLAPPED = "[2] round 4 loss 2.900 5000 tok/s: inner phase done, averaging while round 5 trains"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_only_lines_that_end_a_round_are_read() -> None:
    assert read_round_line(AVERAGED) == RoundDone(1, 2, "3.101", 3)
    assert read_round_line(FAILED) == RoundDone(0, 1, "3.500", None)
    assert read_round_line(OVERLAPPED) is None  # its averaging is still to come
    assert read_round_line("run local-1: 3 peers join /ip4/127.0.0.1/tcp/1/p2p/x") is None
    assert read_round_line("round 2 loss 3.1 10 tok/s peers 3") is None  # not a node's line


def test_a_pipe_gets_the_lines_exactly() -> None:
    out = io.StringIO()
    with LocalProgress(3, 5, out) as progress:
        assert not progress.terminal
        for line in ("coordinator ready", AVERAGED, FAILED):
            progress.emit(line)
    assert out.getvalue() == f"coordinator ready\n{AVERAGED}\n{FAILED}\n"


def test_a_terminal_gets_a_bar_per_node_above_which_the_lines_scroll() -> None:
    out = Terminal()
    with LocalProgress(3, 5, out) as progress:
        assert progress.terminal
        progress.emit(AVERAGED)
        progress.emit(FAILED)
        progress.emit(OVERLAPPED)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # colours, cursor moves
    assert "round 2 loss 3.101" in text  # the line itself, above the bars
    assert "node 1" in text and "3/5 rounds  loss 3.101  peers 3" in text, text
    assert "2/5 rounds  loss 3.500  peers failed" in text, text
    assert "node 2" in text and "0/5 rounds" in text, text  # an overlapped line is no round yet
