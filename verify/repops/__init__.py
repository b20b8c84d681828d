"""Reproducible operators: the fixed-order kernels (``ops``, C kernels in ``native``), the
backend-free training program (``graph``), one traced training step (``step``), and an independent
numpy implementation of every operator (``reference``).
"""

from verify.repops.step import (
    AdamWConfig,
    ModelShape,
    RepOpsStep,
    init_params,
    initial_state,
    run_op,
    step_loss,
    train_step,
)

__all__ = [
    "AdamWConfig",
    "ModelShape",
    "RepOpsStep",
    "init_params",
    "initial_state",
    "run_op",
    "step_loss",
    "train_step",
]
