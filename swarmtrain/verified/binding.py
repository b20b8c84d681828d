"""A verified contribution bound to its task, all the way to a verdict (issue 19, point 2).

A verifier that re-executed a peer's task knows what that peer owes the round bit for bit: the
round's global parameters minus the task's final ones. When a slice the peer signed differs (the
verifier refused it as a reducer, or another reducer's published claim lists it with another
hash: ``swarm.misbound``), the verifier publishes a ``swarm.SliceDispute`` in its audit record.
The referee rules without trusting either side:

1. the peer's signature over (part, weight, slice hash) must verify: it did send that slice;
2. the verifier serves the task's start and final parameters covering the part
   (``TaskStateQuery``), with every tensor hash of both states: their ``state_hash`` must be the
   task's start hash and the final hash that the peer itself committed (and the verifier agreed
   to), and each served tensor must have its listed hash;
3. the slice the peer owes is recomputed from them (one float32 subtraction per element, as the
   node computes it) and hashed: differing from what it signed, the peer is banned; equal, the
   verifier accused it falsely and is banned.

Unusable evidence (states that do not hash to the commitment, a verifier that does not answer)
rules on nobody. Pure, except the messages' protocol name: the referee and the volunteer drive it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import swarm
from p2p import Message, message
from verify import (
    Provider,
    canonical_bytes,
    state_hash_of,
    tensor_from_canonical,
    tensor_hash,
)

STATE_PROTOCOL = "/swarmtrain/verify/task-state/1"
MAX_NAMES = 1024
MAX_STATE_ANSWER_BYTES = 256 << 20


@message(510, max_bytes=64 * MAX_NAMES)
class TaskStateQuery(Message):
    """The tensors ``names`` of a task's state after ``step`` steps (0: its start)."""

    task_id: bytes
    step: int
    names: list[str]


@message(511, max_bytes=MAX_STATE_ANSWER_BYTES)
class TaskStateAnswer(Message):
    """Every tensor's name and hash of that state (sorted by name), so its ``state_hash`` can
    be recomputed, and the asked tensors as ``verify.trace.canonical_bytes``."""

    names: list[str]
    hashes: list[bytes]
    tensors: list[bytes]


def answer_state(provider: Provider, query: TaskStateQuery) -> TaskStateAnswer:
    """What a verifier serves about a task it re-executed. Raises ValueError for a step or a
    name it does not have."""
    if not 0 <= query.step < len(provider.states):
        raise ValueError(f"no state after {query.step} steps")
    state = provider.states[query.step]
    if len(query.names) > MAX_NAMES or any(n not in state for n in query.names):
        raise ValueError("unknown tensor names")
    names = sorted(state)
    return TaskStateAnswer(
        names,
        [tensor_hash(state[n]) for n in names],
        [canonical_bytes(state[n]) for n in query.names],
    )


@dataclass(frozen=True)
class ParamRange:
    name: str
    start: int
    stop: int
    shape: tuple[int, ...]


def param_ranges(shapes: Mapping[str, Sequence[int]]) -> list[ParamRange]:
    """Each parameter's range in the flat vector a node averages, from the trainable parameters'
    shapes in the model's order (``swarmtrain.verified.task.param_layout``)."""
    out, offset = [], 0
    for name, dims in shapes.items():
        size = int(np.prod(dims, dtype=np.int64))
        out.append(ParamRange(name, offset, offset + size, tuple(dims)))
        offset += size
    return out


def covering(ranges: Sequence[ParamRange], start: int, stop: int) -> list[ParamRange]:
    """The parameters that ``[start, stop)`` of the flat vector touches, in order."""
    return [r for r in ranges if r.start < stop and start < r.stop]


def _tensors(
    answer: TaskStateAnswer, asked: Sequence[ParamRange], state_hash: bytes
) -> dict[str, np.ndarray] | str:
    """The asked tensors, checked against ``state_hash``; a reason string when they are not."""
    if list(answer.names) != sorted(set(answer.names)) or len(answer.hashes) != len(answer.names):
        return "the state's names are not sorted and unique"
    if state_hash_of(zip(answer.names, answer.hashes, strict=True)) != state_hash:
        return "the served state does not have the committed hash"
    listed = dict(zip(answer.names, answer.hashes, strict=True))
    if len(answer.tensors) != len(asked):
        return "the served state lacks tensors"
    out = {}
    for r, data in zip(asked, answer.tensors, strict=True):
        try:
            array = tensor_from_canonical(data)
        except ValueError:
            return f"tensor {r.name} is malformed"
        if listed.get(r.name) != tensor_hash(array):
            return f"tensor {r.name} does not have its listed hash"
        if array.dtype != np.float32 or array.shape != r.shape:
            return f"tensor {r.name} is not float32 {r.shape}"
        out[r.name] = array
    return out


@dataclass(frozen=True)
class SliceRuling:
    """``guilty`` True: the peer signed a slice it does not owe; False: it owes exactly what it
    signed (its accuser lied); None: the evidence was unusable."""

    guilty: bool | None
    reason: str


def rule_slice(
    dispute: swarm.SliceDispute,
    ranges: Sequence[ParamRange],
    start: TaskStateAnswer,
    final: TaskStateAnswer,
    start_hash: bytes,
    final_hash: bytes,
) -> SliceRuling:
    """The referee's ruling once the signature is checked and both states are served for the
    parameters ``covering`` the disputed range."""
    asked = covering(ranges, dispute.start, dispute.stop)
    if not asked or asked[-1].stop < dispute.stop:
        return SliceRuling(None, f"part {dispute.part} is outside the model's parameters")
    before = _tensors(start, asked, start_hash)
    after = _tensors(final, asked, final_hash)
    for side, got in (("start", before), ("final", after)):
        if isinstance(got, str):
            return SliceRuling(None, f"the verifier's {side} state: {got}")
    assert isinstance(before, Mapping) and isinstance(after, Mapping)
    flat_start = np.concatenate([before[r.name].reshape(-1) for r in asked])
    flat_final = np.concatenate([after[r.name].reshape(-1) for r in asked])
    owed = np.subtract(flat_start, flat_final, dtype=np.float32)
    offset = asked[0].start
    owed = owed[dispute.start - offset : dispute.stop - offset]
    if swarm.slice_hash(owed) == dispute.digest:
        return SliceRuling(False, f"its slice of part {dispute.part} is what its task owes")
    return SliceRuling(
        True, f"its signed slice of part {dispute.part} is not the pseudo-gradient of its task"
    )
