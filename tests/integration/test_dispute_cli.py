"""``swarmtrain verify`` end to end (module entry point; the CLI wires the same ``run``): three
processes on loopback, RepOps on a small model of the default architecture (``--tiny``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peerproc import ROOT

from swarmtrain.commands.verify import _dispatch, _first_step, _repops, _task, run
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


def test_a_transformers_model_config_is_verified_through_its_dispatch_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23 point 4: ``--model-config`` runs the task on a tiny Llama; ``--cheat-op`` indexes
    its aten operator list (here the last one: the fused AdamW's last written tensor). The command
    runs in this process (``run``, as the CLI calls it: transformers is imported once less),
    its two providers as processes."""
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 16}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = argparse.Namespace(
        model_config=str(path), steps=2, threads=1, seed=0, tiny=False, cheat_step=1,
        cheat_op=0, json=True, timeout=60.0, grad_clip=0.0,
    )  # fmt: skip
    assert run(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    prefix = "swarmtrain verify: --cheat-op 0 names no operator: record 0 loads lm.model.embed"
    assert line.startswith(prefix) and "operators are " in line
    last = int(line.rsplit("-", 1)[1].split()[0])  # "..., 123-456 (N of M records)"
    args.cheat_op = last
    assert run(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["step"], result["op"], result["op_name"]) == (
        1, last, "aten._fused_adamw_.default"
    )  # fmt: skip
    assert result["cheater"] and result["reason"] == "output differs from the referee's"
    assert result["ops_per_step"] == last + 2  # the records, then the step's state record


def test_grad_clip_puts_the_clip_in_the_default_models_trace_and_a_cheat_there_is_named() -> None:
    """Issue 23: ``--grad-clip`` verifies a clipped step, as a run's ``[training] grad_clip``
    is: the default model's step goes through the dispatch trace, whose records hold the clip
    (the gradient norms, then the scale). A provider that flips a bit of the total norm is
    named at that operator."""
    plain = argparse.Namespace(tiny=True, seed=0, model_config=None, grad_clip=0.0)
    clipped = argparse.Namespace(**{**vars(plain), "grad_clip": 0.5})
    names = [r.name for r in _first_step(clipped, _dispatch(clipped))]
    unclipped = [r.name for r in _first_step(plain, _dispatch(plain))]
    norms = [i for i, name in enumerate(names) if "linalg_vector_norm" in name]
    assert norms and not any("linalg_vector_norm" in name for name in unclipped), norms
    total = norms[-1]  # the norm of the per-tensor norms: the global norm the clip divides by
    cheat = verify_json(
        "--steps", "2", "--grad-clip", "0.5", "--cheat-step", "1", "--cheat-op", str(total)
    )  # fmt: skip
    assert cheat["cheater"] and (cheat["step"], cheat["op"]) == (1, total), cheat
    assert cheat["op_name"] == names[total] and "linalg_vector_norm" in cheat["op_name"]
    assert cheat["reason"] == "output differs from the referee's"
    assert cheat["ops_per_step"] == len(names) + 1  # the records, then the step's state record


def test_a_negative_grad_clip_is_refused_in_one_line() -> None:
    argv = [sys.executable, "-m", "swarmtrain.commands.verify", "verify", "--tiny"]
    done = subprocess.run(
        [*argv, "--grad-clip", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "swarmtrain verify: --grad-clip -1.0: must be 0 (off) or positive"
