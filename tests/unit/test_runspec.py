"""Run config validation (errors name the key) and the coordinator-signed run spec."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgpack
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID as PeerID

from swarmtrain.runspec import (
    SIGNING_DOMAIN,
    ConfigError,
    RunConfig,
    RunSpec,
    SpecRefused,
    config_from_mapping,
    default_toml,
    load_config,
    sign_spec,
    verify_spec,
)


def test_default_toml_round_trips_to_the_defaults() -> None:
    text = default_toml()
    assert text.count("# ") > 10  # commented
    assert config_from_mapping(tomllib.loads(text)) == RunConfig()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[training]\ninner_step = 5\n", "unknown key training.inner_step"),
        ("[trainer]\nx = 1\n", "unknown section [trainer]"),
        ("[run]\nrounds = 0\n", "run.rounds must be a positive integer, got 0"),
        ("[run]\nrounds = true\n", "run.rounds must be a positive integer, got True"),
        ("[training]\nouter_momentum = 1.5\n", "training.outer_momentum must be a number in"),
        ('[training]\ninner_lr = "fast"\n', "training.inner_lr must be a positive number"),
        ("[model]\nn_heads = 3\n", "model.n_heads (3) must divide model.d_model (128)"),
        ("[training]\nsequence_length = 500\n", "training.sequence_length (500) is longer"),
        ('[run]\nid = "a/b"\n', "run.id must be"),
        ("run = 3\n", "run must be a [run] table"),
    ],
)
def test_bad_configs_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_ints_are_accepted_for_float_keys() -> None:
    assert config_from_mapping({"training": {"outer_lr": 1}}).outer_lr == 1.0


def _signed() -> tuple[bytes, bytes, PeerID]:
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    spec = RunSpec(RunConfig(run_id="r1", rounds=3), str(coordinator), 1.5)
    data, signature = sign_spec(spec, key_pair)
    return data, signature, coordinator


def test_a_signed_spec_verifies_and_round_trips() -> None:
    data, signature, coordinator = _signed()
    spec = verify_spec(data, signature, coordinator)
    assert spec.config == RunConfig(run_id="r1", rounds=3)
    assert spec.coordinator == str(coordinator) and spec.created_at == 1.5


def test_unsigned_tampered_and_foreign_specs_are_refused() -> None:
    data, signature, coordinator = _signed()
    with pytest.raises(SpecRefused, match="unsigned"):
        verify_spec(data, b"", coordinator)
    tampered = data.replace(b"\x03", b"\x09", 1)  # rounds 3 -> 9
    assert tampered != data
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(tampered, signature, coordinator)
    stranger = PeerID.from_pubkey(create_new_key_pair().public_key)
    with pytest.raises(SpecRefused, match="tampered with or issued by someone else"):
        verify_spec(data, signature, stranger)
    # A spec validly signed by its issuer but naming another coordinator is refused too.
    issuer = create_new_key_pair()
    obj = msgpack.unpackb(data, raw=False)
    obj[2] = str(stranger)
    relabelled = msgpack.packb(obj, use_bin_type=True)
    resigned = issuer.private_key.sign(SIGNING_DOMAIN + relabelled)
    with pytest.raises(SpecRefused, match="names coordinator"):
        verify_spec(relabelled, resigned, PeerID.from_pubkey(issuer.public_key))


def test_malformed_spec_bytes_are_refused() -> None:
    with pytest.raises(SpecRefused):
        RunSpec.from_bytes(b"\xc1garbage")
    with pytest.raises(SpecRefused, match="over"):
        RunSpec.from_bytes(b"x" * 10000)
