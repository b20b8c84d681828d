"""The contract between RepOps (which executes and records) and the dispute game (which checks).

A training step under RepOps is a canonical list of operator applications, each an ``OpRecord``:
leaves first where they are used (parameters, optimizer state, the data batch, named ``leaf:...``),
then every operator in execution order, each naming the records whose outputs it consumes. Every
record has exactly one output tensor; an operator with several outputs is recorded as several
operators. Hashes are SHA-256 over ``canonical_bytes`` so that numpy and torch producers agree.

This module is numpy-only on purpose: the referee, the providers and the tests all import it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

_TENSOR_TAG = b"swarmtrain/tensor/v1\0"
_STATE_TAG = b"swarmtrain/state/v1\0"
LEAF_PREFIX = "leaf:"


def _little(array: np.ndarray) -> tuple[np.ndarray, bytes]:
    """``array`` C-contiguous and little-endian (copied only when it is not), and its header."""
    contiguous = np.ascontiguousarray(array)
    little = contiguous.astype(contiguous.dtype.newbyteorder("<"), copy=False)
    dtype = little.dtype.str.encode()
    header = struct.pack("<B", len(dtype)) + dtype + struct.pack("<I", little.ndim)
    header += struct.pack(f"<{little.ndim}Q", *little.shape)
    return little, _TENSOR_TAG + header


def canonical_bytes(array: np.ndarray) -> bytes:
    """dtype string, rank, dims, then the elements little-endian in C order."""
    little, header = _little(array)
    return header + little.tobytes()


def tensor_hash(array: np.ndarray) -> bytes:
    """32-byte SHA-256 of ``canonical_bytes``, hashed from the array's memory (no copy of a
    C-contiguous little-endian array: the dispatch trace hashes every operator's output)."""
    little, header = _little(array)
    digest = hashlib.sha256(header)
    digest.update(little.reshape(-1).view(np.uint8))
    return digest.digest()


def state_hash(state: Mapping[str, np.ndarray]) -> bytes:
    """SHA-256 over the sorted names and their tensor hashes: one value per training state."""
    return state_hash_of((name, tensor_hash(state[name])) for name in sorted(state))


def state_hash_of(named_hashes: Iterable[tuple[str, bytes]]) -> bytes:
    """``state_hash`` from (name, tensor hash) pairs in sorted name order: a state can be
    checked against its hash with only some of its tensors at hand."""
    digest = hashlib.sha256(_STATE_TAG)
    for name, tensor_digest in named_hashes:
        encoded = name.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded + tensor_digest)
    return digest.digest()


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One operator application.

    ``name`` is a key of the RepOps operator registry, or ``leaf:<label>`` for an input of the step.
    ``inputs`` are indices of earlier records of the same step. ``attrs`` is the canonical msgpack
    of the operator's non-tensor arguments (b"" when none). ``output`` is the output's
    ``tensor_hash``.
    """

    name: str
    inputs: tuple[int, ...]
    attrs: bytes
    output: bytes

    @property
    def is_leaf(self) -> bool:
        return self.name.startswith(LEAF_PREFIX)


@dataclass(slots=True)
class StepResult:
    """What one traced step produced: the next state, the trace, and each record's output."""

    state: dict[str, np.ndarray]
    records: list[OpRecord]
    outputs: list[np.ndarray] = field(repr=False)


class TracedStep(Protocol):
    """Runs one deterministic training step from ``state``.

    ``tamper_op`` (for tests and the cheating provider) names a non-leaf record whose output gets
    its lowest mantissa bit of element 0 flipped before anything downstream uses it.
    """

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult: ...


class Recompute(Protocol):
    """The referee's one-operator recomputation: ``verify.repops.step.run_op`` has this
    signature."""

    def __call__(self, name: str, inputs: list[np.ndarray], attrs: bytes) -> np.ndarray: ...
