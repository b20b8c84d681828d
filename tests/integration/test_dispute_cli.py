"""``swarmtrain verify`` end to end (module entry point; the CLI wires the same ``run``): three
processes on loopback, RepOps on a small model of the default architecture (``--tiny``)."""

from __future__ import annotations

import json
import subprocess
import sys

from peerproc import ROOT


def verify_json(*args: str) -> dict:
    argv = [sys.executable, "-m", "swarmtrain.verify_cmd", "verify", "--tiny", "--json", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cheater_named_and_honest_hash_independent_of_threads() -> None:
    cheat = verify_json("--steps", "3", "--cheat-step", "1", "--cheat-op", "20", "--threads", "2")
    assert cheat["cheater"] and (cheat["step"], cheat["op"]) == (1, 20), cheat
    assert cheat["op_name"] == "layernorm" and cheat["rounds"] <= 2 + 7 + 4
    assert cheat["referee_seconds"] < cheat["task_seconds"]
    honest = verify_json("--steps", "3", "--threads", "1")
    assert honest["cheater"] is None and honest["rounds"] == 1, honest
    assert honest["honest_final_hash"] == cheat["honest_final_hash"]
    assert set(honest) >= {
        "cheater", "step", "op", "rounds", "bytes", "referee_seconds", "task_seconds",
        "honest_final_hash",
    }  # fmt: skip
