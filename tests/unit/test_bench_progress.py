"""A long benchmark's progress (``bench.progress``): plain lines, one per task per tenth of its
work, when stdout is not a terminal; a rich bar when it is."""

from __future__ import annotations

import io
import threading
import time

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


def test_phases_lines_and_a_bench_that_prints_its_own_lines() -> None:
    out = io.StringIO()
    with BenchProgress(out) as progress:
        progress.phase("starting 4 workers")
        progress.add("allreduce", 3, plain_lines=False)  # the bench prints a line per round
        for r in range(3):
            progress.line(f"round {r}: 1.0 s")
            progress.advance("allreduce")
        progress.add("soak", 60, unit="s")
        progress.reach("soak", 30)
        progress.reach("soak", 20)  # never backwards
        progress.reach("soak", 60)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("phase: starting 4 workers (") and lines[0].endswith(
        "after the start)"
    )
    assert lines[1:4] == ["round 0: 1.0 s", "round 1: 1.0 s", "round 2: 1.0 s"]
    assert [line.split()[1:3] for line in lines[4:]] == [["30/60", "s"], ["60/60", "s"]]


def test_a_timed_task_ticks_while_its_block_runs() -> None:
    out = io.StringIO()
    progress = BenchProgress(out)
    with progress.ticking("budget", 1):
        deadline = time.monotonic() + 10
        while "budget: 1/1 s" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    progress.close()
    assert "budget: 1/1 s" in out.getvalue()


def test_a_terminal_shows_phases_and_lines_above_the_bars() -> None:
    out = Terminal()
    with BenchProgress(out) as progress:
        progress.phase("building the lab")
        progress.add("allreduce", 2, unit="rounds", plain_lines=False)
        progress.line("round 0 [warm-up]: 1.0 s")  # brackets stay text, not rich markup
        progress.advance("allreduce", 2)
    text = out.getvalue()
    assert "phase: building the lab" in text and "round 0 [warm-up]: 1.0 s" in text
    assert "2/2" in text and "rounds" in text
