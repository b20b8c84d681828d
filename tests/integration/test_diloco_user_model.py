"""A user's model in a DiLoCo run (``[model] factory``), with real processes on 127.0.0.1: a
node that did not allow the factory refuses the spec, two that did (``--allow-model``) train it
from the same seeded parameters to one state hash, and ``swarmtrain export`` writes the module's
own parameters. The model is ``tests/pipeline_user_model.py``, importable in the children as
``tests.pipeline_user_model`` through PYTHONPATH. Every wait is bounded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from peerproc import ROOT, SWARMTRAIN
from runproc import ROUND_LINE, node, start_coordinator, wait_exit
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(150)

FACTORY = "tests.pipeline_user_model:build"
PATHS = [str(ROOT), os.environ.get("PYTHONPATH", "")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in PATHS if p)}


def test_nodes_that_allow_a_users_model_train_it_and_one_that_did_not_refuses(
    tmp_path: Path,
) -> None:
    coordinator, join = start_coordinator(
        tmp_path, rounds=3, inner_steps=10, settings={"factory": f'"{FACTORY}"'}
    )
    try:
        refused = node(join, tmp_path / "refused", env=ENV)
        assert wait_exit(refused, 60) == 1
        errors = [e for e in refused.stderr.splitlines() if e.startswith("swarmtrain node:")]
        assert len(errors) == 1 and errors[0].endswith(f"pass --allow-model {FACTORY}"), errors
        nodes = [node(join, tmp_path / n, "--allow-model", FACTORY, env=ENV) for n in "ab"]
        for peer in nodes:
            assert wait_exit(peer, 100) == 0, peer.stderr[-3000:]
    finally:
        coordinator.stop()
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in "ab"]
    assert summaries[0]["state_hash"] == summaries[1]["state_hash"], summaries
    for peer, summary in zip(nodes, summaries, strict=True):
        assert summary["rounds_contributed"] == 3, (summary, peer.lines)
        assert summary["loss_last"] < summary["loss_first"], summary
        allowed = f"model {FACTORY} (allowed by --allow-model): "
        assert any(s.startswith(allowed) for s in peer.lines), peer.lines
        rounds = [s for s in peer.lines if ROUND_LINE.match(s)]
        assert len(rounds) == 3 and all("peers 2" in s for s in rounds), rounds
    exported = subprocess.run(
        [*SWARMTRAIN, "export", "--state-dir", str(tmp_path / "a"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, check=False, env=ENV, cwd=ROOT,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-2000:]
    from tests.pipeline_user_model import build

    module = build()
    module.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))  # its own names
    assert all(torch.isfinite(p).all() for p in module.parameters())
