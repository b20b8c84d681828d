"""A watchdog that logs when this process's trio loop did not run for a while.

Every peer reads a stalled peer as a dead one (pings time out, streams end), so when a node is
dropped from a round the first question is whether it stalled: a blocking call on the loop, a
long GC pause, or the OS not scheduling it. The log line answers that from the node's own side.
"""

from __future__ import annotations

import logging

import trio

log = logging.getLogger(__name__)


async def watch_loop_lag(threshold_s: float = 1.0, period_s: float = 0.25) -> None:
    """Sleep ``period_s`` at a time forever; log a warning whenever a wake-up came more than
    ``threshold_s`` late. Cancel it to stop."""
    while True:
        due = trio.current_time() + period_s
        await trio.sleep_until(due)
        late = trio.current_time() - due
        if late > threshold_s:
            log.warning("the event loop stalled for %.1f s (a blocking call, or no CPU)", late)
