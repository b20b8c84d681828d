"""RepOps by dispatch: any torch model's training step, reproducible, through a
``TorchDispatchMode`` (``mode``) that maps each aten operator onto the RepOps kernels of
``verify.repops`` (``aten``), with a numpy twin of every mapping (``reference``); and the step's
trace for the dispute game as the dispatch log: each aten call recorded (``calls``, ``record``),
any model's traced AdamW step (``traced``), one record recomputed by the referee
(``recompute``)."""

from verify.dispatch.aten import EXACT, HANDLERS, UnmappedOperator
from verify.dispatch.mode import RepOpsMode, Survey, survey
from verify.dispatch.record import CONST_OP, Recorder, TraceError, recompute, tamperable
from verify.dispatch.traced import STEP_KEY, AdamWSettings, DispatchStep

__all__ = [
    "CONST_OP",
    "EXACT",
    "HANDLERS",
    "STEP_KEY",
    "AdamWSettings",
    "DispatchStep",
    "Recorder",
    "RepOpsMode",
    "Survey",
    "TraceError",
    "UnmappedOperator",
    "recompute",
    "survey",
    "tamperable",
]
