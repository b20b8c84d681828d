"""The averaging protocol DiLoCo is written against, and an in-process implementation of it.

DiLoCo does not know how pseudo-gradients are averaged: the swarm all-reduce, a torch.distributed
group or threads in one process all fit ``Average``. It is a blocking call made once per round by
every participating peer with the round's pseudo-gradient as one flat float32 vector (the
parameters concatenated, DiLoCo's own form of it); it returns the weighted mean as one flat
vector (identical bits on every peer that gets an outcome) or raises, and a raise means the round
failed for this peer.

``LocalAverage`` averages among N peers in one process through a condition variable. It is a real
implementation for single-machine simulation (tests, benchmarks), with the same determinism rule as
the swarm's: contributions are accumulated in float64 in sorted peer-id order, then cast to float32
once, and every peer receives a copy of the one result. With a robust ``aggregation`` it runs the
swarm reducer's own rule (``swarm.averaging.aggregation``) over the whole vector, so a bench in one
process (``bench.byzantine``) measures the code a swarm runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# The one class for a failed round, swarm's: its averager raises it and DiLoCo's callers catch it.
from swarm import AGGREGATIONS, AveragingFailed, aggregate


@dataclass(frozen=True)
class AverageOutcome:
    """``vector``: the weighted mean (flat float32, the contributed length).
    ``contributors``: peer id -> weight of every contribution included in the mean.
    ``detail``: what the implementation reports beyond that (the swarm's: its ``RoundReport``),
    handed back to the caller of ``DiLoCo.step`` in the round's ``RoundOutcome``.
    ``sent``: our contribution as the others received it, when a lossy codec changed it (the
    swarm's int8 round trip), for error feedback; None: received as given."""

    vector: torch.Tensor
    contributors: dict[str, float]
    detail: Any = None
    sent: torch.Tensor | None = None


class Average(Protocol):
    """Average the flat float32 ``vector`` with the other peers of ``round``, weighted by
    ``weight`` (samples processed). Blocks until done; raises any Exception when the round fails
    for this peer. ``vector`` is given away: DiLoCo makes a fresh one each round and never
    writes to it after the call (it may read it), so an implementation may keep using its
    memory after returning (the swarm's round forwards slices of it) instead of copying it."""

    def __call__(self, round: int, vector: torch.Tensor, weight: float) -> AverageOutcome: ...


def weighted_mean(
    contributions: dict[str, tuple[list[torch.Tensor], float]],
) -> list[torch.Tensor]:
    """Weighted mean of each tensor position over peers, float64 accumulation in sorted peer-id
    order, one cast to float32 at the end. Raises ValueError on mismatched shapes or a
    non-positive total weight."""
    peers = sorted(contributions)
    total = sum(contributions[p][1] for p in peers)
    if not total > 0:
        raise ValueError("total weight must be positive")
    first = contributions[peers[0]][0]
    means = []
    for index, reference in enumerate(first):
        accumulator = torch.zeros(reference.shape, dtype=torch.float64)
        for peer in peers:
            tensors, weight = contributions[peer]
            if len(tensors) != len(first) or tensors[index].shape != reference.shape:
                raise ValueError(f"peer {peer} contributed tensors of other shapes")
            accumulator += tensors[index].to(torch.float64) * weight
        means.append((accumulator / total).to(torch.float32))
    return means


@dataclass
class _Round:
    contributions: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)
    result: torch.Tensor | None = None
    failed: bool = False
    arrived: int = 0
    collected: int = 0


class LocalAverage:
    """Averaging among ``peers`` participants of one process; ``member(peer_id)`` gives each its
    ``Average`` callable. A round completes when all members of it have contributed; if that takes
    longer than ``timeout_s`` the round fails for everyone waiting (AveragingFailed), and a member
    that arrives after the failure fails too. ``aggregation``: "mean" (``weighted_mean``) or a
    robust rule of ``swarm.averaging.aggregation`` over the whole vector (one part)."""

    def __init__(self, peers: int, *, timeout_s: float = 60.0, aggregation: str = "mean") -> None:
        if peers <= 0:
            raise ValueError("peers must be positive")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}: {aggregation!r}")
        self._aggregation = aggregation
        self._peers = peers
        self._timeout_s = timeout_s
        self._condition = threading.Condition()
        self._rounds: dict[int, _Round] = {}

    def member(self, peer_id: str) -> Callable[[int, torch.Tensor, float], AverageOutcome]:
        def average(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
            return self._average(peer_id, round, vector, weight)

        return average

    def _average(
        self, peer_id: str, round: int, vector: torch.Tensor, weight: float
    ) -> AverageOutcome:
        snapshot = vector.detach().to("cpu", torch.float32, copy=True)
        with self._condition:
            state = self._rounds.setdefault(round, _Round())
            if state.failed:
                raise AveragingFailed(f"round {round} already failed")
            if peer_id in state.contributions:
                raise ValueError(f"peer {peer_id} contributed twice to round {round}")
            state.contributions[peer_id] = (snapshot, weight)
            state.arrived += 1
            if len(state.contributions) == self._peers:
                state.result = self._combine(state.contributions)
                self._condition.notify_all()
            else:
                self._condition.wait_for(
                    lambda: state.result is not None or state.failed, self._timeout_s
                )
            if state.result is None:
                state.failed = True
                state.contributions.clear()  # the snapshots are useless now; free them
                self._condition.notify_all()
                raise AveragingFailed(
                    f"round {round}: {state.arrived} of {self._peers} peers arrived"
                )
            contributors = {p: w for p, (_, w) in sorted(state.contributions.items())}
            outcome = AverageOutcome(state.result.clone(), contributors)
            state.collected += 1
            if state.collected == self._peers:
                del self._rounds[round]
            return outcome

    def _combine(self, contributions: dict[str, tuple[torch.Tensor, float]]) -> torch.Tensor:
        if self._aggregation == "mean":
            # One "tensor" per peer: the same float64 accumulation, element for element.
            lists = {p: ([v], w) for p, (v, w) in contributions.items()}
            return weighted_mean(lists)[0]
        # Peer ids as UTF-8 bytes sort as the strings do: the swarm's sorted peer order.
        arrays = {p.encode(): (v.numpy(), w) for p, (v, w) in contributions.items()}
        return torch.from_numpy(aggregate(self._aggregation, arrays))
