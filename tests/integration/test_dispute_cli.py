"""``swarmtrain verify`` end to end (module entry point; the CLI wires the same ``run``): three
processes on loopback, RepOps on a small model of the default architecture (``--tiny``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from peerproc import ROOT

from swarmtrain.commands.verify import _repops, _task
from verify.dispute.provider import Provider


def verify_json(*args: str) -> dict:
    argv = [sys.executable, "-m", "swarmtrain.commands.verify", "verify", "--tiny", "--json", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def final_hash_here(steps: int, threads: int) -> str:
    """The same task run in this process with another thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = _repops(argparse.Namespace(tiny=True, seed=0))
        start, task = _task(step, steps)
        return Provider(step, start, task).run().final_state_hash.hex()
    finally:
        torch.set_num_threads(before)


def test_cheater_named_and_honest_hash_independent_of_threads() -> None:
    cheat = verify_json("--steps", "3", "--cheat-step", "1", "--cheat-op", "20", "--threads", "2")
    assert cheat["cheater"] and (cheat["step"], cheat["op"]) == (1, 20), cheat
    assert cheat["op_name"] == "layernorm" and cheat["rounds"] <= 2 + 7 + 4
    assert cheat["referee_seconds"] < cheat["task_seconds"]
    assert cheat["reason"] == "output differs from the referee's"
    assert set(cheat) >= {
        "cheater", "step", "op", "rounds", "bytes", "referee_seconds", "task_seconds",
        "honest_final_hash",
    }  # fmt: skip
    assert cheat["honest_final_hash"] == final_hash_here(3, threads=1)


def test_a_cheat_op_that_names_no_operator_is_refused_before_anything_starts() -> None:
    """Issue 23's bad input: ``--cheat-op`` on a leaf record (a parameter load) made provider B
    fail while the command blamed provider A and printed A's KeyboardInterrupt traceback."""
    base = [sys.executable, "-m", "swarmtrain.commands.verify", "verify", "--tiny", "--steps", "3"]
    leaf = subprocess.run(
        [*base, "--cheat-step", "1", "--cheat-op", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert leaf.returncode == 2, leaf.stderr
    (line,) = leaf.stderr.strip().splitlines()
    assert line.startswith("swarmtrain verify: --cheat-op 0 names no operator: record 0 loads ")
    assert "operators are " in line and "Traceback" not in leaf.stderr
    late = subprocess.run(
        [*base, "--cheat-step", "3", "--cheat-op", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert late.returncode == 2
    assert late.stderr.strip() == "swarmtrain verify: --cheat-step 3: the task's steps are 0 to 2"
