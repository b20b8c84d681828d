"""One rule for the paths a run names (``swarmtrain.config.with_base``): relative to the folder
of the run.toml. The coordinator reads its copies from there to fingerprint the data and hash
the weights (``with_local_hashes``), the signed spec carries the paths as written, and a node
reads them from its ``--data-dir`` (its copy of that folder). Here a run.toml in a subfolder
names pretrained weights and two token files relative to itself, run from its parent folder, as
a user runs ``swarmtrain coordinator --config mine/run.toml``; and a run.toml written before the
rule (paths relative to the working directory) still works, with a warning."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID as PeerID
from tiny_lm import TINY_LLAMA

from diloco import DataError, build_causal_lm, pretrained_sha256
from swarmtrain.config import RunConfig, load_config, with_base
from swarmtrain.runspec import RunSpec, sign_spec, verify_spec
from swarmtrain.training.workload import build_model, check_data, load_data, with_local_hashes

pytest.importorskip("transformers")


def write_run(parent: Path, prefix: str) -> torch.Tensor:
    """``parent/mine``: run.toml, base/ (a save_pretrained tiny Llama) and data/{a,b}.bin; the
    run.toml's paths start with ``prefix``. Returns the saved weights, flat."""
    mine = parent / "mine"
    (mine / "data").mkdir(parents=True)
    ids = (np.arange(4000) * 7919 % TINY_LLAMA["vocab_size"]).astype("<u2")
    ids[:2500].tofile(mine / "data" / "a.bin")
    ids[2500:].tofile(mine / "data" / "b.bin")
    lm = build_causal_lm(TINY_LLAMA, seed=7).lm
    lm.save_pretrained(mine / "base", safe_serialization=True)
    (mine / "run.toml").write_text(
        f'[model]\nkind = "transformers"\npretrained = "{prefix}base"\n'
        f'[data]\nkind = "tokens"\npaths = ["{prefix}data/*.bin"]\n'
        "[training]\nsequence_length = 32\n"
    )
    return torch.cat([p.detach().reshape(-1) for p in lm.parameters()])


def travelled(config: RunConfig) -> RunConfig:
    """The config as a node receives it: signed by a coordinator, verified by the node."""
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    spec = RunSpec(config.replace(run={"id": "paths"}), str(coordinator), 1.0)
    return verify_spec(*sign_spec(spec, key_pair), coordinator).config


def node_model(config: RunConfig, data_dir: Path) -> torch.Tensor:
    """What a node with ``--data-dir data_dir`` loads: the data it checks, the model it builds."""
    here = with_base(config, data_dir)
    corpus = load_data(here)
    check_data(here, corpus)
    model = build_model(here, corpus.vocab_size)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_paths_relative_to_a_run_toml_in_a_subfolder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = write_run(tmp_path, "")
    monkeypatch.chdir(tmp_path)  # the run.toml's parent, not its folder
    warnings: list[str] = []
    config = load_config(Path("mine/run.toml"))
    assert isinstance(config.model.config, dict)  # mine/base/config.json
    signed = travelled(with_local_hashes(config, Path("mine"), warn=warnings.append))
    assert warnings == []
    # The spec carries the paths as written, and what this machine's copies give.
    assert signed.model.pretrained == "base" and signed.data.paths == ("data/*.bin",)
    assert signed.model.pretrained_sha256 == pretrained_sha256(tmp_path / "mine" / "base")
    assert len(signed.data.fingerprint) == 64
    # A node whose --data-dir is its copy of the folder, relative or absolute, starts from the
    # pretrained weights on data whose fingerprint is the spec's.
    assert torch.equal(node_model(signed, Path("mine")), weights)
    assert torch.equal(node_model(signed, tmp_path / "mine"), weights)
    # One run from the parent without --data-dir does not find them, and says where it looked.
    with pytest.raises(DataError, match=re.escape("data.paths: data/*.bin matches no file")):
        node_model(signed, Path("."))


def test_a_run_toml_with_paths_from_the_working_directory_still_works_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = write_run(tmp_path, "mine/")
    monkeypatch.chdir(tmp_path)
    warnings: list[str] = []
    config = load_config(Path("mine/run.toml"))  # mine/base's config.json, found from here
    assert isinstance(config.model.config, dict)
    signed = travelled(with_local_hashes(config, Path("mine"), warn=warnings.append))
    assert [w.split(":")[0] for w in warnings] == ["model.pretrained", "data.paths"]
    assert (
        "mine/mine/base does not exist: paths in a run.toml are relative to its folder"
        in (warnings[0])
    )
    assert signed.model.pretrained == "mine/base"
    # Its nodes ran from that working directory, and still do (--data-dir defaults to it).
    assert torch.equal(node_model(signed, Path(".")), weights)


def test_absolute_paths_and_the_default_run_are_kept(tmp_path: Path) -> None:
    config = RunConfig().replace(
        data={"kind": "tokens", "paths": (str(tmp_path / "a.bin"), "b/*.bin")}
    )
    assert with_base(config, tmp_path / "x[1]").data.paths == (
        str(tmp_path / "a.bin"),
        str(tmp_path / "x[[]1]" / "b" / "*.bin"),  # the folder's name taken literally
    )
    assert with_base(RunConfig(), tmp_path) == RunConfig()
