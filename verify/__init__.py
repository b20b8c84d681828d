"""How we know results are honest: reproducible operators (RepOps), commitments, the Verde dispute
game and its referee.

``verify.repops.step`` and ``verify.trace`` import no networking. The dispute game
(``verify.dispute.game``, its messages in ``verify.dispute.wire``) is a sans-IO state machine; its
trio driver over ``p2p`` is ``verify.dispute.driver`` (``serve_provider``, ``run_referee``).
``verify.trace`` is the contract between the two halves: what a traced step records, how tensors
and states are hashed. This package imports nothing of ``diloco`` or ``swarm``.
"""

from verify.commit import (
    Commitment,
    MerkleTree,
    StepLeaf,
    StepTrace,
    TaskSpec,
    tensor_from_canonical,
    verify_append,
    verify_consistency,
    verify_proof,
)
from verify.dispute.game import (
    Answered,
    Failed,
    Finish,
    Query,
    Referee,
    RefereeConfig,
    Timeout,
    Verdict,
)
from verify.dispute.provider import Provider
from verify.repops.graph import param_shapes
from verify.repops.step import (
    DEFAULT_SHAPE,
    AdamWConfig,
    ModelShape,
    RepOpsStep,
    batch_for,
    gradients,
    init_params,
    initial_state,
    nesterov_step,
    run_op,
    step_loss,
    train_step,
)
from verify.trace import (
    LEAF_PREFIX,
    OpRecord,
    Recompute,
    StepResult,
    TracedStep,
    canonical_bytes,
    state_hash,
    state_hash_of,
    tensor_hash,
)

__all__ = [
    "DEFAULT_SHAPE",
    "LEAF_PREFIX",
    "AdamWConfig",
    "Answered",
    "Commitment",
    "Failed",
    "Finish",
    "MerkleTree",
    "ModelShape",
    "OpRecord",
    "Provider",
    "Query",
    "Recompute",
    "Referee",
    "RefereeConfig",
    "RepOpsStep",
    "StepLeaf",
    "StepResult",
    "StepTrace",
    "TaskSpec",
    "Timeout",
    "TracedStep",
    "Verdict",
    "batch_for",
    "canonical_bytes",
    "gradients",
    "init_params",
    "initial_state",
    "nesterov_step",
    "param_shapes",
    "run_op",
    "state_hash",
    "state_hash_of",
    "step_loss",
    "tensor_from_canonical",
    "tensor_hash",
    "train_step",
    "verify_append",
    "verify_consistency",
    "verify_proof",
]
