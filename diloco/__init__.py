"""How training proceeds: DiLoCo's inner/outer optimization, its shared state (on disk between
rounds: ``StateStore``), checkpoints, the embedded default model and corpus, a ``transformers``
causal LM built from its config (``causal_lm``) and a user's local text or token files
(``datasets``).

``DiLoCo`` wraps a torch model and inner optimizer; averaging is injected as an ``Average``
callable (the swarm all-reduce in a real run, ``LocalAverage`` in one process). Everything that
must be bit-identical across peers (``GlobalState``, ``nesterov_update``, ``weighted_mean``) is
plain float32/float64 tensor arithmetic with a fixed order. This package imports nothing of ours.

A training script (one peer; in a real run ``average`` is the swarm all-reduce's callable)::

    import torch
    from diloco import ByteTransformer, DiLoCo, LocalAverage, inner_batches, load_stdlib_corpus

    model = ByteTransformer(seed=0)  # every peer builds the same round-0 params from the seed
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3)
    corpus = load_stdlib_corpus()
    with DiLoCo(model, inner, LocalAverage(1).member("me"), inner_steps=100) as diloco:
        for _ in range(10):  # rounds
            for inputs, targets in inner_batches(
                corpus, run_seed=0, round=diloco.round, peer_id=b"me",
                steps=100, batch_size=8, context=128,
            ):
                model.loss(inputs, targets).backward()
                diloco.step(samples=inputs.numel())  # the 100th step runs the outer round
                diloco.zero_grad()
            print(diloco.round, diloco.state_hash())
"""

from diloco.averaging import Average, AverageOutcome, AveragingFailed, LocalAverage, weighted_mean
from diloco.causal_lm import (
    CausalLM,
    ModelError,
    build_causal_lm,
    check_fits,
    load_pretrained,
    pretrained_sha256,
)
from diloco.checkpoint import Checkpoint, load_latest
from diloco.checkpoint import save as save_checkpoint
from diloco.data import (
    Corpus,
    DataError,
    assignment_seed,
    check_sizes,
    eval_batches,
    evaluate,
    inner_batches,
    is_heldout,
    load_stdlib_corpus,
    validation_split,
)
from diloco.datasets import load_datasets_corpus, load_text_corpus, load_token_corpus
from diloco.fragments import Fragment, fragment_at, fragments_of
from diloco.loop import DiLoCo, DiLoCoStatistics, RoundOutcome
from diloco.model import VOCAB_SIZE, ByteTransformer, ByteTransformerConfig
from diloco.outer import OuterConfig, nesterov_update, outer_step, skipped_round
from diloco.schedule import SCHEDULES, lr_factor
from diloco.state import GlobalState, layout_digest
from diloco.store import StateStore, TornState

__all__ = [
    "SCHEDULES",
    "VOCAB_SIZE",
    "Average",
    "AverageOutcome",
    "AveragingFailed",
    "ByteTransformer",
    "ByteTransformerConfig",
    "CausalLM",
    "Checkpoint",
    "Corpus",
    "DataError",
    "DiLoCo",
    "DiLoCoStatistics",
    "Fragment",
    "GlobalState",
    "LocalAverage",
    "ModelError",
    "OuterConfig",
    "RoundOutcome",
    "StateStore",
    "TornState",
    "assignment_seed",
    "build_causal_lm",
    "check_fits",
    "check_sizes",
    "eval_batches",
    "evaluate",
    "fragment_at",
    "fragments_of",
    "inner_batches",
    "is_heldout",
    "layout_digest",
    "load_datasets_corpus",
    "load_latest",
    "load_pretrained",
    "load_stdlib_corpus",
    "load_text_corpus",
    "load_token_corpus",
    "lr_factor",
    "nesterov_update",
    "outer_step",
    "pretrained_sha256",
    "save_checkpoint",
    "skipped_round",
    "validation_split",
    "weighted_mean",
]
