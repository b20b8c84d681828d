"""The lines a pipeline node prints for its role's events, and their reading back.

``describe`` turns an event of ``swarmtrain.pipeline.roles`` (``{"event": "averaged", ...}``) into
a line for a human with its kind's template in ``LINES``; ``read_line`` reads such a line back
into the event's fields. The lines are the one thing a running ``swarmtrain node`` shows of its
pipeline role, so ``swarmtrain local --pipeline-stages``, the pipeline tests and ``bench.swarm``
read them (their ``--json`` summaries come at the end). Pure: no IO, no clock.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

__all__ = ["LINES", "describe", "format_loss", "read_line"]


def format_loss(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "n/a"


# The line of each event kind worth one: ``describe`` fills it in, ``read_line`` reads it back.
# A field is one word or a [list], or the rest of the line when its template ends with it.
LINES = {
    "serving": "serving stage {stage} (probe: {throughput} samples/s)",
    "joined": "joined stage {stage}: downloaded its servers' parameters of averaging round {round}",
    "averaged": "stage {stage}: averaged round {round} with {group} servers, stage hash {digest}; "
    "{forwards} forwards, {backwards} backwards",
    "moved": "moved from stage {from_stage} to stage {to_stage} (the bottleneck), parameters "
    "{hash}",
    "progress": "stage {stage}: {forwards} forwards, {backwards} backwards, {averaged_rounds} "
    "averaged rounds, {moves} moves, {throughput} samples/s",
    "ready": "trainer ready: servers per stage {servers_per_stage}",
    "round": "round {round} loss {loss} microbatches {microbatches} {samples_per_s} samples/s "
    "failovers {failovers} servers per stage {servers_per_stage} {seconds} s",
    "microbatch_failed": "microbatch failed (attempt {attempt}): {reason}",
    "restarting": "stage {stage} has no server: restarting on it (initial parameters)",
}
_FIELD = re.compile(r"\{(\w+)\}")


def _pattern(template: str) -> re.Pattern[str]:
    parts = _FIELD.split(template)  # text, field, text, ..., text
    return re.compile(
        "".join(
            re.escape(part)
            if i % 2 == 0
            else f"(?P<{part}>.+)"
            if i == len(parts) - 2 and not parts[-1]
            else rf"(?P<{part}>\[[^\]]*\]|\S+)"
            for i, part in enumerate(parts)
        )
        + "$"
    )


_PATTERNS = {kind: _pattern(template) for kind, template in LINES.items()}
_TEXT = {"digest", "hash", "reason"}  # read as shown (a hash prefix can be all digits)


def describe(event: dict[str, Any]) -> str | None:
    """A role's event as a progress line for a human, or None for events not worth a line."""
    kind = event.get("event")
    if kind not in LINES or (kind == "ready" and "servers_per_stage" not in event):
        return None  # a server's "ready": its "serving" line says it
    fields = {"forwards": 0, "backwards": 0, **event}
    if kind == "averaged":
        fields["digest"] = str(event["digest"])[:12]
    elif kind == "moved":
        fields["hash"] = str(event["hash"])[:12]
    elif kind == "round":
        fields["loss"] = format_loss(event["loss"])
    elif kind == "microbatch_failed":
        fields["attempt"] = event["attempt"] + 1  # counted from 1 for a human
    return LINES[kind].format(**fields)


def read_line(line: str) -> dict[str, Any] | None:
    """The event a ``describe`` line shows (``{"event": kind, field: value}``; numbers and lists
    parsed, ``n/a`` as None, the attempt counted from 1, hashes as their 12-digit prefix), or
    None for any other line."""
    for kind, pattern in _PATTERNS.items():
        match = pattern.match(line)
        if match:
            fields = match.groupdict().items()
            return {"event": kind, **{k: v if k in _TEXT else _value(v) for k, v in fields}}
    return None


def _value(text: str) -> Any:
    if text == "n/a":
        return None
    if text.startswith("["):
        with contextlib.suppress(ValueError):
            return json.loads(text)
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text
