"""How training proceeds: DiLoCo's inner/outer optimization, its shared state, checkpoints, and
the embedded default model and corpus.

``DiLoCo`` wraps a torch model and inner optimizer; averaging is injected as an ``Average``
callable (the swarm all-reduce in a real run, ``LocalAverage`` in one process). Everything that
must be bit-identical across peers (``GlobalState``, ``nesterov_update``, ``weighted_mean``) is
plain float32/float64 tensor arithmetic with a fixed order. This package imports nothing of ours.
"""

from diloco.averaging import Average, AverageOutcome, AveragingFailed, LocalAverage, weighted_mean
from diloco.checkpoint import Checkpoint, load_latest
from diloco.checkpoint import save as save_checkpoint
from diloco.data import (
    Corpus,
    assignment_seed,
    eval_batches,
    evaluate,
    inner_batches,
    is_heldout,
    load_stdlib_corpus,
)
from diloco.loop import DiLoCo, DiLoCoStatistics
from diloco.model import VOCAB_SIZE, ByteTransformer, ByteTransformerConfig
from diloco.outer import OuterConfig, nesterov_update, outer_step, skipped_round
from diloco.state import GlobalState, layout_digest

__all__ = [
    "VOCAB_SIZE",
    "Average",
    "AverageOutcome",
    "AveragingFailed",
    "ByteTransformer",
    "ByteTransformerConfig",
    "Checkpoint",
    "Corpus",
    "DiLoCo",
    "DiLoCoStatistics",
    "GlobalState",
    "LocalAverage",
    "OuterConfig",
    "assignment_seed",
    "eval_batches",
    "evaluate",
    "inner_batches",
    "is_heldout",
    "layout_digest",
    "load_latest",
    "load_stdlib_corpus",
    "nesterov_update",
    "outer_step",
    "save_checkpoint",
    "skipped_round",
    "weighted_mean",
]
