"""Fault injection for tests and demos of a verified run: one hook, built once from the CLI.

``swarmtrain node --cheat ROUND:STEP:OP`` (flip one bit of operator OP's output at inner step STEP
of this node's task in round ROUND), ``--cheat-reduce ROUND`` (every part this node reduces in
round ROUND is off by 1.0 in its first value) and ``--slow-start S`` (the node waits S seconds
after announcing its start, before its first inner phase: a slow warm-up, for the membership
tests), all hidden from ``--help``, become one ``Faults``
object. It is handed to the two places that consult it: ``Verification`` (``tamper_task``) and
``swarm.Averager`` (``tamper_reduced``, swarm's ``AveragingFaults`` hook), instead of two flags
threaded through the node options, the training loop, the averager config and the session
config. The idea is torchft's ``EventInjector``: faults at (peer, round, phase), injected, not
configured. ``NO_FAULTS`` is the honest peer.

Pure: no IO, no clocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


def _off_by_one(part_index: int, reduced: np.ndarray) -> np.ndarray:
    out = reduced.copy()
    if len(out):
        out[0] += np.float32(1.0)
    return out


@dataclass(frozen=True)
class Faults:
    """What this peer does wrong, on purpose. ``task``: (round, step, op) of the operator whose
    output it tampers with; ``reduce_round``: the round whose reduced parts it falsifies;
    ``slow_start_s``: how long it stalls between its start announcement and its first round."""

    task: tuple[int, int, int] | None = None
    reduce_round: int | None = None
    slow_start_s: float = 0.0
    # A stranger that does not refuse itself (``--ignore-admission``): the members must.
    ignore_admission: bool = False
    # A verified peer that commits its task honestly, then sends half of it in this round
    # (``--cheat-send ROUND``): its verifier must drop it from the round.
    send_round: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and (len(self.task) != 3 or min(self.task) < 0):
            raise ValueError(f"task fault must be (round, step, op) >= 0, got {self.task!r}")
        if self.reduce_round is not None and self.reduce_round < 0:
            raise ValueError(f"reduce fault round must be >= 0, got {self.reduce_round}")
        if not 0.0 <= self.slow_start_s <= 600.0:
            raise ValueError(f"slow start must be 0-600 s, got {self.slow_start_s}")

    def tamper_task(self, round_number: int) -> tuple[int, int] | None:
        """(step, op) to tamper with in our task of ``round_number``, or None (honest): a
        cheater keeps cheating from its round on (a joiner's first round may come later)."""
        if self.task is None or round_number < self.task[0]:
            return None
        return self.task[1], self.task[2]

    def tamper_reduced(self, round_number: int) -> Callable[[int, np.ndarray], np.ndarray] | None:
        """What every part we reduce in ``round_number`` goes through, or None (honest)."""
        if self.reduce_round != round_number:
            return None
        log.warning("round %s: cheating: every part we reduce is off", round_number)
        return _off_by_one


NO_FAULTS = Faults()


def parse_task_fault(text: str) -> tuple[int, int, int]:
    """``ROUND:STEP:OP`` as three non-negative integers. Raises ValueError."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError("expected ROUND:STEP:OP (non-negative integers)")
    return int(parts[0]), int(parts[1]), int(parts[2])
