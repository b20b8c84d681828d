"""Wire messages of the dispute game (codes 200-219), referee -> provider and back.

Every query names the task by ``task_id`` so one provider can serve several tasks. Records travel
as ``commit.encode_record`` bytes, step leaves as ``StepLeaf.encode`` bytes and tensors as
``trace.canonical_bytes``, so every field is a typed scalar or list the wire layer checks, and the
referee hashes exactly the bytes it received. Proofs are lists of 32-byte hashes (at most 64).
Limits are per type and checked on the frame header before the body is read: only the operator
opening carries tensors, hence its large limit.
"""

from __future__ import annotations

from p2p import Message, message

MAX_PROOF = 64
QUERY_BYTES = 256
PREFIX_BYTES = 64 * 34 + 128
STEP_OPEN_BYTES = 1 << 20
OP_OPEN_BYTES = 256 << 20

PROTOCOL_COMMITMENT = "/swarmtrain/verify/commitment/1"
PROTOCOL_STEP_PREFIX = "/swarmtrain/verify/step-prefix/1"
PROTOCOL_STEP_OPEN = "/swarmtrain/verify/step-open/1"
PROTOCOL_OP_PREFIX = "/swarmtrain/verify/op-prefix/1"
PROTOCOL_OP_OPEN = "/swarmtrain/verify/op-open/1"


@message(200, max_bytes=QUERY_BYTES)
class CommitmentQuery(Message):
    task_id: bytes


@message(201, max_bytes=QUERY_BYTES)
class CommitmentAnswer(Message):
    steps: int
    task_root: bytes
    final_state_hash: bytes


@message(202, max_bytes=QUERY_BYTES)
class StepPrefixQuery(Message):
    """The root over the first ``size`` step leaves and its consistency proof to the task root."""

    task_id: bytes
    size: int


@message(203, max_bytes=QUERY_BYTES)
class OpPrefixQuery(Message):
    """The root over the first ``size`` records of ``step`` and its proof to the trace root."""

    task_id: bytes
    step: int
    size: int


@message(204, max_bytes=PREFIX_BYTES)
class PrefixAnswer(Message):
    root: bytes
    proof: list[bytes]


@message(205, max_bytes=QUERY_BYTES)
class StepOpenQuery(Message):
    """Open step leaf ``step`` (and the one before it, which both sides agree on)."""

    task_id: bytes
    step: int


@message(206, max_bytes=STEP_OPEN_BYTES)
class StepOpenAnswer(Message):
    leaf: bytes
    path: list[bytes]  # prove(step, step + 1): appends the leaf to the agreed prefix
    prev_leaf: bytes  # b"" for step 0
    prev_path: list[bytes]
    last_record: bytes  # the trace's commit:state record, binding the leaf's state hash
    last_path: list[bytes]


@message(207, max_bytes=QUERY_BYTES)
class OpOpenQuery(Message):
    task_id: bytes
    step: int
    index: int


@message(208, max_bytes=OP_OPEN_BYTES)
class OpOpenAnswer(Message):
    """Record ``index``, its inputs' records (proved in the agreed prefix) and tensors.

    ``tensors`` are the inputs' values, empty for leaves and the state record (whose check needs
    hashes only); ``state_names``/``state_hashes`` are the state before the step, for a leaf;
    ``prev_record`` settles a disagreement on the graph itself (see ``Referee``).
    """

    record: bytes
    path: list[bytes]
    input_records: list[bytes]
    input_paths: list[list[bytes]]
    tensors: list[bytes]
    state_names: list[str]
    state_hashes: list[bytes]
    prev_record: bytes  # record ``index`` of the previous step (b"" at step 0 or past its end)
    prev_path: list[bytes]


QUERY_TYPES: dict[type[Message], str] = {
    CommitmentQuery: PROTOCOL_COMMITMENT,
    StepPrefixQuery: PROTOCOL_STEP_PREFIX,
    StepOpenQuery: PROTOCOL_STEP_OPEN,
    OpPrefixQuery: PROTOCOL_OP_PREFIX,
    OpOpenQuery: PROTOCOL_OP_OPEN,
}
ANSWER_TYPES: dict[type[Message], type[Message]] = {
    CommitmentQuery: CommitmentAnswer,
    StepPrefixQuery: PrefixAnswer,
    StepOpenQuery: StepOpenAnswer,
    OpPrefixQuery: PrefixAnswer,
    OpOpenQuery: OpOpenAnswer,
}
