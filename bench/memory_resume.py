"""A restarted node's host memory: the peak RSS of resuming a DiLoCo checkpoint at real sizes.

    python -m bench.memory_resume [--params 100M] [--workdir DIR]

Builds ``bench.memory``'s Llama of about ``--params`` parameters, trains one round alone (DiLoCo
with a ``LocalAverage`` of one, H = 1, AdamW) into a checkpoint, then, in a fresh process,
builds the model and AdamW again (its moments allocated by one step, as a node's are when its
checkpoint is loaded into them), and constructs ``DiLoCo`` on that state directory: the resume
a restarted node makes. The resume's cost is the child's peak RSS while it resumes (``VmHWM``,
reset just before through ``/proc/self/clear_refs``) over its RSS just before it.

Printed: one line of figures, then one JSON object as the last line: ``params``,
``param_bytes``, ``checkpoint_bytes``, ``rss_before_bytes``, ``peak_rss_bytes``,
``resume_over_param_bytes`` ((peak - before) / param bytes), ``resume_s``, ``state_hash`` (equal
to the trained one: ``hash_agrees``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from bench.common import git_sha
from bench.memory import llama_config, llama_params, parse_count
from diloco import DiLoCo, LocalAverage, build_causal_lm
from swarmtrain.commands.local import work_directory


def _build(params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_causal_lm(llama_config(params, 32), seed=1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _one_step(model: Any, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    model.loss(tokens, tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the high-water mark) of this process, in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def make(params: int, state_dir: Path) -> dict[str, Any]:
    """Train one round alone into ``state_dir``; the state hash and the checkpoint's size."""
    model, optimizer = _build(params)
    with DiLoCo(model, optimizer, LocalAverage(1).member("solo"), inner_steps=1,
                state_dir=state_dir) as diloco:  # fmt: skip
        _one_step(model, optimizer)  # the hook runs the round and checkpoints it
        if diloco.round != 1:
            raise RuntimeError("the round did not run")
        state_hash = diloco.state_hash()
    (path,) = state_dir.glob("diloco-*.ckpt")
    return {"state_hash": state_hash, "checkpoint_bytes": path.stat().st_size}


def resume(params: int, state_dir: Path) -> dict[str, Any]:
    """In this (fresh) process: the model and AdamW, then the resume, measured."""
    model, optimizer = _build(params)
    _one_step(model, optimizer)  # AdamW's moments exist, as in a node that trained
    before = _status_bytes("VmRSS")
    # The high-water mark from here on: the resume's own peak. (Not ``ru_maxrss``: it keeps the
    # build's peak, and across exec even the forking parent's size.)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    started = time.perf_counter()
    diloco = DiLoCo(model, optimizer, LocalAverage(1).member("solo"), inner_steps=1,
                    state_dir=state_dir)  # fmt: skip
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    return {
        "round": diloco.round,
        "state_hash": diloco.state_hash(),
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "resume_s": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("100M"))
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default: a temporary one")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.child is not None:
        print(json.dumps(resume(args.params, args.child)))
        return
    with ExitStack() as stack:
        state_dir = work_directory(stack, args.workdir, "memory-resume-") / "node"
        made = make(args.params, state_dir)
        child = subprocess.run(
            [sys.executable, "-m", "bench.memory_resume", "--params", str(args.params),
             "--child", str(state_dir)],
            capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        if child.returncode != 0:
            print(
                f"bench.memory_resume: the resume failed: {child.stderr[-2000:]}", file=sys.stderr
            )
            raise SystemExit(1)
        resumed = json.loads(child.stdout.strip().splitlines()[-1])
    config = llama_config(args.params, 32)
    params = llama_params(
        config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    )
    param_bytes = 4 * params
    over = (resumed["peak_rss_bytes"] - resumed["rss_before_bytes"]) / param_bytes
    result = {
        "bench": "memory_resume",
        "params": params,
        "param_bytes": param_bytes,
        "checkpoint_bytes": made["checkpoint_bytes"],
        "rss_before_bytes": resumed["rss_before_bytes"],
        "peak_rss_bytes": resumed["peak_rss_bytes"],
        "resume_over_param_bytes": round(over, 3),
        "resume_s": resumed["resume_s"],
        "state_hash": resumed["state_hash"],
        "hash_agrees": resumed["state_hash"] == made["state_hash"] and resumed["round"] == 1,
        "git": git_sha(),
    }
    mib = 2**20
    print(
        f"{params:,} parameters: resuming a {made['checkpoint_bytes'] / mib:.0f} MiB checkpoint "
        f"took {resumed['resume_s']:.1f} s and {over:.2f}x the parameters' bytes above the "
        f"{resumed['rss_before_bytes'] / mib:.0f} MiB before it (peak "
        f"{resumed['peak_rss_bytes'] / mib:.0f} MiB); state hash "
        + ("agrees" if result["hash_agrees"] else "DIFFERS")
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
