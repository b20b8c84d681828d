"""The run spec the coordinator signs.

A run is defined by its config (``swarmtrain.config``: model shape, DiLoCo settings, swarm
deadlines, number of rounds, and, for a SWARM pipeline run, the stage count and its periods, and
optionally a user's model, of which only the name is in the spec).
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

from dataclasses import dataclass
from typing import Any

import msgpack
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID as PeerID

from swarmtrain.config import ConfigError, RunConfig, config_from_mapping

SPEC_VERSION = 1
SIGNING_DOMAIN = b"swarmtrain/run-spec/1\x00"
# A [model.config] table (at most 16 KiB as JSON) travels in the spec.
MAX_SPEC_BYTES = 32768
MAX_SIGNATURE_BYTES = 128


class SpecRefused(ValueError):
    """A run spec is unsigned, tampered with, issued by another peer, or malformed."""


# -- the signed spec ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """A validated config with a fixed run id, the coordinator that issued it, and when."""

    config: RunConfig
    coordinator: str  # base58 peer id
    created_at: float

    def __post_init__(self) -> None:
        if not self.config.run.id:
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
