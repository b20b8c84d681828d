"""The run config (``run.toml``): one frozen dataclass per TOML section, validated on load.

``RunConfig`` nests ``RunSection`` ([run]), ``ModelSection`` ([model]), ``DataSection`` ([data]),
``TrainingSection`` ([training]), ``SwarmSection`` ([swarm]), ``PipelineSection`` ([pipeline]) and
``VerifySection`` ([verify]); ``config.training.inner_steps`` is ``inner_steps`` under
``[training]``. Each field carries, in its metadata, the rule it must meet (checked when the
section is built, so no invalid section exists) and the comment ``swarmtrain init`` writes above
it; rules across sections (``n_heads`` divides ``d_model``, ...) are checked by ``RunConfig``.
Every error is a ``ConfigError`` naming the key as written in ``run.toml``.

``model.config`` given as a path (``config = "dir/config.json"``) is read when the file is loaded
(``load_config``, relative to the file's folder) and kept as its table, so the signed spec carries
the architecture itself and peers need no copy of that file.

One rule for every other path a run names (``PATH_KEYS``: the data's files and tokenizer, the
pretrained weights): a relative path is relative to the run's folder. The spec carries it as
written; each machine reads it from its own copy of that folder (``with_base``): the coordinator
and ``swarmtrain local`` from the folder of the run.toml, a node from its ``--data-dir`` (its
working directory unless given). Why not absolute paths in the spec: they name the
coordinator's disk, which the nodes' do not mirror. A run.toml written before this rule (paths
relative to the working directory it was started from, not to its folder) is still read, with a
warning, when only the working directory holds the file.

Over the ~400 lines STYLE.md asks of a module: every key's rule, default and ``init`` comment sit
together here, and the cross-section rules of ``[model]`` and ``[data]`` with them.

``items()`` lists ``(section.key, value)`` sorted by key: the canonical order the run spec is
signed in (``swarmtrain.runspec``), so the signed bytes depend on the keys, not on this layout.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from swarmtrain.paths import plain_os_error


class ConfigError(ValueError):
    """A run config value is missing, unknown or invalid; the message names the key."""


# ``package.module:function`` (``model.factory``): dotted identifiers, a colon, an identifier.
FACTORY_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
MAX_FACTORY_CHARS = 200


def _positive(value: Any) -> bool:
    return value > 0


def _any(value: Any) -> bool:
    return True


def _non_negative(value: Any) -> bool:
    return value >= 0


def _quorum_ok(value: Any) -> bool:
    return value == "majority" if isinstance(value, str) else value >= 0


def _factory_ok(value: Any) -> bool:
    return value == "" or (
        len(value) <= MAX_FACTORY_CHARS and re.fullmatch(FACTORY_PATTERN, value) is not None
    )


def _peer_id_ok(value: Any) -> bool:
    # base58 (no 0, O, I, l), the length of libp2p's Ed25519 and RSA ids; p2p parses it fully.
    return (
        isinstance(value, str) and re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{40,64}", value) is not None
    )


def _run_id_ok(value: Any) -> bool:
    return len(value) <= 64 and "/" not in value and value.isprintable() and " " not in value


def _key(default: Any, check: Callable[[Any], bool], rule: str, help: str) -> Any:
    """A section field: its default, the rule it must meet (``check``, and ``rule`` in words for
    the error message) and ``help``, the comment written above it by ``swarmtrain init``."""
    return field(default=default, metadata={"check": check, "rule": rule, "help": help})


_POSITIVE_INT = (_positive, "a positive integer")
_POSITIVE = (_positive, "a positive number")


def _check_value(
    key: str, kind: type | tuple[type, ...], check: Callable[[Any], bool], rule: str, value: Any
) -> Any:
    # bool is an int subclass in Python; "rounds = true" is a mistake, not 1.
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is tuple and isinstance(value, list):
        value = tuple(value)
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ConfigError(f"{key} must be {rule}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{key} must be {rule}, got {value!r}")
    if not check(value):
        raise ConfigError(f"{key} must be {rule}, got {value!r}")
    return value


# A field's annotation (a string: ``from __future__ import annotations``) -> the Python type(s) its
# TOML value may have. A TOML array arrives as a list and is kept as a tuple (sections are frozen).
_KINDS: dict[str, type | tuple[type, ...]] = {
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "tuple[str, ...]": tuple,
    "str | dict[str, Any]": (str, dict),
    "int | str": (int, str),
}

MODEL_KINDS = ("default", "transformers")
DATA_KINDS = ("stdlib", "text", "tokens", "datasets")
TOKEN_DTYPES = ("uint16", "uint32")
COMPRESSIONS = ("auto", "int8", "none", "sparse")
ADMISSIONS = ("open", "allowlist", "token")
# swarm.averaging.aggregation.AGGREGATIONS, spelled out: the config is read before swarm loads.
AGGREGATIONS = ("mean", "centered_clip", "trimmed_mean")
# swarm.averaging.sparse_codec.SELECTIONS, spelled out likewise (test_runspec.py: they agree).
SPARSE_SELECTIONS = ("chunk", "part")
# The config keys that give a causal LM's longest sequence, by model family (Llama, GPT-2, ...).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
MAX_MODEL_CONFIG_BYTES = 16384


class _Section:
    """A TOML section: ``NAME`` is its header; fields are its keys (``_key``)."""

    NAME: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            kind = _KINDS[f.type] if isinstance(f.type, str) else f.type
            value = _check_value(
                f"{self.NAME}.{f.name}",
                kind,
                f.metadata["check"],
                f.metadata["rule"],
                getattr(self, f.name),
            )
            object.__setattr__(self, f.name, value)  # an int given for a float becomes float


@dataclass(frozen=True)
class RunSection(_Section):
    NAME: ClassVar[str] = "run"
    id: str = _key(
        "",
        _run_id_ok,
        "at most 64 printable characters, no '/' or space",
        'run name peers share; "" lets the coordinator pick a fresh one',
    )
    rounds: int = _key(5, *_POSITIVE_INT,
                       "outer rounds; nodes exit with a summary after the last one")  # fmt: skip
    admission: str = _key(
        "open", lambda v: v in ADMISSIONS, f"one of {', '.join(ADMISSIONS)}",
        '"open": anyone may join. "allowlist": only the peer ids in `allow`. "token": only\n'
        "# holders of a join token the coordinator signed (swarmtrain coordinator token --peer\n"
        "# ID --expires 24h; the node's --token). Members ignore what others write under the\n"
        "# run's keys and refuse their state downloads",
    )  # fmt: skip
    allow: tuple[str, ...] = _key(
        (), lambda v: len(v) <= 4096 and all(_peer_id_ok(p) for p in v),
        "a list of at most 4096 peer ids",
        'admission "allowlist": the members\' peer ids (swarmtrain id prints a node\'s)',
    )  # fmt: skip
    identity_work_bits: int = _key(
        0, lambda v: type(v) is int and 0 <= v <= 28, "an integer 0..28",
        "proof of work every member's identity must carry (Sybil resistance: a new identity\n"
        "# costs about 2**N key generations, 16 bits ~3 s of one core, 20 bits ~1 min);\n"
        "# members ignore other peers as they ignore non-members. Make one with: swarmtrain id\n"
        "# --identity STATE_DIR/identity.key --work N (0: any identity)",
    )  # fmt: skip


@dataclass(frozen=True)
class ModelSection(_Section):
    NAME: ClassVar[str] = "model"
    kind: str = _key(
        "default",
        lambda v: v in MODEL_KINDS,
        f"one of {', '.join(MODEL_KINDS)}",
        '"default": the embedded byte-level transformer below (no file, no download).\n'
        '# "transformers": a causal LM of the transformers library built from `config`\n'
        "# (initialised from the run seed; nothing is downloaded); d_model, n_layers,\n"
        "# n_heads and context are then unused",
    )
    # _key gives a field whose default ("") is immutable; ruff cannot see that through a union.
    config: str | dict[str, Any] = _key(  # noqa: RUF009
        "",
        lambda v: isinstance(v, dict) or v == "" or len(v) <= 1000,
        "a path to a config.json or a [model.config] table",
        'kind "transformers": "PATH/config.json" (its model_type picks the class), or a\n'
        "# [model.config] table with model_type and the architecture's keys, e.g.\n"
        '# { model_type = "llama", vocab_size = 512, hidden_size = 64, ... }',
    )
    pretrained: str = _key(
        "", lambda v: len(v) <= 1000, "a path",
        'kind "transformers": start from these weights instead of the run seed: a\n'
        "# save_pretrained folder (its config.json is the model.config when that is unset) or\n"
        "# one .safetensors file (relative to this file's folder; a node reads it from its\n"
        "# --data-dir); nothing is downloaded",
    )  # fmt: skip
    pretrained_sha256: str = _key(
        "", lambda v: v == "" or re.fullmatch(r"[0-9a-f]{64}", v) is not None,
        '"" or 64 hex digits',
        '"": the coordinator computes it from its copy of `pretrained` when it signs the\n'
        "# spec; a node whose weight files hash otherwise refuses to train",
    )  # fmt: skip
    d_model: int = _key(
        128, *_POSITIVE_INT, "width of the byte-level transformer (embedded default model)"
    )
    n_layers: int = _key(4, *_POSITIVE_INT, "transformer blocks")
    n_heads: int = _key(4, *_POSITIVE_INT, "attention heads; must divide d_model")
    context: int = _key(128, *_POSITIVE_INT, "longest sequence the model accepts (bytes)")
    factory: str = _key(
        "", _factory_ok, 'empty or "package.module:function" (at most 200 characters)',
        '"" trains the default model above. "package.module:function" trains your own\n# '
        "model instead (d_model, n_layers and n_heads are then unused), called with torch\n# "
        "seeded from the run; every node must install it and pass --allow-model with it.\n# "
        "DiLoCo runs: function() returns an nn.Module mapping token ids (batch, sequence)\n# "
        "to logits (batch, sequence, vocabulary), with a loss(ids, targets) of its own or\n# "
        "cross entropy. Pipeline runs: an nn.Sequential from byte ids to (batch, sequence,\n# "
        "256) logits (docs/pipelines.md)",
    )  # fmt: skip


def _paths_ok(value: Any) -> bool:
    return len(value) <= 64 and all(isinstance(p, str) and 0 < len(p) <= 1000 for p in value)


def _fingerprint_ok(value: Any) -> bool:
    return value == "" or re.fullmatch(r"[0-9a-f]{64}", value) is not None


@dataclass(frozen=True)
class DataSection(_Section):
    NAME: ClassVar[str] = "data"
    kind: str = _key(
        "stdlib", lambda v: v in DATA_KINDS, f"one of {', '.join(DATA_KINDS)}",
        '"stdlib": the Python standard library\'s own source, as bytes (no download).\n'
        '# "text": local .txt / .jsonl files (`paths`), tokenized by `tokenizer` or as bytes.\n'
        '# "tokens": pre-tokenized .bin / .npy arrays of `dtype` (memory-mapped, nanoGPT style).\n'
        '# "datasets": a Hugging Face datasets dataset: a save_to_disk folder (`path`) or\n'
        "# local .jsonl/.json/.csv/.parquet/.txt/.arrow files (`paths`), its `field` column.\n"
        "# Every node needs the same files under the same paths (relative ones: under its\n"
        "# --data-dir as they lie beside this file); the spec carries their fingerprint and a\n"
        "# node whose files differ refuses to train",
    )  # fmt: skip
    paths: tuple[str, ...] = _key(
        (), _paths_ok, "a list of at most 64 paths or globs",
        'kinds "text" and "tokens": files or globs, e.g. ["data/*.jsonl"] (relative to this\n'
        "# file's folder; a node reads them from its --data-dir); matched files are read in\n"
        "# sorted order",
    )  # fmt: skip
    path: str = _key(
        "", lambda v: len(v) <= 1000, "a path",
        'kind "datasets": a folder written by datasets\' save_to_disk (instead of `paths`)',
    )  # fmt: skip
    field: str = _key(
        "text", lambda v: 0 < len(v) <= 100, "a non-empty name",
        'kinds "text" and "datasets": the key of each .jsonl line\'s object (the dataset\'s\n'
        "# column) that holds its text",
    )  # fmt: skip
    tokenizer: str = _key(
        "", lambda v: len(v) <= 1000, "a path",
        'kinds "text" and "datasets": a tokenizer.json (or a folder holding one) of the\n'
        '# tokenizers library; "" tokenizes as bytes (vocabulary 256)',
    )  # fmt: skip
    dtype: str = _key(
        "uint16", lambda v: v in TOKEN_DTYPES, f"one of {', '.join(TOKEN_DTYPES)}",
        'kind "tokens": the arrays\' element type (.bin files are raw little-endian arrays)',
    )  # fmt: skip
    fingerprint: str = _key(
        "", _fingerprint_ok, '"" or 64 hex digits',
        '"": the coordinator computes it from its own copy of the data when it signs the\n'
        "# spec (and prints it); a coordinator without a copy signs the value set here",
    )  # fmt: skip


@dataclass(frozen=True)
class TrainingSection(_Section):
    NAME: ClassVar[str] = "training"
    inner_steps: int = _key(
        20, *_POSITIVE_INT, "DiLoCo's H: inner AdamW steps between two outer rounds"
    )
    batch_size: int = _key(8, *_POSITIVE_INT, "sequences per inner step on each peer")
    sequence_length: int = _key(64, *_POSITIVE_INT, "bytes per sequence; at most model.context")
    inner_lr: float = _key(3e-3, *_POSITIVE, "AdamW learning rate of the inner steps")
    grad_accumulation: int = _key(
        1, *_POSITIVE_INT,
        "gradient accumulation: each inner step averages the gradients of this many\n"
        "# batches of batch_size sequences (a larger batch in the same memory)",
    )  # fmt: skip
    lr_schedule: str = _key(
        "constant", lambda v: v in ("constant", "cosine"), "one of constant, cosine",
        'the inner learning rate over the whole run\'s inner steps (rounds x H): "cosine" is\n'
        "# a linear warm-up over `warmup` of them, then a cosine decay to `final_lr` of\n"
        "# inner_lr (bench.diloco's schedule)",
    )  # fmt: skip
    warmup: float = _key(
        0.05, lambda v: 0 <= v <= 1, "a number in [0, 1]",
        'lr_schedule "cosine": the share of the run\'s inner steps the warm-up takes',
    )  # fmt: skip
    final_lr: float = _key(
        0.1, lambda v: 0 <= v <= 1, "a number in [0, 1]",
        'lr_schedule "cosine": where the decay ends, as a share of inner_lr',
    )  # fmt: skip
    weight_decay: float = _key(
        0.01, _non_negative, "a non-negative number", "AdamW's decoupled weight decay"
    )  # fmt: skip
    grad_clip: float = _key(
        0.0, _non_negative, "a non-negative number",
        "clip each inner step's gradient to this global norm (0: no clipping)",
    )  # fmt: skip
    precision: str = _key(
        "fp32", lambda v: v in ("fp32", "bf16", "fp16"), "one of fp32, bf16, fp16",
        '"bf16": forward and loss under bfloat16 autocast (CPU and CUDA; the parameters,\n'
        '# their gradients and the DiLoCo state stay float32); "fp16": float16 autocast with\n'
        "# a dynamic loss scaler (torch.amp.GradScaler; a step with non-finite gradients is\n"
        "# skipped but still counts toward inner_steps)",
    )  # fmt: skip
    outer_lr: float = _key(
        0.7, *_POSITIVE, "Nesterov SGD learning rate of the outer step (OpenDiLoCo: 0.7)"
    )
    outer_momentum: float = _key(
        0.9, lambda v: 0 <= v < 1, "a number in [0, 1)",
        "Nesterov momentum of the outer step; 0: a plain SGD outer step (SparseLoCo's, whose\n"
        '# error feedback takes the momentum\'s place: with swarm.compression = "sparse")',
    )  # fmt: skip
    outer_momentum_warmup: int = _key(
        0, _non_negative, "a non-negative integer",
        "rounds over which the outer momentum ramps up from 0 (0: constant); with few rounds\n"
        "# full momentum from round 0 overshoots: 12 of 16 rounds is best in bench.diloco\n"
        "# (docs/diloco_tuning.md)",
    )  # fmt: skip
    error_feedback: bool = _key(
        False, _any, "true or false",
        "add what the lossy codec (swarm.compression) dropped from last round's\n"
        "# pseudo-gradient to this round's (DiLoCo's int8 rounds in bench.diloco); costs one\n"
        '# more float32 copy of the parameters in memory; always on with "sparse"',
    )  # fmt: skip
    error_feedback_decay: float = _key(
        1.0, lambda v: 0 <= v <= 1, "a number in [0, 1]",
        "with error feedback: the carried residual is scaled by this before it is added\n"
        "# (SparseLoCo's decayed error feedback; 1: carried in full)",
    )  # fmt: skip
    overlap: bool = _key(
        False, _any, "true or false",
        "one-round-delayed outer step: a round's averaging runs while the next inner phase\n"
        "# trains, and its outer step is applied at the end of that phase (hides the\n"
        "# all-reduce behind compute; not in verified runs)",
    )  # fmt: skip
    fragments: int = _key(
        1, *_POSITIVE_INT,
        "streaming DiLoCo: the model's tensors cut into this many contiguous fragments of\n"
        "# about equal size; round r averages and outer-steps fragment r mod fragments only\n"
        "# (about 1/fragments of the bytes a round; each fragment syncs every `fragments`\n"
        "# rounds, the others train on meanwhile); with overlap each fragment's averaging runs\n"
        "# behind the next inner phase; at most the model's trainable tensors; not in verified\n"
        "# runs",
    )  # fmt: skip


@dataclass(frozen=True)
class SwarmSection(_Section):
    NAME: ClassVar[str] = "swarm"
    matchmaking_timeout_s: float = _key(
        4.0, *_POSITIVE, "seconds a round waits for peers to declare"
    )
    allreduce_timeout_s: float = _key(30.0, *_POSITIVE,
                                      "seconds an all-reduce may take before it fails")  # fmt: skip
    compression: str = _key(
        "auto", lambda v: v in COMPRESSIONS, f"one of {', '.join(COMPRESSIONS)}",
        'pseudo-gradients on the wire: "auto" int8 for tensors over 64K elements and exact\n'
        '# below, "int8" every tensor (blockwise, deterministic), "none" exact float32\n'
        '# (verified runs always average exactly), "sparse" the top sparse_density of every\n'
        "# sparse_chunk entries at sparse_bits bits (SparseLoCo; error feedback always on,\n"
        '# aggregation "mean" only)',
    )  # fmt: skip
    sparse_density: float = _key(
        0.02, lambda v: 0 < v <= 1, "a number in (0, 1]",
        'compression = "sparse": the share of each chunk\'s entries a peer sends (largest\n'
        "# magnitudes first; ceil(density x chunk) per chunk)",
    )  # fmt: skip
    sparse_bits: int = _key(
        2, lambda v: 2 <= v <= 8, "an integer in [2, 8]",
        'compression = "sparse": bits per entry sent, on a power-of-two scale per chunk\n'
        "# (2: sign times the scale, or zero)",
    )  # fmt: skip
    sparse_chunk: int = _key(
        4096, lambda v: 2 <= v <= 65536, "an integer in [2, 65536]",
        'compression = "sparse": entries per chunk (the kept indices Elias-Fano coded)',
    )  # fmt: skip
    sparse_select: str = _key(
        "chunk", lambda v: v in SPARSE_SELECTIONS, f"one of {', '.join(SPARSE_SELECTIONS)}",
        'compression = "sparse": "chunk" keeps the top of every chunk; "part" the same\n'
        "# number of entries in all, the largest of each peer's part wherever they lie (the\n"
        "# budget follows the pseudo-gradient's energy across tensors; chunks keep the scales)",
    )  # fmt: skip
    max_weight_rounds: int = _key(
        8, *_POSITIVE_INT,
        "a contribution weighs its tokens (a failed round's carry into the next); every\n"
        "# reducer drops a peer declaring more than this many rounds' worth of one process's\n"
        "# tokens (H x grad_accumulation x batch_size x sequence_length), so a liar's weight\n"
        "# cannot swamp the average; a verified run fixes it at one round's",
    )  # fmt: skip
    aggregation: str = _key(
        "mean", lambda v: v in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}",
        'how each part\'s reducer combines the peers\' pseudo-gradients: "mean" the weighted\n'
        '# mean; "trimmed_mean" per coordinate drops the n // 4 (at least 1 from 3 peers on)\n'
        '# largest and smallest values; "centered_clip" clips each peer\'s distance from the\n'
        "# median to twice the median distance (5 iterations). The robust rules bound what a\n"
        "# peer sending hostile values can do (bench.byzantine) and cap a declared weight at\n"
        "# the median weight; verified runs and pipeline runs use \"mean\"",
    )  # fmt: skip
    state_quorum: int | str = _key(
        "majority", _quorum_ok, 'a non-negative integer or "majority"',
        '"majority": a joiner (or a node re-syncing) adopts only a state more than half of\n'
        "# its round's members vouch for (the largest member list of its round and the next\n"
        "# and previous ones), never one a minority or a stranger holds; 0: the state most\n"
        "# peers hold, whoever they are (unsafe with liars); N > 0: only a state at least N\n"
        "# distinct peers hold",
    )  # fmt: skip
    min_peers: int = _key(
        1, *_POSITIVE_INT,
        "a fresh run's round 0 starts once this many nodes announced their start (each node\n"
        "# waits at most 120 s for them, then trains anyway); swarmtrain local --peers N sets N.\n"
        "# Nodes whose start-ups differ by more than matchmaking_timeout_s no longer miss\n"
        "# round 0",
    )  # fmt: skip
    row_size: int = _key(
        32, lambda v: v == 0 or v >= 2, "0 or an integer >= 2",
        "a round of more peers than this runs as the hierarchical all-reduce: one group of\n"
        "# everyone, in rows of at most row_size peers (each peer talks to its row and the rows\n"
        "# above and below it, not to all); for aggregation \"mean\" under any compression but\n"
        "# \"sparse\", not verified; otherwise, or 0, groups of at most 64. Every peer must use\n"
        "# the same (a peer with another is refused)",
    )  # fmt: skip
    expected_peers: int = _key(
        0, _non_negative, "a non-negative integer",
        "0: a round's matchmaking waits for the peers it expects by name, at most\n"
        "# matchmaking_timeout_s (small swarms). N > 0: scheduled rounds for a swarm of about N\n"
        "# peers: declarations spread over ceil(N / 128) DHT keys, a round's window closes once\n"
        "# 85% of the last round's survivors declared (open at least 5 s, at most 300 s after\n"
        "# half of them), and everyone decides on what was declared before the close, so peers\n"
        "# finishing a round far apart still form one group; the nodes' clocks must agree\n"
        "# within about a second. Not in verified or pipeline runs",
    )  # fmt: skip


@dataclass(frozen=True)
class PipelineSection(_Section):
    NAME: ClassVar[str] = "pipeline"
    stages: int = _key(
        0,
        _non_negative,
        "a non-negative integer",
        "0: a DiLoCo run (every node trains the whole model). S > 0: a SWARM pipeline run: the\n"
        "# model cut into S stages (at most model.n_layers), served by stage servers (Adam at\n"
        "# training.inner_lr) and driven by trainers (`swarmtrain node --role trainer`)",
    )
    microbatches: int = _key(
        8,
        *_POSITIVE_INT,
        "microbatches (of training.batch_size sequences) per trainer round; run.rounds rounds",
    )
    average_every_s: float = _key(
        5.0, *_POSITIVE, "seconds between two averagings of a stage's parameters by its servers"
    )
    rebalance_every_s: float = _key(
        3.0, _non_negative, "a non-negative number",
        "seconds between two rebalancing decisions (a server moves to the bottleneck stage);"
        "\n# 0: servers never move",
    )  # fmt: skip


@dataclass(frozen=True)
class VerifySection(_Section):
    NAME: ClassVar[str] = "verify"
    rate: float = _key(
        0.0,
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
        "DiLoCo runs: the fraction of inner phases (tasks) a second peer re-executes; above 0 "
        "every inner\n# phase runs under RepOps (bit-reproducible, slower) from a fresh AdamW "
        "state, a task's\n# two commitments are compared and the coordinator referees a "
        "difference; the loser's\n# contribution is left out and the loser banned "
        "(docs/verification.md)",
    )
    timeout_s: float = _key(60.0, *_POSITIVE, "seconds a verified round waits for a task's two "
                            "commitments, or for the coordinator's verdict")  # fmt: skip


# The sections in the order ``swarmtrain init`` writes them.
SECTIONS: dict[str, type[_Section]] = {
    s.NAME: s
    for s in (
        RunSection,
        ModelSection,
        DataSection,
        TrainingSection,
        SwarmSection,
        PipelineSection,
        VerifySection,
    )
}


@dataclass(frozen=True)
class RunConfig:
    """One run's settings; the defaults are the embedded default run (``swarmtrain local``)."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    swarm: SwarmSection = field(default_factory=SwarmSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    verify: VerifySection = field(default_factory=VerifySection)

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"[{name}] must be a {kind.__name__}")
        model, training = self.model, self.training
        if model.d_model % model.n_heads:
            raise ConfigError(
                f"model.n_heads ({model.n_heads}) must divide model.d_model ({model.d_model})"
            )
        if model.kind == "default" and training.sequence_length > model.context:
            raise ConfigError(
                f"training.sequence_length ({training.sequence_length}) is longer than "
                f"model.context ({model.context})"
            )
        if self.run.admission == "allowlist" and not self.run.allow:
            raise ConfigError('run.admission = "allowlist" needs run.allow: nobody could join')
        if self.run.admission == "token" and not self.run.id:
            raise ConfigError(
                'run.admission = "token" needs run.id: the tokens name the run they admit to'
            )
        _check_model_kind(self)
        _check_data_kind(self)
        if self.verify.rate > 0:
            defaults = TrainingSection()
            changed = [
                f"training.{name}"
                for name in (
                    "grad_accumulation",
                    "lr_schedule",
                    "weight_decay",
                    "precision",
                    "overlap",
                    "error_feedback",
                    "error_feedback_decay",
                    "fragments",
                )
                if getattr(training, name) != getattr(defaults, name)
            ]
            if changed:
                raise ConfigError(
                    f"{', '.join(changed)}: a verified run (verify.rate > 0) runs its inner "
                    "steps as reproducible operators with the default settings only"
                )
        if self.swarm.aggregation != "mean" and (self.verify.rate > 0 or self.is_pipeline):
            raise ConfigError(
                f'swarm.aggregation = "{self.swarm.aggregation}": verified runs (the coordinator '
                'recomputes sums) and pipeline runs average with "mean"'
            )
        if self.verify.rate > 0 and self.swarm.compression in ("int8", "sparse"):
            raise ConfigError(
                f'swarm.compression = "{self.swarm.compression}": a verified run averages exactly '
                "(the coordinator recomputes any part's sum from its inputs)"
            )
        if self.swarm.compression == "sparse" and self.swarm.aggregation != "mean":
            raise ConfigError(
                f'swarm.aggregation = "{self.swarm.aggregation}": swarm.compression = "sparse" '
                'needs "mean" (every peer recomputes a part\'s mean from the sparse slices)'
            )
        if self.swarm.expected_peers and (self.verify.rate > 0 or self.is_pipeline):
            raise ConfigError(
                f"swarm.expected_peers ({self.swarm.expected_peers}): scheduled rounds are for "
                "DiLoCo runs without verification (verify.rate = 0, pipeline.stages = 0)"
            )
        if self.verify.rate > 0 and self.is_pipeline:
            raise ConfigError(
                f"verify.rate ({self.verify.rate}) needs a DiLoCo run (pipeline.stages = 0): "
                "pipeline stages are not verified"
            )
        # A factory's model has its own layers: stage servers check the count when they cut it.
        if self.pipeline.stages > model.n_layers and not model.factory:
            raise ConfigError(
                f"pipeline.stages ({self.pipeline.stages}) is more than model.n_layers "
                f"({model.n_layers}): every stage needs at least one transformer block"
            )

    def replace(self, **changes: Mapping[str, Any]) -> RunConfig:
        """A copy with some keys changed, by section: ``config.replace(run={"rounds": 9})``;
        re-validated (raises ConfigError)."""
        sections = {}
        for name, values in changes.items():
            if name not in SECTIONS:
                raise ConfigError(f"unknown section [{name}]")
            try:
                sections[name] = dataclasses.replace(getattr(self, name), **values)
            except TypeError as exc:
                raise ConfigError(f"[{name}]: {exc}") from None
        return dataclasses.replace(self, **sections)

    @property
    def is_pipeline(self) -> bool:
        """A SWARM pipeline run (stage servers and trainers) rather than a DiLoCo run."""
        return self.pipeline.stages > 0

    def items(self) -> list[tuple[str, Any]]:
        """``[(toml key, value)]`` sorted by key: the canonical order the spec is signed in."""
        return sorted(
            (f"{name}.{f.name}", getattr(getattr(self, name), f.name))
            for name, kind in SECTIONS.items()
            for f in dataclasses.fields(kind)
        )


def _check_model_kind(config: RunConfig) -> None:
    """Rules of ``[model] kind`` across sections; the table itself is checked here, without
    importing transformers (the node builds the model and checks the rest)."""
    model = config.model
    if model.kind == "default":
        if model.config not in ("", {}):
            raise ConfigError('model.config needs model.kind = "transformers"')
        if model.pretrained or model.pretrained_sha256:
            raise ConfigError('model.pretrained needs model.kind = "transformers"')
        return
    if not isinstance(model.config, dict):
        raise ConfigError(
            'model.kind "transformers" needs model.config: a [model.config] table, or a path '
            "to a config.json in a run.toml file"
        )
    model_type = model.config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError('model.config needs a model_type (e.g. "llama")')
    try:
        encoded = json.dumps(model.config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.config holds a value JSON cannot: {exc}") from None
    if len(encoded) > MAX_MODEL_CONFIG_BYTES:
        raise ConfigError(f"model.config is over {MAX_MODEL_CONFIG_BYTES} bytes as JSON")
    if model.factory or config.is_pipeline:
        raise ConfigError(
            'model.kind "transformers" trains in DiLoCo runs only: no model.factory and '
            "pipeline.stages = 0"
        )
    for key in CONTEXT_KEYS:
        context = model.config.get(key)
        if isinstance(context, int) and config.training.sequence_length > context:
            raise ConfigError(
                f"training.sequence_length ({config.training.sequence_length}) is longer than "
                f"model.config.{key} ({context})"
            )


def _check_data_kind(config: RunConfig) -> None:
    data = config.data
    if data.path and data.kind != "datasets":
        raise ConfigError('data.path needs data.kind "datasets" (other kinds read data.paths)')
    if data.kind == "stdlib":
        if data.paths or data.tokenizer:
            raise ConfigError(
                'data.paths and data.tokenizer need data.kind "text", "tokens" or "datasets"'
            )
        return
    if data.kind == "datasets":
        if bool(data.path) == bool(data.paths):
            raise ConfigError(
                'data.kind "datasets" needs data.path (a save_to_disk folder) or data.paths '
                "(local data files), one of them"
            )
    elif not data.paths:
        raise ConfigError(f'data.kind "{data.kind}" needs data.paths (files or globs)')
    if data.kind == "tokens" and data.tokenizer:
        raise ConfigError('data.tokenizer needs data.kind "text" (tokens are tokenized already)')
    # The verified and pipeline paths read the embedded corpus as bytes only.
    if config.is_pipeline or config.verify.rate > 0:
        raise ConfigError(
            f'data.kind "{data.kind}" trains in DiLoCo runs only: pipeline.stages = 0 and '
            "verify.rate = 0"
        )


# The keys whose values are paths on the machine that reads the spec (section, key); ``paths``
# holds globs. ``model.config`` is not one: it is read into the spec when run.toml loads.
PATH_KEYS = (("model", "pretrained"), ("data", "paths"), ("data", "path"), ("data", "tokenizer"))


def _joined(base: Path, path: str, *, pattern: bool) -> str:
    if not path or os.path.isabs(path) or str(base) == ".":
        return path
    # A glob's folder part is taken literally, whatever characters the folder's name holds.
    return os.path.join(glob.escape(str(base)) if pattern else str(base), path)


def _present(path: str, *, pattern: bool) -> bool:
    return bool(glob.glob(path, recursive=True)) if pattern else os.path.exists(path)


def _located(
    base: Path, path: str, *, pattern: bool, warn: Callable[[str], None] | None, key: str
) -> str:
    """``path`` read from ``base``; with ``warn``, a run.toml written before paths were relative
    to its folder: a path found only from the working directory is taken from there, and
    ``warn`` is told so."""
    joined = _joined(base, path, pattern=pattern)
    if warn is None or joined == path or _present(joined, pattern=pattern):
        return joined
    if not _present(path, pattern=pattern):
        return joined  # absent either way: the error names the path the rule reads
    warn(
        f"{key}: {path} is read from the working directory, but {joined} does not exist: "
        f"paths in a run.toml are relative to its folder ({base}); write {key} relative to it "
        "(the spec carries it as written, and nodes read it from their --data-dir)"
    )
    return _joined(Path.cwd(), path, pattern=pattern)


def with_base(
    config: RunConfig, base: Path, *, warn: Callable[[str], None] | None = None
) -> RunConfig:
    """``config`` as this machine reads its paths (``PATH_KEYS``): each relative one joined to
    ``base``, the run's folder here (a run.toml's folder, a node's ``--data-dir``); absolute
    ones kept. ``warn``: the run.toml's own reader, which also accepts paths from the working
    directory as runs before this rule wrote them (``_located``). Not for signing: the spec
    carries the paths as written."""
    changes: dict[str, dict[str, Any]] = {}
    for section, key in PATH_KEYS:
        value = getattr(getattr(config, section), key)
        pattern = isinstance(value, tuple)
        located = [
            _located(base, v, pattern=pattern, warn=warn, key=f"{section}.{key}")
            for v in (value if pattern else (value,))
        ]
        changes.setdefault(section, {})[key] = tuple(located) if pattern else located[0]
    return config.replace(**changes)


def resolve_model_config(data: dict[str, Any], folder: Path, source: str) -> None:
    """Replace a ``[model] config = "PATH"`` in parsed TOML by the JSON table in that file (a
    relative PATH from ``folder``), in place; an unset one by the ``config.json`` of a
    ``pretrained`` folder (from ``folder`` too, or from the working directory as runs before
    that rule wrote it). Raises ConfigError naming the key and the file."""
    model = data.get("model")
    if not isinstance(model, dict):
        return
    pretrained = model.get("pretrained")
    if model.get("config", "") == "" and isinstance(pretrained, str) and pretrained:
        where = _located(folder, pretrained, pattern=False, warn=lambda _: None, key="")
        if os.path.isdir(where):
            # A save_pretrained folder names its own architecture.
            model["config"] = os.path.join(where, "config.json")
            folder = Path(".")  # ``where`` is joined already
    if not isinstance(model.get("config"), str) or not model["config"]:
        return
    path = folder / model["config"]
    if path.is_dir():
        path = path / "config.json"
    try:
        table = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{source}: model.config: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{source}: model.config: {path} is not JSON: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: model.config: {path} does not hold a JSON object")
    model["config"] = _without_nulls(table)


def _without_nulls(table: dict[str, Any]) -> dict[str, Any]:
    """A config.json's table without its ``null`` values: TOML (which ``swarmtrain local``
    writes the config back to) has no null, and transformers treats an absent key as its
    default, which for these keys is None already."""
    return {
        k: _without_nulls(v) if isinstance(v, dict) else v
        for k, v in table.items()
        if v is not None
    }


def config_from_mapping(data: Mapping[str, Any], *, source: str = "run config") -> RunConfig:
    """A ``RunConfig`` from parsed TOML (``{section: {key: value}}``); missing keys keep their
    defaults. Raises ConfigError naming the first unknown section or key, or the bad value."""
    sections: dict[str, _Section] = {}
    for name, body in data.items():
        kind = SECTIONS.get(name)
        if kind is None:
            raise ConfigError(f"{source}: unknown section [{name}] (known: {', '.join(SECTIONS)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: {name} must be a [{name}] table")
        keys = [f.name for f in dataclasses.fields(kind)]
        for key in body:
            if key not in keys:
                known = ", ".join(f"{name}.{k}" for k in keys)
                raise ConfigError(f"{source}: unknown key {name}.{key} (known: {known})")
        try:
            sections[name] = kind(**body)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    try:
        return RunConfig(**sections)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: Path) -> RunConfig:
    """Read and validate ``run.toml``. Raises ConfigError (absent, unreadable, bad TOML or a bad
    value, naming the key and the file)."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file (swarmtrain init {path} writes a commented one)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {plain_os_error(exc)}") from None
    resolve_model_config(data, path.parent, str(path))
    return config_from_mapping(data, source=str(path))


def _toml_value(value: Any) -> str:
    # JSON's strings, numbers, lists and booleans are TOML's too (JSON escapes are TOML's basic
    # string escapes); a table is written inline. Floats keep repr (JSON has no inf, TOML has).
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
        )
    if value is None:
        raise ConfigError("TOML has no null: drop the key instead")
    return repr(value)


def default_toml(config: RunConfig | None = None) -> str:
    """The commented run config ``swarmtrain init`` writes (written by hand: tomllib only reads)."""
    config = config or RunConfig()
    lines = [
        "# swarmtrain run config: `swarmtrain coordinator --config run.toml` validates it,",
        "# signs it as the run spec, and every volunteer trains with exactly these settings.",
        "# Defaults: the embedded default model (byte-level transformer) on the Python",
        "# standard library's own source, so nothing is downloaded.",
    ]
    for name, kind in SECTIONS.items():
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(kind):
            lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(config, name), f.name))}")
    return "\n".join(lines) + "\n"


def run_seed_of(run_id: str) -> int:
    """The run's seed for the initial parameters and the data assignment: every peer of a run
    derives the same one from the run id, so nobody has to download round 0's parameters."""
    return int.from_bytes(hashlib.sha256(b"swarmtrain/run-seed/" + run_id.encode()).digest()[:8])
