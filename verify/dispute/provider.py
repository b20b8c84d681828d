"""A provider's side of the dispute game: run a task, commit to it, answer the referee.

``Provider.run()`` executes the S steps with a ``TracedStep`` and keeps the state before every
step (what any step is recomputed from) and each step's records and their tree (hashes and attrs,
about 100 bytes a record), never the operators' outputs. Prefix and proof queries are answered
from those; only an operator opening needs tensors: it recomputes that step from the stored state
(one step of compute, the same deterministic result) and keeps that one step's outputs until
another step is opened. Memory: S + 1 states, S record lists, one step's outputs.

``tamper=(step, op)`` makes this provider a cheater for tests and the demo: it flips one output bit
of record ``op`` at step ``step`` (the contract's ``tamper_op``), consistently in its run and in
every recomputation, as a real cheater who had committed would have to.

``answer(query)`` is plain and synchronous (the driver runs it in a worker thread); it raises
``ValueError`` for a query that names another task or what does not exist.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from p2p import Message
from verify.commit import (
    STATE_OP,
    Commitment,
    MerkleTree,
    StepLeaf,
    StepTrace,
    TaskSpec,
    encode_record,
    state_names,
    task_tree,
)
from verify.dispute.wire import (
    CommitmentAnswer,
    CommitmentQuery,
    OpOpenAnswer,
    OpOpenQuery,
    OpPrefixQuery,
    PrefixAnswer,
    StepOpenAnswer,
    StepOpenQuery,
    StepPrefixQuery,
)
from verify.trace import OpRecord, TracedStep, canonical_bytes, state_hash, tensor_hash


class Provider:
    def __init__(
        self,
        traced_step: TracedStep,
        start_state: Mapping[str, np.ndarray],
        task: TaskSpec,
        *,
        tamper: tuple[int, int] | None = None,
    ) -> None:
        if state_hash(start_state) != task.start_state_hash:
            raise ValueError("the start state does not have the task's start state hash")
        self.traced_step = traced_step
        self.task = task
        self.tamper = tamper
        self.states: list[dict[str, np.ndarray]] = [dict(start_state)]
        self.leaves: list[StepLeaf] = []
        self.records: list[list[OpRecord]] = []  # per step, with its tree: no outputs
        self.trees: list[MerkleTree] = []
        self._cached: StepTrace | None = None
        self.steps_recomputed = 0

    def _traced(self, step: int) -> StepTrace:
        tamper_op = self.tamper[1] if self.tamper and self.tamper[0] == step else None
        result = self.traced_step(self.states[step], step, tamper_op)
        return StepTrace(step, result)

    def run(self) -> Commitment:
        """Execute every step; returns the final commitment. Idempotent."""
        while len(self.leaves) < self.task.steps:
            step = len(self.leaves)
            trace = self._traced(step)
            self.leaves.append(trace.leaf)
            self.records.append(trace.records)
            self.trees.append(trace.tree)
            self.states.append(
                {name: np.asarray(value) for name, value in self._state_after(trace).items()}
            )
            self._cached = None  # drop the outputs: only openings need them, recomputed
        self.tree = task_tree(self.leaves)
        return self.commitment

    @staticmethod
    def _state_after(trace: StepTrace) -> dict[str, np.ndarray]:
        record = trace.records[-1]
        return {
            name: trace.outputs[index]  # type: ignore[misc]
            for name, index in zip(state_names(record), record.inputs, strict=True)
        }

    @property
    def commitment(self) -> Commitment:
        return Commitment(self.task.steps, self.tree.root, self.leaves[-1].state_hash)

    @property
    def final_state(self) -> dict[str, np.ndarray]:
        return self.states[-1]

    def trace(self, step: int) -> StepTrace:
        """Step ``step``'s trace, recomputed from the stored state unless it is the cached one."""
        if not 0 <= step < self.task.steps:
            raise ValueError(f"no step {step}")
        if self._cached is None or self._cached.step != step:
            self._cached = None  # free the old outputs before computing the new ones
            trace = self._traced(step)
            self.steps_recomputed += 1
            if trace.leaf != self.leaves[step]:
                raise RuntimeError(f"step {step} is not reproducible: recomputation differs")
            self._cached = trace
        return self._cached

    def answer(self, query: Message) -> Message:
        if getattr(query, "task_id", None) != self.task.task_id:
            raise ValueError("unknown task")
        if isinstance(query, CommitmentQuery):
            c = self.commitment
            return CommitmentAnswer(c.steps, c.task_root, c.final_state_hash)
        if isinstance(query, StepPrefixQuery):
            if not 0 <= query.size <= self.task.steps:
                raise ValueError(f"no prefix of {query.size} steps")
            return PrefixAnswer(
                self.tree.prefix_root(query.size), self.tree.prove_consistency(query.size)
            )
        if isinstance(query, StepOpenQuery):
            s = query.step
            if not 0 <= s < self.task.steps:
                raise ValueError(f"no step {s}")
            prev_leaf, prev_path = b"", []
            if s:
                prev_leaf, prev_path = self.leaves[s - 1].encode(), self.tree.prove(s - 1, s)
            n = len(self.records[s])
            return StepOpenAnswer(
                self.leaves[s].encode(),
                self.tree.prove(s, s + 1),
                prev_leaf,
                prev_path,
                encode_record(self.records[s][-1]),
                self.trees[s].prove(n - 1),
            )
        if isinstance(query, OpPrefixQuery):
            if not 0 <= query.step < self.task.steps:
                raise ValueError(f"no step {query.step}")
            tree = self.trees[query.step]
            if not 0 <= query.size <= len(tree):
                raise ValueError(f"no prefix of {query.size} records")
            return PrefixAnswer(tree.prefix_root(query.size), tree.prove_consistency(query.size))
        if isinstance(query, OpOpenQuery):
            return self._open_op(query.step, query.index)
        raise ValueError(f"cannot answer {type(query).__name__}")

    def _open_op(self, step: int, index: int) -> OpOpenAnswer:
        trace = self.trace(step)
        if not 0 <= index < len(trace.records):
            raise ValueError(f"no record {index} at step {step}")
        record = trace.records[index]
        inputs = [trace.records[k] for k in record.inputs]
        tensors: list[bytes] = []
        if not record.is_leaf and record.name != STATE_OP:
            tensors = [canonical_bytes(trace.outputs[k]) for k in record.inputs]  # type: ignore[arg-type]
        names: list[str] = []
        hashes: list[bytes] = []
        if record.is_leaf:
            before = self.states[step]
            names = sorted(before)
            hashes = [tensor_hash(before[name]) for name in names]
        prev_record, prev_path = b"", []
        if step and index < len(self.records[step - 1]):
            prev_record = encode_record(self.records[step - 1][index])
            prev_path = self.trees[step - 1].prove(index)
        return OpOpenAnswer(
            encode_record(record),
            trace.tree.prove(index, index + 1),
            [encode_record(r) for r in inputs],
            [trace.tree.prove(k, index) for k in record.inputs],
            tensors,
            names,
            hashes,
            prev_record,
            prev_path,
        )
