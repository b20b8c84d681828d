"""How we know results are honest: reproducible operators (RepOps), commitments, the Verde dispute
game and its referee.

``verify.repops`` imports no networking at all; the dispute game (``verify.dispute``) is a sans-IO
state machine and its trio driver (``verify.dispute_driver``: ``serve_provider``, ``run_referee``)
speaks over ``p2p``; it is imported from there, so that importing this package pulls in no
networking. This package imports nothing of ``diloco`` or ``swarm``. ``verify.trace`` is the
contract between the two halves: what a traced step records and how tensors and states are hashed.
"""

from verify.commit import (
    Commitment,
    MerkleTree,
    StepLeaf,
    StepTrace,
    TaskSpec,
    verify_append,
    verify_consistency,
    verify_proof,
)
from verify.dispute import (
    Answered,
    Failed,
    Finish,
    Query,
    Referee,
    RefereeConfig,
    Timeout,
    Verdict,
)
from verify.provider import Provider
from verify.trace import OpRecord, StepResult, TracedStep, state_hash, tensor_hash

__all__ = [
    "Answered",
    "Commitment",
    "Failed",
    "Finish",
    "MerkleTree",
    "OpRecord",
    "Provider",
    "Query",
    "Referee",
    "RefereeConfig",
    "StepLeaf",
    "StepResult",
    "StepTrace",
    "TaskSpec",
    "Timeout",
    "TracedStep",
    "Verdict",
    "state_hash",
    "tensor_hash",
    "verify_append",
    "verify_consistency",
    "verify_proof",
]
