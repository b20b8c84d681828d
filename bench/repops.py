"""RepOps training-step time against native torch, same model, same batch, same process.

    python -m bench.repops [--steps 10] [--warmup 2] [--threads 1] [--batch 8] [--traced]

The anchor is ``diloco.model.ByteTransformer`` (default config, ~0.87M parameters) trained with
``torch.optim.AdamW`` (lr 2e-3) on a batch of ``--batch`` x 128 bytes: forward, loss, backward,
optimizer step. The RepOps side is ``verify.repops.step.train_step`` on the same parameters and
batch. The two alternate step by step, so a machine whose load changes during the run slows both
alike; the figures are medians over ``--steps`` (after ``--warmup`` of each), wall-clock and CPU
time. ``--traced`` also times ``RepOpsStep`` (the recorded step: every operator output hashed).
The last stdout line is one JSON object: repops_s, native_s, ratio (repops / native, wall
medians), plus CPU-time medians, threads and git_sha.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from bench.common import git_sha
from diloco.data import load_stdlib_corpus
from diloco.model import ByteTransformer
from verify.repops.step import RepOpsStep, train_step

T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """(fn's result, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--traced", action="store_true", help="also time the recorded step")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.batch < 1:
        parser.error("--steps, --threads and --batch must be positive, --warmup non-negative")
    torch.set_num_threads(args.threads)

    corpus = load_stdlib_corpus(max_bytes=2**20).train
    stepper = RepOpsStep(corpus.tobytes(), seed=0, batch_size=args.batch)
    model = ByteTransformer(seed=0)
    native_opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    state = {k: torch.from_numpy(v.copy()) for k, v in stepper.initial_state().items()}
    numpy_state = stepper.initial_state()

    def native_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        native_opt.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets)
        loss.backward()
        native_opt.step()
        return loss.item()

    times: dict[str, list[list[float]]] = {"native": [], "repops": [], "traced": []}
    losses: list[tuple[float, float]] = []
    for step in range(args.warmup + args.steps):
        inputs, targets = (torch.from_numpy(a) for a in stepper.batch(step))
        native_loss, *native = _timed(partial(native_step, inputs, targets))
        (state, loss), *repops = _timed(partial(train_step, state, inputs, targets))
        traced = _timed(partial(stepper, numpy_state, step))[1:] if args.traced else [0.0, 0.0]
        if step >= args.warmup:
            times["native"].append(native)
            times["repops"].append(repops)
            times["traced"].append(traced)
        losses.append((native_loss, loss.item()))

    def median(name: str, which: int) -> float:
        return statistics.median(t[which] for t in times[name])

    result = {
        "bench": "repops",
        "config": {"batch": args.batch, "context": 128, "threads": args.threads},
        "params": sum(p.numel() for p in model.parameters()),
        "repops_s": median("repops", 0),
        "native_s": median("native", 0),
        "ratio": median("repops", 0) / median("native", 0),
        "repops_cpu_s": median("repops", 1),
        "native_cpu_s": median("native", 1),
        "ratio_cpu": median("repops", 1) / median("native", 1),
        "git_sha": git_sha(),
    }
    if args.traced:
        result["traced_s"] = median("traced", 0)
    print(f"model: ByteTransformer default, {result['params']} parameters, batch {args.batch}x128")
    print(f"threads: {args.threads}; {args.steps} timed steps after {args.warmup} warm-up")
    for name in ("native", "repops", "traced") if args.traced else ("native", "repops"):
        walls = np.array([t[0] for t in times[name]]) * 1000
        print(
            f"{name:>7}: median {np.median(walls):7.1f} ms wall (min {walls.min():.1f}, "
            f"max {walls.max():.1f}), {median(name, 1) * 1000:7.1f} ms CPU"
        )
    print(f"ratio repops/native: {result['ratio']:.2f} wall, {result['ratio_cpu']:.2f} CPU")
    first, last = losses[0], losses[-1]
    print(f"loss native {first[0]:.3f} -> {last[0]:.3f}, repops {first[1]:.3f} -> {last[1]:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
