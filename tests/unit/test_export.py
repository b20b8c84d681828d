"""``swarmtrain export`` on a state directory made here (the spec a node keeps, a checkpoint of
a trained state): the files hold the checkpoint's parameters by name, a transformers model comes
out as a folder ``from_pretrained`` loads, and every bad input is one error naming its cause with
nothing written. The 3-peer run that exports a real node's state is in
tests/integration/test_local_transformers.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_lm import TINY_LLAMA

from diloco import checkpoint
from diloco.state import GlobalState, layout_digest
from swarmtrain.commands.export import REPORT_FILE, ExportError, export, save_spec
from swarmtrain.config import RunConfig
from swarmtrain.runspec import RunSpec
from swarmtrain.training.workload import build_model


def trained_state_dir(folder: Path, config: RunConfig, rounds: int = 3) -> torch.Tensor:
    """A node's state directory after ``rounds`` rounds: its spec and a checkpoint whose
    parameters are the seeded model's plus a known offset. Returns the checkpoint's vector."""
    spec = RunSpec(config, "12D3KooWcoordinator", 1.0)
    save_spec(folder, spec)
    vocab = int(config.model.config.get("vocab_size", 256)) if config.model.config else 256
    model = build_model(config, vocab_size=vocab)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    flat = flat + torch.linspace(-0.5, 0.5, flat.numel())  # "trained": not the seeded start
    layout = layout_digest([(n, tuple(p.shape)) for n, p in named])
    checkpoint.save(folder, GlobalState(rounds, flat, torch.zeros_like(flat), layout), "fp")
    return flat


def default_config() -> RunConfig:
    return RunConfig().replace(run={"id": "run-export"})


def test_the_default_model_comes_out_as_safetensors_with_the_checkpoints_parameters(
    tmp_path: Path,
) -> None:
    config = default_config()
    flat = trained_state_dir(tmp_path / "node", config)
    report = export(tmp_path / "node", tmp_path / "out")
    assert report.round == 3 and report.kind == "default" and report.parameters == flat.numel()
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    model = build_model(config)
    model.load_state_dict(tensors)
    exported = torch.cat([p.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert torch.equal(exported, flat)
    meta = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert meta["run_id"] == "run-export" and meta["state_hash"] == report.state_hash
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == list(report.files)


def test_a_transformers_model_comes_out_as_a_folder_from_pretrained_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = default_config().replace(
        model={"kind": "transformers", "config": dict(TINY_LLAMA)},
        training={"sequence_length": 32},
    )
    flat = trained_state_dir(tmp_path / "node", config)
    export(tmp_path / "node", tmp_path / "out")
    lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    loaded = torch.cat([p.detach().reshape(-1) for p in lm.parameters() if p.requires_grad])
    assert torch.equal(loaded, flat)


def test_bad_inputs_are_one_error_naming_the_cause_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no run spec"):
        export(tmp_path / "empty", tmp_path / "out")
    config = default_config()
    save_spec(tmp_path / "nockpt", RunSpec(config, "12D3KooWcoordinator", 1.0))
    with pytest.raises(ExportError, match="no checkpoint that verifies"):
        export(tmp_path / "nockpt", tmp_path / "out")
    trained_state_dir(tmp_path / "node", config)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not an empty folder"):
        export(tmp_path / "node", tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    # A checkpoint of another model (its layout) than the spec's.
    other = config.replace(model={"n_layers": config.model.n_layers + 1})
    save_spec(tmp_path / "node", RunSpec(other, "12D3KooWcoordinator", 1.0))
    with pytest.raises(ExportError, match="layout is not the model's"):
        export(tmp_path / "node", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_the_command_prints_one_line_or_one_error(tmp_path: Path) -> None:
    trained_state_dir(tmp_path / "node", default_config())
    state_dir = str(tmp_path / "node")
    command = [sys.executable, "-m", "swarmtrain.cli", "export", "--state-dir", state_dir]
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("exported run run-export after round 2 (state ")
    assert json.loads((tmp_path / "r.json").read_text())["parameters"] > 0
    again = subprocess.run(
        [*command, "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert again.returncode == 1
    assert again.stderr == (
        f"swarmtrain export: --out {tmp_path / 'out'}: a folder that is not empty; give a new "
        "or an empty one\n"
    )
