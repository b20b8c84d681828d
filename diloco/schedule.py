"""The inner learning rate's schedule, shared by the node (``[training] lr_schedule``) and
``bench.diloco``, so the product runs what the benchmark reports."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, total: int, schedule: str, warmup: float, final: float) -> float:
    """The inner learning rate's multiplier at inner step ``step`` of ``total``: ``constant`` 1;
    ``cosine`` a linear warm-up over ``warmup`` of the steps, then a cosine decay to ``final``."""
    if schedule == "constant":
        return 1.0
    ramp = max(1, round(warmup * total))
    if step < ramp:
        return (step + 1) / ramp
    progress = min(1.0, (step - ramp) / max(1, total - ramp))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
