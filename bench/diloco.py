"""DiLoCo against synchronous data parallel and one worker alone, at equal tokens, on this machine.

    python -m bench.diloco [--workers 4] [--steps 2000] [--inner-steps 125] [--batch 8]
        [--context 128] [--inner-lr 2e-3] [--outer-lr 0.7] [--outer-momentum 0.9]
        [--compression int8|none] [--eval-batches 8]

The embedded default model (``ByteTransformer``) and corpus (the standard library's source), run
in one sitting, each method from the same seeded initial parameters:

- DiLoCo: ``--workers`` threads, each a ``diloco.DiLoCo`` with its own AdamW, ``--steps`` inner
  steps of ``--batch`` windows, averaging every ``--inner-steps`` through ``LocalAverage`` with the
  pseudo-gradient quantized as the swarm's codec would (int8 blockwise, with DiLoCo's error
  feedback). The all-reduce itself is in-process: this bench measures optimization, the all-reduce
  benches measure the wire.
- Data parallel: gradients averaged every step, which is one model taking ``--steps`` steps of
  ``workers x batch`` windows (the same windows the DiLoCo workers see, step by step).
- Alone: one worker's share, ``--steps`` steps of ``--batch`` windows.

Bytes each worker sends, bandwidth-optimal ring/butterfly all-reduce of N peers: data parallel
2(N-1)/N x 4 x params per step (float32 gradients); DiLoCo 2(N-1)/N x the codec's bytes per round.
Printed: held-out loss (nats/byte) of each, ``bytes_ratio`` (data parallel over DiLoCo),
``loss_ratio`` (DiLoCo over data parallel) and ``recovered_fraction`` = (alone - DiLoCo) /
(alone - data parallel). The last line is one JSON object with those keys and ``wan_loss_ratio``
(the equal-wall-clock comparison over shaped NAT-lab links is not built yet: null).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from bench.common import git_sha
from diloco import (
    ByteTransformer,
    DiLoCo,
    LocalAverage,
    eval_batches,
    evaluate,
    inner_batches,
    load_stdlib_corpus,
)
from swarm.compression import Compression, decode, encode, wire_bytes

RUN_SEED = 0


def _peer(k: int) -> bytes:
    return f"worker-{k}".encode()


def _batches(corpus: Any, args: argparse.Namespace, round: int, k: int) -> list[Any]:
    return inner_batches(
        corpus,
        run_seed=RUN_SEED,
        round=round,
        peer_id=_peer(k),
        steps=args.inner_steps,
        batch_size=args.batch,
        context=args.context,
    )


def _codec(compression: Compression) -> Any:
    def compress(flat: torch.Tensor) -> torch.Tensor:
        values = flat.detach().to("cpu", torch.float32).numpy()
        return torch.from_numpy(decode(encode(values, compression), compression, values.size))

    return compress


def run_diloco(corpus: Any, args: argparse.Namespace, heldout: list[Any]) -> float:
    rounds = args.steps // args.inner_steps
    local = LocalAverage(args.workers, timeout_s=3600)
    models = [ByteTransformer(seed=0) for _ in range(args.workers)]
    errors: list[BaseException] = []
    compress = None if args.compression is Compression.NONE else _codec(args.compression)

    def worker(k: int) -> None:
        try:
            model = models[k]
            inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
            with DiLoCo(
                model,
                inner,
                local.member(f"w{k}"),
                inner_steps=args.inner_steps,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
                compress=compress,
            ) as diloco:
                for r in range(rounds):
                    for inputs, targets in _batches(corpus, args, r, k):
                        model.loss(inputs, targets).backward()
                        diloco.step(samples=inputs.shape[0])
                        diloco.zero_grad()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    # Every worker holds the same global parameters after the last round.
    return evaluate(models[0], heldout)


def run_data_parallel(
    corpus: Any, args: argparse.Namespace, heldout: list[Any], workers: list[int]
) -> float:
    """Gradients averaged every step over ``workers``' windows: one model, one big batch."""
    model = ByteTransformer(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    for r in range(args.steps // args.inner_steps):
        shares = [_batches(corpus, args, r, k) for k in workers]
        for step in range(args.inner_steps):
            inputs = torch.cat([share[step][0] for share in shares])
            targets = torch.cat([share[step][1] for share in shares])
            model.loss(inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return evaluate(model, heldout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000, help="inner steps per worker")
    parser.add_argument("--inner-steps", type=int, default=125, help="H")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--compression", default="int8", choices=["int8", "none"])
    parser.add_argument("--eval-batches", type=int, default=8)
    args = parser.parse_args()
    args.compression = Compression[args.compression.upper()]
    if args.steps % args.inner_steps:
        parser.error("--steps must be a multiple of --inner-steps")
    torch.manual_seed(0)
    corpus = load_stdlib_corpus()
    heldout = eval_batches(corpus, batches=args.eval_batches, context=args.context)
    params = sum(p.numel() for p in ByteTransformer(seed=0).parameters())
    print(
        f"=== DiLoCo vs data parallel vs alone ({git_sha()}): {args.workers} workers x "
        f"{args.steps} steps of {args.batch}x{args.context} bytes, {params} parameters, "
        f"H={args.inner_steps}, outer Nesterov lr {args.outer_lr} momentum "
        f"{args.outer_momentum}, inner AdamW {args.inner_lr}, {args.compression.name} "
        f"pseudo-gradients, {os.cpu_count()} cores ===",
        flush=True,
    )
    results: dict[str, float] = {}
    for name, run in [
        ("diloco", lambda: run_diloco(corpus, args, heldout)),
        ("data_parallel", lambda: run_data_parallel(corpus, args, heldout, [*range(args.workers)])),
        ("alone", lambda: run_data_parallel(corpus, args, heldout, [0])),
    ]:
        start = time.perf_counter()
        results[name] = run()
        print(
            f"{name:>13}: held-out {results[name]:.4f} nats/byte "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    n = args.workers
    share = 2 * (n - 1) / n
    dp_bytes = share * 4 * params * args.steps
    diloco_bytes = share * wire_bytes(params, args.compression) * (args.steps // args.inner_steps)
    gap = results["alone"] - results["data_parallel"]
    summary = {
        "bytes_ratio": dp_bytes / diloco_bytes,
        "loss_ratio": results["diloco"] / results["data_parallel"],
        "recovered_fraction": (results["alone"] - results["diloco"]) / gap if gap else None,
        "wan_loss_ratio": None,
        "heldout": results,
        "bytes_per_worker": {"data_parallel": dp_bytes, "diloco": diloco_bytes},
        "config": {k: (v.name if isinstance(v, Compression) else v) for k, v in vars(args).items()},
        "git_sha": git_sha(),
    }
    print(
        f"bytes sent per worker: data parallel {dp_bytes / 1e6:.1f} MB, DiLoCo "
        f"{diloco_bytes / 1e6:.2f} MB -> bytes_ratio {summary['bytes_ratio']:.0f}; loss_ratio "
        f"{summary['loss_ratio']:.3f}; recovered_fraction "
        f"{np.nan if gap == 0 else summary['recovered_fraction']:.2f}; wan_loss_ratio: not built"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
