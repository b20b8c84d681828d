"""A node's host memory at real model sizes: peak RSS against the float32 parameter bytes.

    python -m bench.memory [--params 100M] [--peers 2] [--rounds 2] [--inner-steps 2]
        [--batch 1] [--sequence 32] [--workdir DIR]

Runs what ``swarmtrain local --config run.toml`` runs: a coordinator and ``--peers`` real
``swarmtrain node`` processes on loopback, on a ``[model] kind = "transformers"`` Llama sized to
about ``--params`` parameters (vocabulary 256 on the default ``stdlib`` byte data, so nearly all
of them sit in the layers), AdamW inner steps, the swarm all-reduce, checkpoints every round and
the state served to joiners: the product's own path. Each node's peak RSS is exact: the kernel's
high-water mark of that process, read by ``os.wait4`` when it exits (``ru_maxrss``). The idle
baseline is a process that imports what a node imports (python, torch, transformers, the node's
modules) and nothing else, measured the same way.

Printed: a table per node (peak RSS, its ratio to the parameter bytes, the ratio above the idle
baseline, mean round time), then one JSON object as the last line: ``params``, ``param_bytes``
(4 x params), ``peak_rss_bytes`` (the largest node's), ``rss_over_param_bytes`` (that over
``param_bytes``), ``baseline_rss_bytes``, ``above_baseline_over_param_bytes``, ``round_s`` (mean
seconds of a round: inner phase plus averaging, over nodes and rounds), ``nodes`` (each node's
figures), ``state_hashes_agree`` and the settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.common import git_sha
from bench.progress import BenchProgress
from swarmtrain.commands.local import (
    Child,
    LocalFailed,
    LocalOptions,
    node_argv,
    read_summary,
    start_coordinator,
    work_directory,
)
from swarmtrain.commands.local_progress import read_round_line
from swarmtrain.config import config_from_mapping

VOCAB = 256  # the default stdlib data is bytes
BASELINE_IMPORTS = (
    "import torch, transformers\n"
    "from transformers import LlamaForCausalLM\n"
    "import swarmtrain.commands.node, swarmtrain.training.loop\n"
)


def parse_count(text: str) -> int:
    """``100M``, ``1.5M``, ``250K``, ``1G`` or a plain integer. ValueError otherwise."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    number = float(text[:-1] if scale > 1 else text)
    if not number > 0:
        raise ValueError(f"--params must be positive, got {text!r}")
    return int(number * scale)


def llama_params(hidden: int, layers: int, intermediate: int) -> int:
    """Exact parameter count of a Llama with these sizes, vocabulary ``VOCAB``, as many key/value
    heads as heads and untied embeddings (transformers' defaults)."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return 2 * VOCAB * hidden + layers * per_layer + hidden


def llama_config(params: int, sequence: int) -> dict[str, Any]:
    """A Llama config of about ``params`` parameters: width a multiple of 64 (heads of 64),
    MLP about 2.7 x the width, 2 layers for the smallest sizes up to 8 from 50M on."""
    layers = 2 if params < 5_000_000 else 4 if params < 50_000_000 else 8
    best: tuple[int, int, int] | None = None
    for hidden in range(64, 8193, 64):
        intermediate = 64 * max(1, round(2.7 * hidden / 64))
        count = llama_params(hidden, layers, intermediate)
        if best is None or abs(count - params) < abs(best[0] - params):
            best = (count, hidden, intermediate)
    assert best is not None
    _, hidden, intermediate = best
    return {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "max_position_embeddings": max(64, sequence),
    }


def wait_rusage(child: Child, timeout_s: float) -> int:
    """Wait for ``child`` to exit (at most ``timeout_s``) and return its peak RSS in bytes, the
    kernel's own figure for that process. Raises RuntimeError on a timeout or a failed exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(child.proc.pid, os.WNOHANG)
        if pid:
            child.proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} still running after {timeout_s:.0f} s")
        time.sleep(0.2)
    if child.proc.returncode != 0:
        raise RuntimeError(
            f"{child.name} exited with status {child.proc.returncode}: "
            f"{child.last_log_line() or 'no log'}"
        )
    return usage.ru_maxrss * 1024  # Linux reports KiB


def baseline_rss() -> int:
    """Peak RSS of a process that only imports what a node imports."""
    proc = subprocess.Popen([sys.executable, "-c", BASELINE_IMPORTS], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError("the baseline import process failed")
    return usage.ru_maxrss * 1024


def run(args: argparse.Namespace, workdir: Path, progress: BenchProgress) -> dict[str, Any]:
    model_config = llama_config(args.params, args.sequence)
    hidden, layers = model_config["hidden_size"], model_config["num_hidden_layers"]
    params = llama_params(hidden, layers, model_config["intermediate_size"])
    config = config_from_mapping(
        {
            "model": {"kind": "transformers", "config": model_config},
            "training": {"batch_size": args.batch, "sequence_length": args.sequence},
            # A 100M round moves 400 MB through loopback and writes 1.6 GB of checkpoints on a
            # busy 2-core machine: generous deadlines, so a slow round is measured, not failed.
            "swarm": {"matchmaking_timeout_s": 15.0, "allreduce_timeout_s": 300.0},
        },
        source="bench.memory",
    )
    options = LocalOptions(
        peers=args.peers, rounds=args.rounds, inner_steps=args.inner_steps, config=config
    )
    run_config = options.run_config(f"memory-{os.urandom(4).hex()}")
    threads = max(1, (os.cpu_count() or 1) // args.peers)
    print(
        f"model: llama, {params:,} parameters (hidden {hidden}, {layers} layers), "
        f"{args.peers} peers, {args.rounds} rounds of H={args.inner_steps}",
        flush=True,
    )
    baseline = baseline_rss()
    started = time.monotonic()
    peaks: list[int] = []
    children: list[Child] = []

    # Every node's rounds, read from its round lines (shown with --verbose).
    progress.add("rounds", args.peers * args.rounds, unit="node rounds")

    def show(line: str) -> None:
        if args.verbose:
            progress.line(line)
        if read_round_line(line) is not None:
            progress.advance("rounds")

    with ExitStack() as stack:
        stack.callback(lambda: [child.stop() for child in reversed(children)])
        progress.phase(f"starting a coordinator and {args.peers} nodes")
        join = start_coordinator(workdir, run_config, children, show)
        nodes = []
        for index in range(args.peers):
            node_dir = workdir / f"node{index}"
            child = Child(
                f"node {index}",
                node_argv(join, node_dir, threads),
                workdir / f"node{index}.log",
                lambda line, i=index: show(f"[{i}] {line}"),
            )
            children.append(child)
            nodes.append(child)
        progress.phase("the nodes train; their peak RSS is read when each exits")
        for child in nodes:
            peaks.append(wait_rusage(child, args.timeout_s - (time.monotonic() - started)))
        summaries = [read_summary(workdir / f"node{i}" / "summary.json") for i in range(args.peers)]
    param_bytes = 4 * params
    rounds = [float(s) for n in summaries for s in n["round_seconds"]]  # type: ignore[attr-defined]
    per_node = [
        {
            "peak_rss_bytes": peak,
            "rss_over_param_bytes": round(peak / param_bytes, 3),
            "round_s": [float(s) for s in n["round_seconds"]],  # type: ignore[attr-defined]
            "rounds_contributed": n["rounds_contributed"],
            "state_hash": n["state_hash"],
        }
        for peak, n in zip(peaks, summaries, strict=True)
    ]
    peak = max(peaks)
    return {
        "bench": "memory",
        "params": params,
        "param_bytes": param_bytes,
        "peak_rss_bytes": peak,
        "rss_over_param_bytes": round(peak / param_bytes, 3),
        "baseline_rss_bytes": baseline,
        "above_baseline_over_param_bytes": round((peak - baseline) / param_bytes, 3),
        "round_s": round(sum(rounds) / len(rounds), 2) if rounds else math.nan,
        "state_hashes_agree": len({n["state_hash"] for n in summaries}) == 1
        and all(n["rounds_contributed"] == args.rounds for n in summaries),
        "peers": args.peers,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "batch": args.batch,
        "sequence": args.sequence,
        "hidden": hidden,
        "layers": layers,
        "seconds": round(time.monotonic() - started, 1),
        "nodes": per_node,
        "git": git_sha(),
    }


def table(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        f"{result['params']:,} parameters = {result['param_bytes'] / mib:.0f} MiB of float32; "
        f"idle python+torch+transformers+node imports: {result['baseline_rss_bytes'] / mib:.0f} "
        "MiB",
        f"{'node':>4} {'peak RSS MiB':>13} {'x params':>9} {'x params above idle':>20} "
        f"{'round s':>8}",
    ]
    for i, node in enumerate(result["nodes"]):
        above = (node["peak_rss_bytes"] - result["baseline_rss_bytes"]) / result["param_bytes"]
        rounds = node["round_s"]
        lines.append(
            f"{i:>4} {node['peak_rss_bytes'] / mib:>13.0f} {node['rss_over_param_bytes']:>9.2f} "
            f"{above:>20.2f} {sum(rounds) / max(1, len(rounds)):>8.1f}"
        )
    agree = "agree" if result["state_hashes_agree"] else "DIFFER"
    lines.append(f"state hashes {agree}; {result['seconds']:.0f} s in all")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("100M"))
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default: a temporary one")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the nodes' lines")
    args = parser.parse_args()
    for name in ("peers", "rounds", "inner_steps", "batch", "sequence"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    with ExitStack() as stack:
        workdir = work_directory(stack, args.workdir, "memory-")
        try:
            with BenchProgress() as progress:
                result = run(args, workdir, progress)
        except (RuntimeError, LocalFailed) as exc:
            print(f"bench.memory: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
    print(table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
