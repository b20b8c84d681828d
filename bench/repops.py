"""RepOps training-step time against native torch, same model, same batch, same process.

    python -m bench.repops [--steps 10] [--warmup 2] [--threads 1] [--batch 8] [--traced]
    python -m bench.repops --model default|llama-tiny|gpt2-tiny [--list-ops] [--steps 10] ...

With ``--model`` the RepOps side is RepOps by dispatch (``verify.dispatch.RepOpsMode``): the
named model's own forward, loss, backward and ``torch.optim.AdamW(fused=True)`` step (the native
side: ``torch.optim.AdamW``'s default, the single-tensor loop on a CPU), run under the mode, on a
copy of the native side's parameters. ``default`` is ``ByteTransformer``'s default config;
``llama-tiny`` and ``gpt2-tiny`` are ``transformers`` models built from the configs in
``DISPATCH_MODELS`` (about 5M parameters each, nothing downloaded). Without ``--model``, the
RepOps side is the hand-written graph of the default model (``verify.repops.step``):

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
import contextlib
import copy
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from bench.common import git_sha
from bench.progress import BenchProgress
from diloco.data import load_stdlib_corpus
from diloco.model import ByteTransformer
from verify.dispatch import RepOpsMode
from verify.repops.step import RepOpsStep, batch_for, train_step

T = TypeVar("T")
CONTEXT = 128
# The transformers models of --model: byte tokens (the vocabulary covers 0-255 and more, as a
# tokenizer's would), context 128, no dropout (a verified step has no RNG). Their config.json
# files, which `swarmtrain verify --model-config` takes too, are examples/configs/NAME.json.
CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
DISPATCH_MODELS: dict[str, dict[str, object]] = {
    name: json.loads((CONFIGS / f"{name}.json").read_text()) for name in ("llama-tiny", "gpt2-tiny")
}


def _timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """(fn's result, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _medians(times: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Median wall (``_s``) and CPU (``_cpu_s``) seconds of a step, and RepOps over native."""

    def median(name: str, which: int) -> float:
        return statistics.median(t[which] for t in times[name])

    return {
        "repops_s": median("repops", 0),
        "native_s": median("native", 0),
        "ratio": median("repops", 0) / median("native", 0),
        "repops_cpu_s": median("repops", 1),
        "native_cpu_s": median("native", 1),
        "ratio_cpu": median("repops", 1) / median("native", 1),
    }


def _print_times(
    times: dict[str, list[tuple[float, float]]],
    names: tuple[str, ...],
    result: dict[str, Any],
    losses: list[tuple[float, float]],
) -> None:
    """Each way's step times, the ratio, and the first and last losses, readable."""
    for name in names:
        walls = np.array([t[0] for t in times[name]]) * 1000
        cpu = statistics.median(t[1] for t in times[name])
        print(
            f"{name:>7}: median {np.median(walls):7.1f} ms wall (min {walls.min():.1f}, "
            f"max {walls.max():.1f}), {cpu * 1000:7.1f} ms CPU"
        )
    print(f"ratio repops/native: {result['ratio']:.2f} wall, {result['ratio_cpu']:.2f} CPU")
    first, last = losses[0], losses[-1]
    print(f"loss native {first[0]:.3f} -> {last[0]:.3f}, repops {first[1]:.3f} -> {last[1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--traced", action="store_true", help="also time the recorded step")
    parser.add_argument(
        "--list-ops", action="store_true", help="with --model: print each aten operator's calls"
    )
    parser.add_argument(
        "--model",
        choices=["default", *DISPATCH_MODELS],
        help="time RepOps by dispatch on this model (default: the hand-written graph)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.batch < 1:
        parser.error("--steps, --threads and --batch must be positive, --warmup non-negative")
    if args.list_ops and not args.model:
        parser.error("--list-ops lists RepOps by dispatch's operators: it needs --model")
    if args.model and args.traced:
        parser.error("--traced times the hand-written graph; it does not combine with --model")
    torch.set_num_threads(args.threads)
    if args.model:
        dispatch_bench(args)
        return

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
    progress = BenchProgress(unit="steps")
    progress.add("repops", args.warmup + args.steps)
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
        progress.advance("repops")
    progress.close()

    def median(name: str, which: int) -> float:
        return statistics.median(t[which] for t in times[name])

    result = {
        "bench": "repops",
        "config": {"batch": args.batch, "context": 128, "threads": args.threads},
        "params": sum(p.numel() for p in model.parameters()),
        **_medians(times),
        "git_sha": git_sha(),
    }
    if args.traced:
        result["traced_s"] = median("traced", 0)
    print(f"model: ByteTransformer default, {result['params']} parameters, batch {args.batch}x128")
    print(f"threads: {args.threads}; {args.steps} timed steps after {args.warmup} warm-up")
    names = ("native", "repops", "traced") if args.traced else ("native", "repops")
    _print_times(times, names, result, losses)
    print(json.dumps(result))


def _build(name: str) -> nn.Module:
    if name == "default":
        return ByteTransformer(seed=0)
    from diloco.causal_lm import build_causal_lm  # imports transformers: only when asked

    return build_causal_lm(DISPATCH_MODELS[name], seed=0)


def dispatch_bench(args: argparse.Namespace) -> None:
    """--model: the model's native step against the same step under ``RepOpsMode``."""
    corpus = load_stdlib_corpus(max_bytes=2**20).train.tobytes()
    native_model = _build(args.model)
    repops_model = copy.deepcopy(native_model)
    sides = {
        "native": (native_model, torch.optim.AdamW(native_model.parameters(), lr=2e-3)),
        # fused=True: its two aten operators map to RepOps' one-pass AdamW (verify.dispatch.optim)
        "repops": (
            repops_model,
            torch.optim.AdamW(repops_model.parameters(), lr=2e-3, fused=True),
        ),
    }

    modes: list[RepOpsMode] = []  # the last RepOps step's mode: its operator count

    def step(name: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        model, optimizer = sides[name]
        if name == "repops":
            modes[:] = [RepOpsMode()]
        with modes[0] if name == "repops" else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss(inputs, targets)
            loss.backward()
            optimizer.step()
        return loss.item()

    times: dict[str, list[tuple[float, float]]] = {"native": [], "repops": []}
    losses: list[tuple[float, float]] = []
    progress = BenchProgress(unit="steps")
    progress.add(args.model, args.warmup + args.steps)
    for i in range(args.warmup + args.steps):
        inputs, targets = (
            torch.from_numpy(a) for a in batch_for(corpus, 0, i, args.batch, CONTEXT)
        )
        native_loss, *native = _timed(partial(step, "native", inputs, targets))
        repops_loss, *repops = _timed(partial(step, "repops", inputs, targets))
        if i >= args.warmup:
            times["native"].append((native[0], native[1]))
            times["repops"].append((repops[0], repops[1]))
        losses.append((native_loss, repops_loss))
        progress.advance(args.model)
    progress.close()

    result = {
        "bench": "repops",
        "mode": "dispatch",
        "model": args.model,
        "config": {"batch": args.batch, "context": CONTEXT, "threads": args.threads},
        "params": sum(p.numel() for p in native_model.parameters()),
        "ops_per_step": sum(modes[0].ops.values()),
        **_medians(times),
        "git_sha": git_sha(),
    }
    print(
        f"model: {args.model} ({type(native_model).__name__}), {result['params']} parameters, "
        f"batch {args.batch}x{CONTEXT}, {result['ops_per_step']} aten operators a step"
    )
    print(f"threads: {args.threads}; {args.steps} timed steps after {args.warmup} warm-up")
    _print_times(times, ("native", "repops"), result, losses)
    if args.list_ops:
        print(f"{'calls':>6}  aten operator (one RepOps step)")
        for name, calls in sorted(modes[0].ops.items()):
            print(f"{calls:6d}  {name}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
