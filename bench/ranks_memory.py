"""Peak host memory of each of a node's local ranks, data parallel (DDP) against ``--fsdp``.

    python -m bench.ranks_memory [--params 30M] [--nproc 2] [--phases 2] [--inner-steps 2]
        [--batch 1] [--sequence 32] [--mode both|ddp|fsdp]

Drives ``swarmtrain.training.ranks.LocalRanks`` as a node's training loop does (this process
is rank 0; ranks 1..K-1 are spawned), on a ``[model] kind = "transformers"`` Llama of about
``--params`` parameters (``bench.memory.llama_config``) over the default byte data, for
``--phases`` inner phases of ``--inner-steps`` AdamW steps: with DDP every rank holds the
model, its gradients and AdamW's two moments; with ``--fsdp`` each rank holds 1/K of them
(plus the block being gathered), and rank 0 also DiLoCo's plain model and the phase's
gathered flat vector. Rank 0 here lacks a node's swarm side (averager, state store,
checkpoints), the same in both modes. Each rank's peak is its kernel high-water mark
(``VmHWM``), read before it ends; each mode runs in a fresh process (``--mode both`` runs
both, one after the other). Last line: one JSON object, by mode: ``params``,
``param_bytes`` and each rank's ``peak_rss_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.memory import llama_config, parse_count


def vm_hwm(pid: int | str = "self") -> int:
    """A live process's peak resident set (``VmHWM``) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def run_mode(args: argparse.Namespace, fsdp: bool) -> dict[str, Any]:
    """One mode in this process: returns its figures."""
    from diloco import inner_batches, load_stdlib_corpus
    from swarmtrain.config import RunConfig, run_seed_of
    from swarmtrain.training.inner_step import accumulate, inner_optimizer, set_lr
    from swarmtrain.training.ranks import LocalRanks
    from swarmtrain.training.workload import build_model, with_data_fingerprint

    config = with_data_fingerprint(
        RunConfig().replace(
            run={"id": "ranks-memory", "rounds": args.phases},
            model={"kind": "transformers", "config": llama_config(args.params, args.sequence)},
            training={
                "inner_steps": args.inner_steps,
                "batch_size": args.batch,
                "sequence_length": args.sequence,
            },
        )
    )
    training, corpus = config.training, load_stdlib_corpus()
    model = build_model(config, corpus.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    optimizer = inner_optimizer(model, training)
    ranks = LocalRanks(config, b"peer", args.nproc, torch.device("cpu"), threads=1, fsdp=fsdp)
    steps = args.inner_steps
    started = time.perf_counter()
    try:
        ranks.connect(model, optimizer)
        for phase in range(args.phases):
            batches = inner_batches(
                corpus, run_seed=run_seed_of(config.run.id), round=phase, peer_id=b"peer",
                steps=steps, batch_size=args.batch, context=args.sequence, shard=ranks.shard,
            )  # fmt: skip
            if fsdp:
                ranks.begin_sharded_phase(phase, steps, model, optimizer)
            else:
                ranks.begin_phase(phase, steps)
            for step in range(steps):
                if fsdp:
                    set_lr(ranks.sharded.optimizer, training, phase * steps + step, 1)
                    loss, _ = ranks.sharded.step([batches[step]])
                else:
                    set_lr(optimizer, training, phase * steps + step, 1)
                    loss, _ = accumulate(model, [batches[step]], training, ranks.ddp)
                ranks.mean_loss(loss)  # before the step, whose H-th gathers the digests
                if not fsdp:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            if fsdp:
                local = torch.empty(params)  # DiLoCo's flat vector, written into the model
                ranks.end_sharded_phase(local, model, optimizer)
                optimizer.state.clear()  # as the node does after the checkpoint
                torch.nn.utils.vector_to_parameters(local, model.parameters())
                del local
        seconds = time.perf_counter() - started
        peaks = [vm_hwm()] + [vm_hwm(p.pid) for p in ranks._procs if p.pid is not None]
        agree = ranks.digests.agree
    finally:
        ranks.close()
    return {
        "mode": "fsdp" if fsdp else "ddp",
        "params": params,
        "param_bytes": 4 * params,
        "peak_rss_bytes": peaks,
        "ranks_agree": agree,
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ranks_memory", description=__doc__)
    parser.add_argument("--params", type=parse_count, default=parse_count("30M"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--mode", choices=["both", "ddp", "fsdp"], default="both")
    args = parser.parse_args()
    if args.nproc < 2 or args.phases < 1 or args.inner_steps < 1 or args.batch < 1:
        parser.error("--nproc must be at least 2; --phases, --inner-steps, --batch at least 1")
    if args.mode != "both":
        print(json.dumps(run_mode(args, args.mode == "fsdp")), flush=True)
        return
    results: dict[str, Any] = {}
    for mode in ("ddp", "fsdp"):
        argv = [a for a in sys.argv[1:] if not a.startswith("--mode")]
        done = subprocess.run(
            [sys.executable, "-m", "bench.ranks_memory", *argv, "--mode", mode],
            capture_output=True, text=True, timeout=1800, check=False, env=os.environ.copy(),
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"bench.ranks_memory --mode {mode} failed:\n{done.stderr[-2000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2**20
    param_bytes = results["ddp"]["param_bytes"]
    print(f"{results['ddp']['params']:,} parameters = {param_bytes / mib:.0f} MiB of float32")
    print(f"{'mode':>5} {'rank':>4} {'peak RSS MiB':>13} {'x params':>9} {'seconds':>8}")
    for mode, result in results.items():
        for rank, peak in enumerate(result["peak_rss_bytes"]):
            print(f"{mode:>5} {rank:>4} {peak / mib:>13.0f} {peak / param_bytes:>9.2f} "
                  f"{result['seconds']:>8.1f}")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
