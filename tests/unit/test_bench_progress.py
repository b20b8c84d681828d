"""A long benchmark's progress (``bench.progress``): plain lines, one per task per tenth of its
work, when stdout is not a terminal; a rich bar when it is."""

from __future__ import annotations

import io
import threading

from bench.progress import BenchProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_come_once_per_tenth_per_task_from_many_threads() -> None:
    out = io.StringIO()
    progress = BenchProgress(out)
    progress.add("diloco", 40)
    progress.add("alone", 5)
    workers = [threading.Thread(target=lambda: progress.advance("diloco")) for _ in range(40)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    progress.advance("alone", 5)
    progress.close()
    lines = out.getvalue().splitlines()
    diloco = [line for line in lines if line.strip().startswith("diloco:")]
    assert [line.split()[1] for line in diloco] == [f"{4 * k}/40" for k in range(1, 11)]
    assert [line.split()[1] for line in lines if "alone" in line] == ["5/5"]


def test_a_terminal_gets_a_bar_instead() -> None:
    out = Terminal()
    progress = BenchProgress(out)
    progress.add("diloco", 4)
    progress.advance("diloco", 4)
    progress.close()
    assert "diloco" in out.getvalue() and "4/4" in out.getvalue()
    assert "after the start" not in out.getvalue()
