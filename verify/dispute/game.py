"""The Verde dispute game, referee side, as a sans-IO state machine.

Two providers (parties 0 and 1) ran the same task and the referee must name the one who lied.
The machine never touches a socket, clock or random number: ``start(now)`` and
``handle(event, now)`` return actions (``Query`` a party, ``Finish`` with a ``Verdict``); the
driver sends queries, feeds back ``Answered`` / ``Failed`` / ``Timeout`` events, and fires
``Timeout`` when ``deadline`` passes. Theory of operation:

1. COMMITMENTS: both parties state ``(steps, task_root, final_state_hash)``. Equal: no dispute.
2. STEPS: bisect ``[lo, hi)`` over step leaves. ``lo`` is a prefix size both agree on (0 at
   first: the empty tree), ``hi`` one they differ on (S at first: the task roots). Each round asks
   both for the prefix root at ``mid`` with a consistency proof to their own task root. Equal
   prefix roots mean equal leaves below ``mid`` (collision resistance), so the predicate is
   monotone and ceil(log2 S) rounds leave ``hi = lo + 1``: step ``lo`` diverges from an agreed
   state.
3. STEP_OPEN: each opens leaf ``lo`` as an append to the agreed prefix, the agreed leaf before it
   (for the state hash the step starts from) and its trace's last record, which must be the
   ``commit:state`` record carrying the leaf's state hash (a provider whose leaf's state hash is
   not what its own trace says loses here).
4. OP_HEAD: only if the traces have different lengths: both give the prefix root at the shorter
   length. Agreement there means one trace is the other plus extra records after its state record.
5. OPS: the same bisection over the step's records, ceil(log2 ops) rounds.
6. OP_OPEN: each opens the divergent record as an append to the agreed record prefix, every input
   record proved in that agreed prefix and every input tensor with its hash. The referee checks
   the one operator: a ``Recompute`` for an operator, the agreed state (by hash) for a parameter
   leaf, an injected data oracle for a data leaf, the ``state_hash`` of the inputs' hashes for the
   state record. Whoever's output differs from the referee's is named.

Any answer that does not verify, is malformed, or comes after the deadline loses at once. When the
two divergent records disagree on the operator graph itself (name, inputs or attrs), the agreed
previous step's record at that index is the program if ``same_program_every_step`` is set (see
``_graph_dispute``). A dispute the referee cannot settle ends with no one named and the reason: a
graph dispute at step 0 or without that flag (it would need a commitment to the program, which
this version does not take), a data leaf with no oracle, or an operator ``Recompute`` refuses.

About 500 lines, over the usual 400, on purpose: every transition and every check an answer must
pass live in this one file (h11's rule for ``_state.py``), so what can make a party lose is read
in one place.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p import LocalProtocolError, Message
from verify.commit import (
    EMPTY_ROOT,
    HASH_BYTES,
    STATE_OP,
    Commitment,
    StepLeaf,
    TaskSpec,
    decode_record,
    hash_of_named,
    record_leaf,
    state_names,
    tensor_from_canonical,
    verify_append,
    verify_consistency,
    verify_proof,
)
from verify.dispute.wire import (
    MAX_PROOF,
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
from verify.trace import LEAF_PREFIX, OpRecord, Recompute, tensor_hash

PARTIES = (0, 1)
LeafOracle = Callable[[int, str, bytes], bytes | None]


class Stage(enum.Enum):
    COMMITMENTS = "commitments"
    STEPS = "steps"
    STEP_OPEN = "step_open"
    OP_HEAD = "op_head"
    OPS = "ops"
    OP_OPEN = "op_open"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Verdict:
    """How a dispute ended; no ``cheaters``: no dispute (``agreed``) or undecided (``reason``)."""

    cheaters: tuple[int, ...]
    reason: str
    agreed: bool = False
    step: int | None = None
    op: int | None = None
    op_name: str | None = None
    rounds: int = 0
    ops_recomputed: int = 0
    final_state_hashes: tuple[bytes, ...] = ()


# Events (facts the driver reports) and actions (orders it carries out).
@dataclass(frozen=True, slots=True)
class Answered:
    party: int
    answer: Message


@dataclass(frozen=True, slots=True)
class Failed:
    """The party's answer could not be had: bad bytes, an error reply, a broken stream."""

    party: int
    reason: str


@dataclass(frozen=True, slots=True)
class Timeout:
    party: int


@dataclass(frozen=True, slots=True)
class Query:
    party: int
    request: Message


@dataclass(frozen=True, slots=True)
class Finish:
    verdict: Verdict


Event = Answered | Failed | Timeout
Action = Query | Finish


@dataclass(frozen=True, slots=True)
class RefereeConfig:
    answer_timeout_s: float = 30.0
    max_ops: int = 1 << 24  # a trace longer than this is refused, so bisection stays bounded
    # The step's operator graph does not depend on the step index (true of RepOpsStep and
    # ToyTask: the step counter and schedule live in the state, not in attrs). Lets the referee
    # settle a graph dispute at step s > 0 against the agreed graph of step s - 1.
    same_program_every_step: bool = False


class _Lost(Exception):
    """An answer that does not verify: its sender loses."""


@dataclass
class _Round:
    queries: dict[int, Message]
    deadline: float
    results: dict[int, object] = field(default_factory=dict)


class Referee:
    """The referee's side of one dispute. See the module docstring for the stages."""

    def __init__(
        self,
        task: TaskSpec,
        recompute: Recompute,
        *,
        leaf_oracle: LeafOracle | None = None,
        config: RefereeConfig | None = None,
    ) -> None:
        self.task = task
        self.recompute = recompute
        self.leaf_oracle = leaf_oracle
        self.config = config or RefereeConfig()
        self.stage = Stage.COMMITMENTS
        self.rounds = 0
        self.ops_recomputed = 0
        self.verdict: Verdict | None = None
        self._round: _Round | None = None
        self._commitments: list[Commitment] = []
        self._lo, self._hi = 0, 0
        self._agreed_root = EMPTY_ROOT
        self._hi_roots: list[bytes] = []
        self._step = -1
        self._leaves: list[StepLeaf] = []
        self._prev_state_hash = task.start_state_hash
        self._prev_leaf: StepLeaf | None = None

    @property
    def deadline(self) -> float:
        return self._round.deadline if self._round else math.inf

    @property
    def pending(self) -> tuple[int, ...]:
        if self._round is None:
            return ()
        return tuple(p for p in self._round.queries if p not in self._round.results)

    def start(self, now: float) -> list[Action]:
        if self.rounds:
            raise LocalProtocolError("the dispute has already started")
        return self._ask(now, {p: CommitmentQuery(self.task.task_id) for p in PARTIES})

    def handle(self, event: Event, now: float) -> list[Action]:
        """Take one event; return the queries of the next round or the ``Finish``.

        Raises ``LocalProtocolError`` for an event about a party we are not waiting for (a driver
        bug: late events after ``Finish`` must not be fed).
        """
        if event.party not in self.pending:
            raise LocalProtocolError(f"no query pending for party {event.party} ({self.stage})")
        assert self._round is not None
        if isinstance(event, Timeout):
            late = tuple(p for p in self.pending if now >= self._round.deadline)
            return self._finish(late or (event.party,), "no answer by the deadline")
        if isinstance(event, Failed):
            return self._finish((event.party,), f"bad answer: {event.reason}")
        try:
            self._round.results[event.party] = self._check(event.party, event.answer)
        except _Lost as exc:
            return self._finish((event.party,), f"answer did not verify: {exc}")
        if self.pending:
            return []
        return self._advance(now)

    # Rounds ----------------------------------------------------------------------------------

    def _ask(self, now: float, queries: dict[int, Message]) -> list[Action]:
        self.rounds += 1
        self._round = _Round(queries, now + self.config.answer_timeout_s)
        return [Query(p, q) for p, q in queries.items()]

    def _finish(self, cheaters: tuple[int, ...], reason: str, **where: object) -> list[Action]:
        if self.stage not in (Stage.COMMITMENTS, Stage.STEPS):
            where.setdefault("step", self._step)
        self.stage = Stage.DONE
        self._round = None
        verdict = Verdict(
            tuple(sorted(cheaters)),
            reason,
            rounds=self.rounds,
            ops_recomputed=self.ops_recomputed,
            final_state_hashes=tuple(c.final_state_hash for c in self._commitments),
            **where,  # type: ignore[arg-type]
        )
        self.verdict = verdict
        return [Finish(verdict)]

    def _check(self, party: int, answer: Message) -> object:
        """Verify one answer against that party's own commitments; ``_Lost`` if it fails."""
        assert self._round is not None
        query = self._round.queries[party]
        checker = {
            CommitmentQuery: (CommitmentAnswer, self._check_commitment),
            StepPrefixQuery: (PrefixAnswer, self._check_prefix),
            OpPrefixQuery: (PrefixAnswer, self._check_prefix),
            StepOpenQuery: (StepOpenAnswer, self._check_step_open),
            OpOpenQuery: (OpOpenAnswer, self._check_op_open),
        }[type(query)]
        if not isinstance(answer, checker[0]):
            raise _Lost(f"{type(answer).__name__} answers {type(query).__name__}")
        try:
            return checker[1](party, query, answer)  # type: ignore[operator]
        except ValueError as exc:  # from the decoders of records, leaves and tensors
            raise _Lost(str(exc)) from exc

    def _advance(self, now: float) -> list[Action]:
        assert self._round is not None
        results = self._round.results
        if self.stage is Stage.COMMITMENTS:
            self._commitments = [results[p] for p in PARTIES]  # type: ignore[misc]
            a, b = self._commitments
            if a == b:
                self.stage = Stage.DONE
                self.verdict = Verdict(
                    (),
                    "commitments agree",
                    agreed=True,
                    rounds=self.rounds,
                    final_state_hashes=(a.final_state_hash,) * 2,
                )
                return [Finish(self.verdict)]
            self._lo, self._hi = 0, self.task.steps
            # Equal roots with different final claims bisect too: every prefix agrees, so the
            # last step is opened and its leaf tells whose final state hash is not committed.
            self._hi_roots = [c.task_root for c in self._commitments]
            self.stage = Stage.STEPS
        elif self.stage in (Stage.STEPS, Stage.OPS):
            roots = [results[p] for p in PARTIES]
            if roots[0] == roots[1]:
                self._lo, self._agreed_root = self._mid, roots[0]  # type: ignore[assignment]
            else:
                self._hi, self._hi_roots = self._mid, roots  # type: ignore[assignment]
        elif self.stage is Stage.STEP_OPEN:
            return self._after_step_open(now)
        elif self.stage is Stage.OP_HEAD:
            roots = [results[p] for p in PARTIES]
            if roots[0] == roots[1]:
                return self._extra_records()
            self._hi_roots = roots  # type: ignore[assignment]
            self.stage = Stage.OPS
        elif self.stage is Stage.OP_OPEN:
            return self._decide()
        return self._next_query(now)

    def _next_query(self, now: float) -> list[Action]:
        task_id = self.task.task_id
        if self._hi - self._lo > 1:
            self._mid = (self._lo + self._hi) // 2
            if self.stage is Stage.STEPS:
                return self._ask(now, {p: StepPrefixQuery(task_id, self._mid) for p in PARTIES})
            return self._ask(
                now, {p: OpPrefixQuery(task_id, self._step, self._mid) for p in PARTIES}
            )
        if self.stage is Stage.STEPS:
            self.stage, self._step = Stage.STEP_OPEN, self._lo
            return self._ask(now, {p: StepOpenQuery(task_id, self._step) for p in PARTIES})
        self.stage = Stage.OP_OPEN
        return self._ask(now, {p: OpOpenQuery(task_id, self._step, self._lo) for p in PARTIES})

    def _after_step_open(self, now: float) -> list[Action]:
        assert self._round is not None
        opened = [self._round.results[p] for p in PARTIES]
        self._leaves = [leaf for leaf, _ in opened]  # type: ignore[misc]
        self._prev_leaf = opened[0][1]  # type: ignore[index]
        if self._prev_leaf is not None:
            self._prev_state_hash = self._prev_leaf.state_hash
        a, b = self._leaves
        claims = [c.final_state_hash for c in self._commitments]
        if a == b and self._step == self.task.steps - 1 and claims[0] != claims[1]:
            # Roots agree; the last leaf is the truth about the final state.
            liars = tuple(p for p in PARTIES if claims[p] != a.state_hash)
            return self._finish(liars, "final state hash differs from the committed last step")
        if a.trace_root == b.trace_root and a.n_ops == b.n_ops:
            # Same trace, same state record, so (both having passed the state check) same leaf:
            # only a hash collision gets here.
            return self._finish((), "the providers opened the same step leaf")
        self._agreed_root, self._lo = EMPTY_ROOT, 0
        self._hi = min(a.n_ops, b.n_ops)
        self._hi_roots = [leaf.trace_root for leaf in self._leaves]
        if a.n_ops != b.n_ops:
            self.stage, self._mid = Stage.OP_HEAD, self._hi
            query = OpPrefixQuery(self.task.task_id, self._step, self._hi)
            return self._ask(now, {p: query for p in PARTIES})
        self.stage = Stage.OPS
        return self._next_query(now)

    def _extra_records(self) -> list[Action]:
        # The shorter trace is a prefix of the longer one and ends in its state record (checked
        # when the leaf was opened), so the longer one has records after a state record.
        longer = max(PARTIES, key=lambda p: self._leaves[p].n_ops)
        return self._finish((longer,), "records after the step's state record", op=self._hi)

    # Checks of one party's answer ------------------------------------------------------------

    def _check_commitment(self, party: int, q: Message, a: CommitmentAnswer) -> Commitment:
        if a.steps != self.task.steps:
            raise _Lost(f"committed {a.steps} steps, the task has {self.task.steps}")
        if len(a.task_root) != HASH_BYTES or len(a.final_state_hash) != HASH_BYTES:
            raise _Lost("hashes must be 32 bytes")
        return Commitment(a.steps, a.task_root, a.final_state_hash)

    def _check_prefix(self, party: int, q: Message, a: PrefixAnswer) -> bytes:
        if self.stage in (Stage.STEPS,):
            new_root, new_size = self._commitments[party].task_root, self.task.steps
        else:
            leaf = self._leaves[party]
            new_root, new_size = leaf.trace_root, leaf.n_ops
        size = q.size  # type: ignore[attr-defined]
        if len(a.root) != HASH_BYTES or len(a.proof) > MAX_PROOF:
            raise _Lost("malformed prefix answer")
        if not verify_consistency(a.root, size, new_root, new_size, a.proof):
            raise _Lost(f"prefix {size} is not consistent with the committed root")
        return a.root

    def _check_step_open(
        self, party: int, q: Message, a: StepOpenAnswer
    ) -> tuple[StepLeaf, StepLeaf | None]:
        step = self._step
        leaf = StepLeaf.decode(a.leaf)
        if leaf.step != step or not 1 <= leaf.n_ops <= self.config.max_ops:
            raise _Lost(f"leaf for step {leaf.step} with {leaf.n_ops} ops")
        if not verify_append(self._agreed_root, self._hi_roots[party], step + 1, leaf.hash, a.path):
            raise _Lost(f"step {step} leaf does not extend the agreed prefix")
        prev = None
        if step:
            prev = StepLeaf.decode(a.prev_leaf)
            if prev.step != step - 1 or not verify_proof(
                self._agreed_root, step - 1, step, prev.hash, a.prev_path
            ):
                raise _Lost(f"step {step - 1} leaf is not in the agreed prefix")
        elif a.prev_leaf or a.prev_path:
            raise _Lost("step 0 has no previous leaf")
        last = decode_record(a.last_record)
        if not verify_proof(
            leaf.trace_root, leaf.n_ops - 1, leaf.n_ops, record_leaf(last), a.last_path
        ):
            raise _Lost("last record is not in the trace")
        if last.name != STATE_OP or last.output != leaf.state_hash:
            raise _Lost("the step's state hash is not its trace's state record")
        return leaf, prev

    def _check_op_open(self, party: int, q: Message, a: OpOpenAnswer) -> tuple[OpRecord, list]:
        index = self._lo
        record = decode_record(a.record)
        if not verify_append(
            self._agreed_root, self._hi_roots[party], index + 1, record_leaf(record), a.path
        ):
            raise _Lost(f"record {index} does not extend the agreed prefix")
        if any(k >= index for k in record.inputs) or len(a.input_records) != len(record.inputs):
            raise _Lost("inputs must be earlier records, each opened")
        if len(a.input_paths) != len(record.inputs):
            raise _Lost("one path per input")
        inputs = [decode_record(raw) for raw in a.input_records]
        for k, rec, path in zip(record.inputs, inputs, a.input_paths, strict=True):
            if not verify_proof(self._agreed_root, k, index, record_leaf(rec), path):
                raise _Lost(f"input record {k} is not in the agreed prefix")
        is_leaf = record.is_leaf
        if is_leaf and record.inputs:
            raise _Lost("a leaf has no inputs")
        if record.name == STATE_OP:
            # A state record that is not the hash of what it binds is wrong whatever it binds.
            keys = state_names(record)
            bound = {k: rec.output for k, rec in zip(keys, inputs, strict=True)}
            if hash_of_named(bound) != record.output:
                raise _Lost("the state record's output is not the hash of the state it binds")
        needs_tensors = not is_leaf and record.name != STATE_OP
        if len(a.tensors) != (len(inputs) if needs_tensors else 0):
            raise _Lost("wrong number of input tensors")
        tensors = []
        for rec, raw in zip(inputs, a.tensors, strict=False):
            array = tensor_from_canonical(raw)  # hash the bytes as sent, decode them checked
            if tensor_hash(array) != rec.output:
                raise _Lost("an input tensor does not match its record")
            tensors.append(array)
        names = {}
        if is_leaf:
            if len(a.state_names) != len(a.state_hashes) or any(
                len(h) != HASH_BYTES for h in a.state_hashes
            ):
                raise _Lost("malformed state manifest")
            names = dict(zip(a.state_names, a.state_hashes, strict=True))
            if len(names) != len(a.state_names) or hash_of_named(names) != self._prev_state_hash:
                raise _Lost("state manifest does not hash to the agreed state")
        return record, [inputs, tensors, names, self._check_prev_record(index, a)]

    def _check_prev_record(self, index: int, a: OpOpenAnswer) -> OpRecord | None:
        """Record ``index`` of the previous step's trace, which both sides agree on."""
        prev = self._prev_leaf
        if prev is None or index >= prev.n_ops:
            if a.prev_record or a.prev_path:
                raise _Lost("there is no such record in the previous step")
            return None
        record = decode_record(a.prev_record)
        if not verify_proof(prev.trace_root, index, prev.n_ops, record_leaf(record), a.prev_path):
            raise _Lost(f"record {index} of the previous step is not in its trace")
        return record

    # The one computation ---------------------------------------------------------------------

    def _decide(self) -> list[Action]:
        assert self._round is not None
        opened = [self._round.results[p] for p in PARTIES]
        records: list[OpRecord] = [o[0] for o in opened]  # type: ignore[index]
        inputs, tensors, names, prev = opened[0][1]  # type: ignore[index,misc]
        where = {"op": self._lo}
        a, b = records
        if _structure(a) != _structure(b):
            return self._graph_dispute(records, prev, where)
        where["op_name"] = a.name  # type: ignore[assignment]
        expected: bytes | None
        if a.is_leaf:
            label = a.name[len(LEAF_PREFIX) :]
            expected = names.get(label)
            if expected is None and self.leaf_oracle is not None:
                expected = self.leaf_oracle(self._step, label, a.attrs)
            if expected is None:
                return self._finish((), f"no way to check leaf {label!r}", **where)
        elif a.name == STATE_OP:
            keys = state_names(a)
            expected = hash_of_named({k: rec.output for k, rec in zip(keys, inputs, strict=True)})
        else:
            self.ops_recomputed += 1
            try:
                expected = tensor_hash(self.recompute(a.name, tensors, a.attrs))
            except Exception as exc:  # the injected operator refused: an undecidable graph
                return self._finish((), f"{a.name} could not be recomputed: {exc}", **where)
        liars = tuple(p for p in PARTIES if records[p].output != expected)
        return self._finish(liars, "output differs from the referee's", **where)

    def _graph_dispute(
        self, records: list[OpRecord], prev: OpRecord | None, where: dict
    ) -> list[Action]:
        """The two records differ in name, inputs or attrs: which graph is the program's?

        Both state records hash what they bind (checked on arrival): equal outputs are two
        equivalent bindings and nobody lied about the state. Otherwise, when the step's graph is
        the same every step (``RefereeConfig.same_program_every_step``), the agreed previous
        step's record at this index is the program: the one provider that departs from it loses.
        Step 0 has no previous step, so a graph dispute there stays undecided.
        """
        a, b = records
        if a.name == b.name:
            where["op_name"] = a.name
        if a.name == b.name == STATE_OP and a.output == b.output:
            return self._finish((), "equivalent state bindings", **where)
        if self.config.same_program_every_step and prev is not None:
            faithful = [p for p in PARTIES if _structure(records[p]) == _structure(prev)]
            if len(faithful) == 1:
                liar = 1 - faithful[0]
                where["op_name"] = records[liar].name
                return self._finish((liar,), "operator graph differs from the previous step's",
                                    **where)  # fmt: skip
        return self._finish((), "the providers disagree on the operator graph", **where)


def _structure(record: OpRecord) -> tuple[str, tuple[int, ...], bytes]:
    return record.name, record.inputs, record.attrs
