"""What a DiLoCo run trains, from its spec: the model (``[model] kind``) and the data
(``[data] kind``), and the checks that refuse a node whose local files do not match the spec.

The coordinator fills in the data fingerprint from its own copy when it signs the spec
(``with_data_fingerprint``); every node computes the fingerprint of its copy and refuses to train
when the two differ (``check_data``), so peers never train silently on different text, a
different tokenizer or another Python's standard library. Every check runs before anything
trains and raises a ``ValueError`` (``WorkloadError``, ``DataError``, ``ModelError``) whose one
line names the key or the file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from diloco import (
    ByteTransformer,
    Corpus,
    build_causal_lm,
    check_fits,
    check_sizes,
    load_datasets_corpus,
    load_pretrained,
    load_stdlib_corpus,
    load_text_corpus,
    load_token_corpus,
    pretrained_sha256,
)
from swarmtrain.config import RunConfig, run_seed_of, with_base
from swarmtrain.pipeline.roles import shape_of


class WorkloadError(ValueError):
    """The spec and this node's data disagree; the message names the key and both values."""


def load_data(config: RunConfig) -> Corpus:
    """The corpus ``[data]`` names, read from this machine. Raises DataError (absent or bad
    files, naming the key or the file), or ValueError for a stdlib corpus too small to split."""
    data = config.data
    if data.kind == "text":
        return load_text_corpus(data.paths, field=data.field, tokenizer=data.tokenizer)
    if data.kind == "tokens":
        return load_token_corpus(data.paths, dtype=data.dtype)
    if data.kind == "datasets":
        return load_datasets_corpus(
            data.path, data.paths, field=data.field, tokenizer=data.tokenizer
        )
    return load_stdlib_corpus()


def with_data_fingerprint(config: RunConfig, corpus: Corpus | None = None) -> RunConfig:
    """``config`` with ``data.fingerprint`` set from this machine's copy of the data (loaded
    unless ``corpus`` is given) when it is empty; a set fingerprint is kept (a coordinator
    without the data signs what the user wrote). Raises what ``load_data`` raises."""
    if config.data.fingerprint:
        return config
    corpus = corpus if corpus is not None else load_data(config)
    return config.replace(data={"fingerprint": corpus.fingerprint})


def check_data(config: RunConfig, corpus: Corpus) -> None:
    """Raise WorkloadError unless ``corpus`` is the data the spec names (its fingerprint), or
    DataError when it is too small for one batch and one held-out window."""
    expected = config.data.fingerprint
    if not expected:
        raise WorkloadError(
            "data.fingerprint: the run spec carries none, so this node cannot check that it "
            "trains on the run's data (a coordinator fills it in when it signs the spec)"
        )
    if corpus.fingerprint != expected:
        data = config.data
        what = "stdlib" if data.kind == "stdlib" else data.path or ", ".join(data.paths)
        raise WorkloadError(
            f"data.fingerprint: this node's data ({config.data.kind}: {what}) has fingerprint "
            f"{corpus.fingerprint[:16]}, the run spec's is {expected[:16]}; refusing to train "
            "on other data"
        )
    check_sizes(
        corpus,
        batch_size=config.training.batch_size,
        sequence_length=config.training.sequence_length,
    )


def with_model_hash(config: RunConfig) -> RunConfig:
    """``config`` with ``model.pretrained_sha256`` set from this machine's copy of the weights
    when it is empty (a set one is kept, as ``with_data_fingerprint`` does). Raises ModelError
    when the weight files are absent or not safetensors."""
    model = config.model
    if not model.pretrained or model.pretrained_sha256:
        return config
    return config.replace(model={"pretrained_sha256": pretrained_sha256(Path(model.pretrained))})


def with_local_hashes(
    config: RunConfig, base: Path, *, warn: Callable[[str], None] | None = None
) -> RunConfig:
    """The config a coordinator signs: its paths as written (each node reads them from its own
    ``--data-dir``), the data fingerprint and the weights' hash filled in (where unset) from this
    machine's copies, read from ``base``, the run.toml's folder (``config.with_base``; ``warn``
    hears of a path found from the working directory instead). Raises what ``load_data`` and
    ``with_model_hash`` raise, and WorkloadError for token ids beyond the vocabulary the spec
    names (``check_token_ids``: refused here already, not on every node)."""
    here = with_base(config, base, warn=warn)
    if not here.data.fingerprint:  # a coordinator without the data signs the one set
        corpus = load_data(here)
        here = with_data_fingerprint(here, corpus)
        check_token_ids(here, corpus.vocab_size, *_spec_vocabulary(here))
    here = with_model_hash(here)
    return config.replace(
        data={"fingerprint": here.data.fingerprint},
        model={"pretrained_sha256": here.model.pretrained_sha256},
    )


def _spec_vocabulary(config: RunConfig) -> tuple[int, str]:
    """The vocabulary size the spec alone names for its model, and the key that names it
    (0 when only the built model knows: a factory, a config without ``vocab_size``)."""
    model = config.model
    if model.kind == "transformers":
        vocab = model.config.get("vocab_size") if isinstance(model.config, dict) else None
        return (vocab, "model.config.vocab_size") if isinstance(vocab, int) else (0, "")
    return (0, "") if model.factory else (256, 'model.kind "default", which reads bytes')


def check_token_ids(config: RunConfig, data_vocab: int, model_vocab: int, named: str) -> None:
    """Raise WorkloadError when pre-tokenized data (``kind = "tokens"``, whose vocabulary is its
    largest id + 1) holds an id the model's vocabulary (``model_vocab``, ``named`` by its key;
    0: unknown here) has no row for: an embedding lookup would fail mid-run, or on CUDA
    corrupt memory."""
    if config.data.kind == "tokens" and 0 < model_vocab < data_vocab:
        raise WorkloadError(
            f"data.paths: the largest token id in the data is {data_vocab - 1}, not below the "
            f"model's vocabulary size {model_vocab} ({named}); retokenize the data or widen "
            "the vocabulary"
        )


def build_model(config: RunConfig, vocab_size: int = 256, *, weights: bool = True) -> nn.Module:
    """The model ``[model]`` names with its round-0 parameters: from the run seed (equal on every
    peer), or the ``pretrained`` weights once their files hash as the spec says (``weights``
    False: the seeded ones, for a caller that loads others). ``vocab_size``: the data's, checked
    against the model's once (a coordinator refused token ids beyond the vocabulary the spec
    names when it signed: ``check_token_ids``). The model has ``loss(inputs, targets)``. Raises
    ModelError or WorkloadError naming the key and the file."""
    seed = run_seed_of(config.run.id)
    if config.model.kind == "transformers":
        assert isinstance(config.model.config, dict), "RunConfig checks the table"
        model = build_causal_lm(config.model.config, seed=seed)
        check_fits(model, sequence_length=config.training.sequence_length, vocab_size=vocab_size)
        if config.model.pretrained and weights:
            _check_weights(config)
            load_pretrained(model, Path(config.model.pretrained))
        return model
    if config.model.factory:
        return factory_model(config, vocab_size)
    if vocab_size > 256:
        raise WorkloadError(
            f'model.kind "default" reads bytes (vocabulary 256); the data\'s vocabulary is '
            f'{vocab_size}: use model.kind "transformers" or byte data'
        )
    return ByteTransformer(shape_of(config), seed=seed)


def _check_weights(config: RunConfig) -> None:
    """Raise WorkloadError unless this node's ``model.pretrained`` files hash as the spec says."""
    path = Path(config.model.pretrained)
    expected = config.model.pretrained_sha256
    if not expected:
        raise WorkloadError(
            "model.pretrained_sha256: the run spec carries none, so this node cannot check the "
            "weights it starts from (a coordinator fills it in when it signs the spec)"
        )
    found = pretrained_sha256(path)
    if found != expected:
        raise WorkloadError(
            f"model.pretrained: {path} on this node has SHA-256 {found[:16]}, the run spec's is "
            f"{expected[:16]}; refusing to start from other weights"
        )


class FactoryLM(nn.Module):
    """A user's module (``[model] factory``) behind the face DiLoCo's loop uses:
    ``forward(idx)`` logits and ``loss(idx, targets)``, the module's own ``loss`` when it has
    one, else the mean cross entropy (the default model's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        own = getattr(self.inner, "loss", None)
        if callable(own):
            return own(idx, targets)
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def factory_model(config: RunConfig, vocab_size: int) -> FactoryLM:
    """The factory's module, called with torch seeded from the run (equal on every peer), checked
    on one batch of zeros: it must map (1, T) token ids to (1, T, V) logits with V at least the
    data's vocabulary. Raises ModelContractError naming the factory."""
    from swarmtrain.pipeline.model import ModelContractError
    from swarmtrain.pipeline.model import build_model as call_factory

    factory = config.model.factory
    module = call_factory(factory, run_seed_of(config.run.id))
    if not isinstance(module, nn.Module):
        raise ModelContractError(
            f"model factory {factory} returned a {type(module).__name__}, not an nn.Module"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelContractError(f"model factory {factory}: the module has no trainable parameters")
    model = FactoryLM(module)
    length = config.training.sequence_length
    try:
        with torch.no_grad():
            logits = model(torch.zeros(1, length, dtype=torch.int64))
    except Exception as exc:
        raise ModelContractError(
            f"model factory {factory}: its module failed on a (1, {length}) batch of token ids "
            f"({type(exc).__name__}: {exc})"
        ) from None
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) == 3 and shape[:2] == (1, length):
        check_token_ids(config, vocab_size, shape[2], f"the logits of model factory {factory}")
    if len(shape) != 3 or shape[:2] != (1, length) or shape[2] < vocab_size:
        raise ModelContractError(
            f"model factory {factory}: its module maps (1, {length}) token ids to {shape}, not "
            f"(1, {length}, V) logits with V >= the data's vocabulary ({vocab_size})"
        )
    return model
