"""The examples run as a user runs them: ``examples/tiny_llama/prepare.py`` writes a run whose
config loads, whose data and tokenizer read, and whose model builds and fits the data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from peerproc import ROOT

from diloco import check_sizes
from swarmtrain.config import load_config, with_base
from swarmtrain.training.workload import build_model, load_data


def test_the_tiny_llama_example_writes_a_run_that_loads_and_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = ROOT / "examples" / "tiny_llama" / "prepare.py"
    done = subprocess.run(
        [sys.executable, str(script), "mine"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "wrote mine/run.toml; run: swarmtrain local --config mine/run.toml"
    )
    monkeypatch.chdir(tmp_path)
    # Its paths are relative to its folder: read from there, as the coordinator and a node
    # with --data-dir mine read them.
    config = with_base(load_config(Path("mine/run.toml")), Path("mine"))
    corpus = load_data(config)
    assert corpus.vocab_size == 400
    check_sizes(corpus, batch_size=config.training.batch_size,
                sequence_length=config.training.sequence_length)  # fmt: skip
    model = build_model(config, corpus.vocab_size)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_the_verified_llama_example_loads_and_its_step_maps() -> None:
    """``examples/verified_llama/run.toml``: a verified transformers run the coordinator signs
    (its spec check, one traced step of the model, passes)."""
    from swarmtrain.verified.task import check_verifiable

    config = load_config(ROOT / "examples" / "verified_llama" / "run.toml")
    assert config.verify.rate > 0 and config.model.kind == "transformers"
    assert check_verifiable(config) > 500  # the dispatch log of one step (890 records)
