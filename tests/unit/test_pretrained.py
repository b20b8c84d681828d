"""``[model] pretrained``: a run starts from local weights whose SHA-256 the signed spec carries.

A tiny Llama saved here with ``save_pretrained`` (nothing is downloaded) is the user's
checkpoint: its folder gives the architecture when ``model.config`` is unset, the coordinator's
``with_model_hash`` fills in the hash, every node's ``build_model`` checks its copy against it and
loads the weights (not the seeded ones), and a changed, absent or foreign file is one error naming
the key, the file and, for a mismatch, both hashes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_lm import TINY_LLAMA

from diloco import ModelError, build_causal_lm, pretrained_sha256
from swarmtrain.config import ConfigError, load_config
from swarmtrain.training.workload import WorkloadError, build_model, with_model_hash

transformers = pytest.importorskip("transformers")


def saved_llama(folder: Path, config: dict = TINY_LLAMA, seed: int = 7) -> torch.Tensor:
    """A "pretrained" tiny Llama in ``folder`` (save_pretrained); returns its flat weights."""
    lm = build_causal_lm(config, seed=seed).lm
    lm.save_pretrained(folder, safe_serialization=True)
    return torch.cat([p.detach().reshape(-1) for p in lm.parameters()])


def write_toml(folder: Path, model_lines: str) -> Path:
    path = folder / "run.toml"
    path.write_text(f"[model]\nkind = \"transformers\"\n{model_lines}\n[training]\n"
                    "sequence_length = 32\n")  # fmt: skip
    return path


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_node_starts_from_the_pretrained_folder_the_spec_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # pretrained paths are the node's, from where it runs
    weights = saved_llama(tmp_path / "base")
    config = load_config(write_toml(tmp_path, 'pretrained = "base"'))
    assert isinstance(config.model.config, dict)  # the folder's config.json
    assert config.model.config["hidden_size"] == TINY_LLAMA["hidden_size"]
    assert config.model.pretrained_sha256 == ""
    signed = with_model_hash(config)
    assert signed.model.pretrained_sha256 == pretrained_sha256(tmp_path / "base")
    assert with_model_hash(signed) == signed  # a set hash is kept
    model = build_model(signed, vocab_size=TINY_LLAMA["vocab_size"])
    assert torch.equal(flat(model), weights)
    seeded = build_model(signed, vocab_size=TINY_LLAMA["vocab_size"], weights=False)
    assert not torch.equal(flat(seeded), weights)  # the run seed's, for export to overwrite


def test_one_safetensors_file_works_and_other_bytes_are_refused_with_both_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    weights = saved_llama(tmp_path / "base")
    config = load_config(
        write_toml(tmp_path, 'pretrained = "base/model.safetensors"\nconfig = "base/config.json"')
    )
    signed = with_model_hash(config)
    assert torch.equal(flat(build_model(signed, vocab_size=400)), weights)
    # This node's copy differs (another seed's weights in the same file).
    saved_llama(tmp_path / "base", seed=8)
    with pytest.raises(WorkloadError) as refused:
        build_model(signed, vocab_size=400)
    message = str(refused.value)
    assert message.startswith("model.pretrained: base/model.safetensors on this node has SHA-256 ")
    found = pretrained_sha256(tmp_path / "base" / "model.safetensors")
    assert found[:16] in message and signed.model.pretrained_sha256[:16] in message


def test_absent_foreign_and_unsigned_weights_are_one_error_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in TINY_LLAMA.items())
    lines = f'pretrained = "nowhere.safetensors"\nconfig = {{ {table} }}'
    config = load_config(write_toml(tmp_path, lines))
    with pytest.raises(
        ModelError, match=re.escape("model.pretrained: nowhere.safetensors does not exist")
    ):
        with_model_hash(config)
    # Weights of a wider model than the spec's config.
    saved_llama(tmp_path / "wide", {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128})
    wide = with_model_hash(config.replace(model={"pretrained": "wide"}))
    with pytest.raises(
        ModelError, match=re.escape("model.pretrained: wide does not fit model.config")
    ):
        build_model(wide, vocab_size=400)
    # A spec without the hash (a coordinator that did not fill it in) is refused too.
    unsigned = config.replace(model={"pretrained": "wide"})
    with pytest.raises(
        WorkloadError, match=re.escape("model.pretrained_sha256: the run spec carries none")
    ):
        build_model(unsigned, vocab_size=400)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    junk = with_model_hash(config.replace(model={"pretrained": "junk.safetensors"}))
    with pytest.raises(ModelError, match=re.escape("junk.safetensors is not safetensors")):
        build_model(junk, vocab_size=400)


def test_pretrained_needs_the_transformers_kind(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('[model]\npretrained = "base"\n')
    with pytest.raises(
        ConfigError, match=re.escape('model.pretrained needs model.kind = "transformers"')
    ):
        load_config(tmp_path / "run.toml")
