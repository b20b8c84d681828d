"""RepOps by dispatch: any torch model's training step, reproducible, through a
``TorchDispatchMode`` (``mode``) that maps each aten operator onto the RepOps kernels of
``verify.repops`` (``aten``), with a numpy twin of every mapping (``reference``)."""

from verify.dispatch.aten import EXACT, HANDLERS, UnmappedOperator
from verify.dispatch.mode import RepOpsMode, Survey, survey

__all__ = ["EXACT", "HANDLERS", "RepOpsMode", "Survey", "UnmappedOperator", "survey"]
