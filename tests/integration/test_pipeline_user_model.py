"""A user's model in a pipeline run, with real processes on 127.0.0.1: ``swarmtrain local
--pipeline-stages 2 --model-factory ...`` trains it, and a stage server refuses a spec naming a
factory it did not allow (``--allow-model``) while one that allows it serves.

The model is ``tests/pipeline_user_model.py`` (an ``nn.Sequential`` byte MLP), importable in
the children as ``tests.pipeline_user_model`` through PYTHONPATH. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from peerproc import ROOT, SWARMTRAIN, PeerProcess
from runproc import wait_exit
from test_pipeline_cli import coordinator, node

# About 20-40 s each on 2 idle cores; the limits leave room for a machine shared with other jobs.
pytestmark = pytest.mark.timeout(170)

FACTORY = "tests.pipeline_user_model:build"
PATHS = [str(ROOT), os.environ.get("PYTHONPATH", "")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in PATHS if p)}


def test_local_pipeline_trains_a_user_model(tmp_path: Path) -> None:
    summary_path = tmp_path / "s.json"
    result = subprocess.run(
        [
            *SWARMTRAIN, "local", "--pipeline-stages", "2", "--peers", "3", "--rounds", "3",
            "--pipeline-microbatches", "6", "--model-factory", FACTORY,
            "--json", str(summary_path),
        ],
        capture_output=True, text=True, timeout=150, check=False, cwd=ROOT, env=ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["stages"] == 2 and sorted(summary["servers_per_stage"]) == [1, 2], summary
    assert summary["loss_last"] < summary["loss_first"], (summary, result.stdout[-3000:])
    # The two servers of a stage built the same seeded parameters and averaged them.
    assert summary["stage_hashes_agree"] is True, (summary, result.stdout[-3000:])
    assert "loss " in result.stdout.splitlines()[-1], result.stdout[-2000:]


def test_local_pipeline_names_a_factory_it_cannot_import() -> None:
    result = subprocess.run(
        [*SWARMTRAIN, "local", "--pipeline-stages", "2", "--peers", "2",
         "--model-factory", "tests.no_such_model:build", "--pipeline-timeout", "60"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT, env=ENV,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cannot import tests.no_such_model" in result.stderr, result.stderr[-2000:]


def test_a_server_refuses_a_factory_it_did_not_allow(tmp_path: Path) -> None:
    with coordinator(tmp_path, stages=2, factory=FACTORY) as (coord, commands):
        server_cmd, trainer_cmd = commands
        assert f"model {FACTORY}" in coord.lines[0], coord.lines
        assert server_cmd[-2:] == ["--allow-model", FACTORY], server_cmd
        assert "--allow-model" not in trainer_cmd
        plain = server_cmd[:-2]  # a volunteer who did not allow the code
        refusing = node(plain, tmp_path / "refusing", env=ENV)
        allowing = node(server_cmd, tmp_path / "allowing", env=ENV)
        try:
            assert wait_exit(refusing, 90) == 1, refusing.stderr[-3000:]
            errors = refusing.stderr.strip().splitlines()
            assert errors[-1] == (
                f"swarmtrain node: run spec refused: run {run_id(coord)} names model factory "
                f"{FACTORY}, code this node imports only when you allow it: check that module, "
                f"then pass --allow-model {FACTORY}"
            ), refusing.stderr[-3000:]
            assert "Traceback" not in refusing.stderr
            assert not any(line.startswith("stage server") for line in refusing.lines)
            allowing.wait_line(lambda s: s.startswith("serving stage"), timeout_s=90)
            assert any(f"model {FACTORY} (allowed by" in line for line in allowing.lines)
        finally:
            for proc in (refusing, allowing):
                proc.stop()


def run_id(coord: PeerProcess) -> str:
    match = re.match(r"run (\S+): ", coord.lines[0])
    assert match, coord.lines
    return match.group(1)
