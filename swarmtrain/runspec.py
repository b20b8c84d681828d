"""The run config (``run.toml``) and the run spec the coordinator signs.

A run is defined by its config: model shape, DiLoCo settings, swarm deadlines, number of rounds,
and, for a SWARM pipeline run (``[pipeline] stages > 0``), the stage count and its periods, and
optionally a user's model (``[model] factory = "package.module:function"``; only its name is in
the spec, and volunteers import it only when they allow it: ``swarmtrain.pipeline.model``).
The coordinator reads ``run.toml`` (``tomllib``), validates it, fixes a run id, and signs the
canonical encoding of the result with its Ed25519 identity: that is the *run spec*. Volunteers
fetch the spec from the peer named in ``--join`` and check the signature against that peer's id
(an Ed25519 peer id *is* the public key), so a spec that was altered on the way, or issued by
anyone else, is refused before anything trains on it.

Why a separate signature and not just the signed DHT record: the spec is the root of trust for
everything else in the run (which model, which seed, how many rounds); it is checked end to end
against the one identity the volunteer typed, whoever relayed or stored the bytes.

Encoding (signed bytes): ``msgpack([SPEC_VERSION, [[key, value] ...sorted by key], coordinator
peer id (base58), created_at])``; the signature covers ``SIGNING_DOMAIN + those bytes``. Decoding
re-validates every value exactly like a TOML file, so a coordinator bug cannot smuggle a bad
value past a volunteer either. No pickle, size-limited (``MAX_SPEC_BYTES``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID as PeerID

SPEC_VERSION = 1
SIGNING_DOMAIN = b"swarmtrain/run-spec/1\x00"
MAX_SPEC_BYTES = 8192
MAX_SIGNATURE_BYTES = 128


class ConfigError(ValueError):
    """A run config value is missing, unknown or invalid; the message names the key."""


class SpecRefused(ValueError):
    """A run spec is unsigned, tampered with, issued by another peer, or malformed."""


@dataclass(frozen=True)
class _Field:
    key: str  # "section.name" as written in run.toml
    attr: str  # RunConfig attribute
    kind: type  # int, float or str
    check: Callable[[Any], bool]
    rule: str  # what ``check`` demands, in words, for the error message
    help: str  # the comment written above the key by ``swarmtrain init``


def _positive(value: Any) -> bool:
    return value > 0


def _non_negative(value: Any) -> bool:
    return value >= 0


# ``package.module:function`` (``model.factory``): dotted identifiers, a colon, an identifier.
FACTORY_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
MAX_FACTORY_CHARS = 200


def _factory_ok(value: Any) -> bool:
    return value == "" or (
        len(value) <= MAX_FACTORY_CHARS and re.fullmatch(FACTORY_PATTERN, value) is not None
    )


def _run_id_ok(value: Any) -> bool:
    return len(value) <= 64 and "/" not in value and value.isprintable() and " " not in value


FIELDS: tuple[_Field, ...] = (
    _Field("run.id", "run_id", str, _run_id_ok, "at most 64 printable characters, no '/' "
           "or space", 'run name peers share; "" lets the coordinator pick a fresh one'),
    _Field("run.rounds", "rounds", int, _positive, "a positive integer",
           "outer rounds; nodes exit with a summary after the last one"),
    _Field("model.d_model", "d_model", int, _positive, "a positive integer",
           "width of the byte-level transformer (embedded default model)"),
    _Field("model.n_layers", "n_layers", int, _positive, "a positive integer",
           "transformer blocks"),
    _Field("model.n_heads", "n_heads", int, _positive, "a positive integer",
           "attention heads; must divide d_model"),
    _Field("model.context", "model_context", int, _positive, "a positive integer",
           "longest sequence the model accepts (bytes)"),
    _Field("model.factory", "model_factory", str, _factory_ok,
           'empty or "package.module:function" (at most 200 characters)',
           '"" trains the default model above. Pipeline runs only: "package.module:function" '
           "trains\n# your own model instead (d_model, n_layers and n_heads are then unused):\n# "
           "function() returns an nn.Sequential whose first layer takes byte ids (batch,\n# "
           "training.sequence_length) and whose last returns (batch, sequence, 256) logits;\n# "
           "it is called with torch seeded from the run; every stage server must install it "
           "and\n# pass --allow-model with it (docs/pipelines.md)"),
    _Field("training.inner_steps", "inner_steps", int, _positive, "a positive integer",
           "DiLoCo's H: inner AdamW steps between two outer rounds"),
    _Field("training.batch_size", "batch_size", int, _positive, "a positive integer",
           "sequences per inner step on each peer"),
    _Field("training.sequence_length", "sequence_length", int, _positive,
           "a positive integer", "bytes per sequence; at most model.context"),
    _Field("training.inner_lr", "inner_lr", float, _positive, "a positive number",
           "AdamW learning rate of the inner steps"),
    _Field("training.outer_lr", "outer_lr", float, _positive, "a positive number",
           "Nesterov SGD learning rate of the outer step (OpenDiLoCo: 0.7)"),
    _Field("training.outer_momentum", "outer_momentum", float,
           lambda v: 0 <= v < 1, "a number in [0, 1)", "Nesterov momentum of the outer step"),
    _Field("training.outer_momentum_warmup", "outer_momentum_warmup", int, _non_negative,
           "a non-negative integer", "rounds over which the outer momentum ramps up from 0 "
           "(0: constant); with few rounds\n# full momentum from round 0 overshoots: 12 of 16 "
           "rounds is best in bench.diloco\n# (docs/diloco_tuning.md)"),
    _Field("swarm.matchmaking_timeout_s", "matchmaking_timeout_s", float, _positive,
           "a positive number", "seconds a round waits for peers to declare"),
    _Field("swarm.allreduce_timeout_s", "allreduce_timeout_s", float, _positive,
           "a positive number", "seconds an all-reduce may take before it fails"),
    _Field("pipeline.stages", "pipeline_stages", int, _non_negative,
           "a non-negative integer", "0: a DiLoCo run (every node trains the whole model). S > 0: "
           "a SWARM pipeline run: the\n# model cut into S stages (at most model.n_layers), "
           "served by stage servers (Adam at\n# training.inner_lr) and driven by trainers "
           "(`swarmtrain node --role trainer`)"),
    _Field("pipeline.microbatches", "pipeline_microbatches", int, _positive,
           "a positive integer", "microbatches (of training.batch_size sequences) per trainer "
           "round; run.rounds rounds"),
    _Field("pipeline.average_every_s", "pipeline_average_every_s", float, _positive,
           "a positive number", "seconds between two averagings of a stage's parameters by its "
           "servers"),
    _Field("pipeline.rebalance_every_s", "pipeline_rebalance_every_s", float, _non_negative,
           "a non-negative number", "seconds between two rebalancing decisions (a server moves "
           "to the bottleneck stage);\n# 0: servers never move"),
    _Field("verify.rate", "verify_rate", float, lambda v: 0 <= v <= 1, "a number in [0, 1]",
           "DiLoCo runs: the fraction of inner phases (tasks) a second peer re-executes; "
           "above 0 every inner\n# phase runs under RepOps (bit-reproducible, slower) from a "
           "fresh AdamW state, a task's\n# two commitments are compared and the coordinator "
           "referees a difference; the loser's\n# contribution is left out and the loser "
           "banned (docs/verification.md)"),
    _Field("verify.timeout_s", "verify_timeout_s", float, _positive, "a positive number",
           "seconds a verified round waits for a task's two commitments, or for the "
           "coordinator's verdict"),
)  # fmt: skip
_BY_KEY = {f.key: f for f in FIELDS}
_SECTIONS = tuple(dict.fromkeys(f.key.split(".")[0] for f in FIELDS))


@dataclass(frozen=True)
class RunConfig:
    """One run's settings; the defaults are the embedded default run (``swarmtrain local``)."""

    run_id: str = ""
    rounds: int = 5
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    model_context: int = 128
    inner_steps: int = 20
    batch_size: int = 8
    sequence_length: int = 64
    inner_lr: float = 3e-3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_momentum_warmup: int = 0
    model_factory: str = ""
    matchmaking_timeout_s: float = 4.0
    allreduce_timeout_s: float = 30.0
    pipeline_stages: int = 0
    pipeline_microbatches: int = 8
    pipeline_average_every_s: float = 5.0
    pipeline_rebalance_every_s: float = 3.0
    verify_rate: float = 0.0
    verify_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for spec in FIELDS:
            _check_value(spec, getattr(self, spec.attr))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must divide model.d_model ({self.d_model})"
            )
        if self.sequence_length > self.model_context:
            raise ConfigError(
                f"training.sequence_length ({self.sequence_length}) is longer than "
                f"model.context ({self.model_context})"
            )
        if self.model_factory and not self.is_pipeline:
            raise ConfigError(
                f"model.factory ({self.model_factory}) needs a pipeline run (pipeline.stages "
                "> 0): DiLoCo runs train the default model"
            )
        if self.verify_rate > 0 and self.is_pipeline:
            raise ConfigError(
                f"verify.rate ({self.verify_rate}) needs a DiLoCo run (pipeline.stages = 0): "
                "pipeline stages are not verified"
            )
        # A factory's model has its own layers: stage servers check the count when they cut it.
        if self.pipeline_stages > self.n_layers and not self.model_factory:
            raise ConfigError(
                f"pipeline.stages ({self.pipeline_stages}) is more than model.n_layers "
                f"({self.n_layers}): every stage needs at least one transformer block"
            )

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    @property
    def is_pipeline(self) -> bool:
        """A SWARM pipeline run (stage servers and trainers) rather than a DiLoCo run."""
        return self.pipeline_stages > 0

    def items(self) -> list[tuple[str, Any]]:
        """``[(toml key, value)]`` sorted by key: the canonical order the spec is signed in."""
        return sorted((f.key, getattr(self, f.attr)) for f in FIELDS)


def _check_value(spec: _Field, value: Any) -> None:
    # bool is an int subclass in Python; "rounds = true" is a mistake, not 1.
    if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, spec.kind):
        raise ConfigError(f"{spec.key} must be {spec.rule}, got {value!r}")
    if spec.kind is float and not math.isfinite(value):
        raise ConfigError(f"{spec.key} must be {spec.rule}, got {value!r}")
    if not spec.check(value):
        raise ConfigError(f"{spec.key} must be {spec.rule}, got {value!r}")


def config_from_mapping(data: Mapping[str, Any], *, source: str = "run config") -> RunConfig:
    """A ``RunConfig`` from parsed TOML (``{section: {key: value}}``); missing keys keep their
    defaults. Raises ConfigError naming the first unknown section or key, or the bad value."""
    values: dict[str, Any] = {}
    for section, body in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}] (known: {', '.join(_SECTIONS)})"
            )
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: {section} must be a [{section}] table")
        for name, value in body.items():
            spec = _BY_KEY.get(f"{section}.{name}")
            if spec is None:
                known = ", ".join(f.key for f in FIELDS if f.key.startswith(section + "."))
                raise ConfigError(f"{source}: unknown key {section}.{name} (known: {known})")
            if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            try:
                _check_value(spec, value)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None
            values[spec.attr] = value
    try:
        return RunConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: Path) -> RunConfig:
    """Read and validate ``run.toml``. Raises ConfigError (bad TOML or value, naming the key and
    the file) or OSError (unreadable file)."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return config_from_mapping(data, source=str(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
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
    for section in _SECTIONS:
        lines += ["", f"[{section}]"]
        for spec in FIELDS:
            if spec.key.split(".")[0] == section:
                lines.append(f"# {spec.help}")
                lines.append(
                    f"{spec.key.split('.')[1]} = {_toml_value(getattr(config, spec.attr))}"
                )
    return "\n".join(lines) + "\n"


def run_seed_of(run_id: str) -> int:
    """The run's seed for the initial parameters and the data assignment: every peer of a run
    derives the same one from the run id, so nobody has to download round 0's parameters."""
    return int.from_bytes(hashlib.sha256(b"swarmtrain/run-seed/" + run_id.encode()).digest()[:8])


# -- the signed spec ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """A validated config with a fixed run id, the coordinator that issued it, and when."""

    config: RunConfig
    coordinator: str  # base58 peer id
    created_at: float

    def __post_init__(self) -> None:
        if not self.config.run_id:
            raise SpecRefused("a run spec needs a run id")

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [
                SPEC_VERSION,
                [[k, v] for k, v in self.config.items()],
                self.coordinator,
                float(self.created_at),
            ],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> RunSpec:
        """Decode and re-validate. Raises SpecRefused naming what is wrong."""
        if len(data) > MAX_SPEC_BYTES:
            raise SpecRefused(f"run spec of {len(data)} bytes is over {MAX_SPEC_BYTES}")
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception as exc:
            raise SpecRefused(f"run spec is not valid msgpack: {exc}") from None
        if not (isinstance(obj, list) and len(obj) == 4 and obj[0] == SPEC_VERSION):
            raise SpecRefused("run spec has an unknown layout or version")
        _, pairs, coordinator, created_at = obj
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs
        ):
            raise SpecRefused("run spec settings are malformed")
        if not isinstance(coordinator, str) or not isinstance(created_at, float):
            raise SpecRefused("run spec coordinator or creation time is malformed")
        sections: dict[str, dict[str, Any]] = {}
        for key, value in pairs:
            section, _, name = key.partition(".")
            sections.setdefault(section, {})[name] = value
        try:
            config = config_from_mapping(sections, source="run spec")
        except ConfigError as exc:
            raise SpecRefused(str(exc)) from None
        return cls(config, coordinator, created_at)


def sign_spec(spec: RunSpec, key_pair: KeyPair) -> tuple[bytes, bytes]:
    """``(spec bytes, signature)`` signed by the coordinator's identity."""
    if str(PeerID.from_pubkey(key_pair.public_key)) != spec.coordinator:
        raise ValueError("the spec names another coordinator than this identity")
    data = spec.to_bytes()
    return data, key_pair.private_key.sign(SIGNING_DOMAIN + data)


def verify_spec(data: bytes, signature: bytes, coordinator: PeerID) -> RunSpec:
    """The spec, if ``signature`` is ``coordinator``'s over ``data`` and the spec names it.

    Raises SpecRefused with a message a volunteer can act on: unsigned, tampered with (or signed
    by someone else), issued for another coordinator, or malformed.
    """
    if not signature:
        raise SpecRefused(f"the run spec from {coordinator} is unsigned; refusing to train on it")
    try:
        public_key = coordinator.extract_public_key()
    except Exception:
        public_key = None
    if public_key is None:
        raise SpecRefused(f"peer id {coordinator} does not embed a public key to check specs")
    try:
        valid = len(signature) <= MAX_SIGNATURE_BYTES and public_key.verify(
            SIGNING_DOMAIN + data, signature
        )
    except Exception:
        valid = False
    if not valid:
        raise SpecRefused(
            f"the run spec's signature is not coordinator {coordinator}'s: the spec was "
            "tampered with or issued by someone else; refusing to train on it"
        )
    spec = RunSpec.from_bytes(data)
    if spec.coordinator != str(coordinator):
        raise SpecRefused(
            f"the run spec names coordinator {spec.coordinator}, not {coordinator}; refusing it"
        )
    return spec
