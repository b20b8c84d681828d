"""``p2p.poll``: a probe awaited every interval until done, under one deadline (trio's clock)."""

from __future__ import annotations

import trio
import trio.testing

import p2p


def _run(probe_values: list[int], **timing: float | bool) -> tuple[int | None, list[float]]:
    """Poll a probe that returns ``probe_values`` in turn (then the last one forever); the result
    and the (virtual) times of the probes."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    times: list[float] = []

    async def main() -> int | None:
        started = trio.current_time()

        async def probe() -> int:
            times.append(trio.current_time() - started)
            return probe_values[min(len(times) - 1, len(probe_values) - 1)]

        return await p2p.poll(probe, lambda v: v >= 3, **timing)  # type: ignore[arg-type]

    return trio.run(main, clock=clock), times


def test_poll_returns_the_first_value_that_is_done() -> None:
    value, times = _run([1, 2, 3, 4], interval_s=0.25, timeout_s=10.0)
    assert value == 3
    assert times == [0.0, 0.25, 0.5]


def test_poll_returns_the_last_value_at_the_deadline() -> None:
    value, times = _run([1, 2], interval_s=0.25, timeout_s=1.0)
    assert value == 2
    assert times == [0.0, 0.25, 0.5, 0.75, 1.0]  # the last probe is the one at the deadline


def test_wait_first_sleeps_one_interval_before_the_first_probe() -> None:
    value, times = _run([5], interval_s=0.25, timeout_s=1.0, wait_first=True)
    assert value == 5 and times == [0.25]


def test_no_probe_in_time_gives_none() -> None:
    assert _run([5], interval_s=0.2, timeout_s=0.0, wait_first=True) == (None, [])
