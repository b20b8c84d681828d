"""DiLoCo against synchronous data parallel and one worker alone, at equal tokens, on this machine.

    python -m bench.diloco [--workers 4] [--steps 2000] [--inner-steps 125 | H1,H2,...] [--batch 8]
        [--context 128] [--inner-lr 2e-3] [--schedule cosine|constant] [--warmup 0.05]
        [--final-lr 0.1] [--outer-lr 1.0] [--outer-momentum 0.9] [--outer-momentum-warmup 12]
        [--compression int8|none|sparse] [--sparse-density 0.0146] [--sparse-bits 2]
        [--sparse-chunk 4096] [--sparse-select part|chunk] [--sparse-outer-lr 2.0]
        [--sparse-outer-momentum M]
        [--sparse-error-decay 1.0] [--fragments F] [--eval-batches 8] [--split-seed 0]
        [--overlap] [--sequential]
        [--only diloco,...] [--wan [--wan-budget-s 150]]

The embedded default model (``ByteTransformer``) and corpus (the standard library's source), run
in one sitting, each method from the same seeded initial parameters, the three side by side in
threads (``--sequential``: one after another; the losses do not change, only the wall clock):

- DiLoCo: ``--workers`` threads, each a ``diloco.DiLoCo`` with its own AdamW, ``--steps`` inner
  steps of ``--batch`` windows, averaging every ``--inner-steps`` (H; a comma list gives H per
  round, the last repeating) through ``LocalAverage``. Outer Nesterov SGD whose momentum ramps
  from 0 over ``--outer-momentum-warmup`` rounds (``OuterConfig.momentum_at``). With int8 the
  pseudo-gradient is quantized as the swarm's all-reduce does it (int8 blocks per tensor within
  each peer's part, and the mean again for the all-gather), with DiLoCo's error feedback on the
  sender's side. The all-reduce itself is in-process: this bench measures optimization, the
  all-reduce benches measure the wire.
- Sparse DiLoCo (``--compression sparse``, beside int8 DiLoCo in the same sitting): each
  worker's part slices go through ``swarm.SparseCodec`` (``--sparse-select part``: the top
  ``--sparse-density`` of each worker's part wherever it lies, a scale per ``--sparse-chunk``
  entries; ``chunk``: the top of every chunk) at ``--sparse-bits`` bits with error feedback, and
  the mean is exact over the decoded slices, as the swarm's gathering all-reduce computes it (no
  re-quantization). Its defaults (pooled, 60 of every 4096 entries on average, outer lr 2.0, the
  int8 run's momentum, undecayed error feedback) are the best of seventeen settings on the
  validation half at 500 steps, H=125 (docs/diloco_tuning.md), at a ``sparse_bytes_ratio`` over
  10,000 (10,703: the bytes of the per-chunk 3 of every 256 it replaced, 10,740).
  ``--sparse-outer-momentum 0``: SparseLoCo's outer step (plain SGD; the error-feedback residual
  in the momentum's place); ``--sparse-error-decay`` < 1: SparseLoCo's decayed residual.
- Overlap (``--overlap``, as ``bench.diloco_wan``'s): the one-round-delayed outer step
  (``DiLoCo(overlap=True)``), each round's averaging behind the next inner phase; with
  ``--compression sparse`` the sparse run's only (the int8 run beside it stays synchronous),
  else the int8 run's. In process the averaging hides nothing worth timing: this measures what
  the delay does to the loss, cheaply, without the NAT lab.
- Streaming fragments (``--fragments F``, both DiLoCo runs): round r averages and outer-steps
  fragment r mod F of the model only (``DiLoCo(fragments=F)``), so a round's bytes are that
  fragment's; the bytes below count each round's fragment.
- Data parallel: gradients averaged every step, which is one model taking ``--steps`` steps of
  ``workers x batch`` windows (the same windows the DiLoCo workers see, step by step).
- Alone: one worker's share, ``--steps`` steps of ``--batch`` windows.

All three use the same inner learning rate schedule, per inner step: ``cosine`` (the default) is
a linear warm-up over ``--warmup`` of the steps, then a cosine decay to ``--final-lr`` of the peak;
``constant`` keeps ``--inner-lr``. Why these defaults (docs/diloco_tuning.md has every run): at
1000 steps the schedule took alone from 2.387 to 1.905 nats/byte; outer momentum 0.9 from the
first round made DiLoCo worse than alone (1.943), model averaging (momentum 0) reached 1.871, and
momentum ramped over 4 rounds 1.798; at 2000 steps (16 rounds) a ramp over 4, 8 and 12 rounds
recovered 0.34, 0.50 and 0.52 of the gap to data parallel.

Held-out losses, two halves (``diloco.validation_split``: the held-out files dealt into a
validation and a test half by a hash seeded with ``--split-seed``, disjoint): every setting is
tuned on the validation half (printed, and under ``validation`` in the JSON), and the figures
reported (``heldout`` and the ratios) are the test half's, which no setting was chosen on.

Bytes each worker sends, bandwidth-optimal ring/butterfly all-reduce of N peers: data parallel
2(N-1)/N x 4 x params per step (float32 gradients); DiLoCo 2(N-1)/N x the codec's bytes per round
(per-tensor, per-part int8 blocks: a few more scales than one flat vector); sparse DiLoCo (N-1)/N x
(the slices' bytes + the reduced parts' bytes, each N slices). Printed: held-out loss (nats/byte,
test half) of each, ``bytes_ratio`` (data parallel over DiLoCo), ``loss_ratio`` (DiLoCo over data
parallel) and ``recovered_fraction`` = (alone - DiLoCo) / (alone - data parallel). The last line is
one JSON object with those keys and ``wan_loss_ratio``: with ``--wan`` (root: the NAT lab), after
the equal-tokens part, ``bench.diloco_wan`` runs the two methods on the swarm itself at equal
wall-clock over shaped links and its ratio is filled in (its whole result under ``wan``); without
it, null. With ``--compression sparse`` it adds ``sparse_bytes_ratio`` (data parallel over sparse
DiLoCo), ``sparse_loss_ratio`` and ``sparse_recovered_fraction``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import numpy as np
import torch

from bench import diloco_spec
from bench.common import git_sha
from bench.progress import BenchProgress
from diloco import (
    Average,
    AverageOutcome,
    ByteTransformer,
    DiLoCo,
    LocalAverage,
    eval_batches,
    evaluate,
    fragment_at,
    fragments_of,
    inner_batches,
    load_stdlib_corpus,
    validation_split,
)
from diloco.schedule import lr_factor
from swarm.averaging.allreduce import partition
from swarm.averaging.codec import Compression, decode, encode
from swarm.averaging.payload import Codec, Layout
from swarm.averaging.sparse_codec import SELECTIONS, SparseCodec

RUN_SEED = 0
# Rounds over which the outer momentum ramps up from 0: this bench's default, under which the
# sparse defaults were chosen (``bench.diloco_wan`` gives its sparse run the same).
OUTER_MOMENTUM_WARMUP = 12
# Held-out batches by split: "validation" (tuned on) and "heldout" (the test half, reported).
Evals = dict[str, list[Any]]


def split_evals(corpus: Any, args: argparse.Namespace) -> Evals:
    """The validation and test halves' evaluation batches (``--split-seed``, ``--eval-batches``
    of each)."""
    validation, test = validation_split(corpus, args.split_seed)
    return {
        name: eval_batches(corpus, batches=args.eval_batches, context=args.context, part=part)
        for name, part in (("validation", validation), ("heldout", test))
    }


def _evaluate(model: torch.nn.Module, evals: Evals) -> dict[str, float]:
    return {name: evaluate(model, batches) for name, batches in evals.items()}


def _peer(k: int) -> bytes:
    return f"worker-{k}".encode()


def _batches(corpus: Any, args: argparse.Namespace, round: int, k: int) -> list[Any]:
    return inner_batches(
        corpus,
        run_seed=RUN_SEED,
        round=round,
        peer_id=_peer(k),
        steps=_round_steps(args, round),
        batch_size=args.batch,
        context=args.context,
    )


def _round_steps(args: argparse.Namespace, round: int) -> int:
    # bench.diloco_wan_worker shares _batches with a plain ``inner_steps`` and no schedule.
    schedule = getattr(args, "schedule_h", None)
    return int(args.inner_steps) if schedule is None else schedule[round]


def _codec(compression: Compression) -> Any:
    """Quantize-then-dequantize of the whole flat vector, blocks from offset 0: what
    ``bench.diloco_wan_worker`` passes as ``compress``. Its swarm all-reduce quantizes again per
    tensor and part (bandwidth-dependent there); ``_Wire`` below is the exact form, used here."""

    def compress(flat: torch.Tensor) -> torch.Tensor:
        values = flat.detach().to("cpu", torch.float32).numpy()
        return torch.from_numpy(decode(encode(values, compression), compression, values.size))

    return compress


def h_schedule(spec: str, steps: int) -> list[int]:
    """H of every round: ``spec`` is one H or a comma list, the last entry repeating until the
    rounds add up to ``steps``. Raises ValueError when they cannot add up exactly."""
    given = [int(h) for h in spec.split(",")]
    if not given or min(given) <= 0:
        raise ValueError("--inner-steps needs positive integers")
    out: list[int] = []
    while sum(out) < steps:
        out.append(given[min(len(out), len(given) - 1)])
    if sum(out) != steps:
        raise ValueError(f"--inner-steps {spec} does not add up to --steps {steps}")
    return out


def _inner_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, args.steps, args.schedule, args.warmup, args.final_lr),
    )
    return optimizer, scheduler


class _Wire:
    """Int8 (or other lossy codec) values as the swarm's all-reduce carries them.

    The swarm cuts the flat vector into one part per peer (``swarm.averaging.allreduce.partition``,
    equal bandwidths here) and encodes each part tensor by tensor
    (``swarm.averaging.payload.Layout``), so int8 blocks start at every tensor's and every part's
    start, not at multiples of 1024 of the whole vector. ``round_trip`` is the sender's
    quantization: DiLoCo's error feedback keeps exactly what it drops. The reducer quantizes the
    mean again for the all-gather (``finish``); every peer gets the same bits, which error feedback
    cannot see (it is the same for all). A sparse codec's reduced parts are its contributors'
    slices (``Layout.gathers``): the mean is exact over the decoded slices, nothing re-quantized.
    With streaming fragments (``fragments`` > 1) a round's vector is one fragment's parameters:
    each fragment has its own layout and parts, found by the vector's length.
    """

    def __init__(
        self, sizes: list[int], workers: int, compression: Codec, fragments: int = 1
    ) -> None:
        peers = sorted(_peer(k) for k in range(workers))
        self.fragments = fragments_of(sizes, fragments)
        # numel -> (its layout, its parts): what the swarm cuts a vector of that fragment into.
        self.cuts = {
            f.numel: (
                Layout.for_sizes(list(f.sizes), compression),
                [(a, b) for _, a, b in partition(f.numel, peers, [1] * workers)],
            )
            for f in self.fragments
        }
        if len(self.cuts) != len(self.fragments):
            raise ValueError(f"--fragments {fragments}: two fragments of one length")
        self.layout = self.cuts[self.fragments[0].numel][0]  # ``gathers`` is the codec's
        self.workers = workers

    def bytes_per_worker(self, rounds: int) -> float:
        """What one worker sends in ``rounds`` rounds, averaged over the workers: in each its
        slices of the N-1 parts others reduce, and its reduced part to the N-1 others."""
        n, total = self.workers, 0.0
        for r in range(rounds):
            layout, parts = self.cuts[fragment_at(self.fragments, r).numel]
            slices = sum(layout.wire_bytes(a, b) for a, b in parts)
            reduced = sum(layout.reduced_bytes(a, b, n) for a, b in parts)
            total += (n - 1) / n * (slices + reduced)
        return total

    def round_trip(self, flat: torch.Tensor) -> torch.Tensor:
        values = flat.detach().to("cpu", torch.float32).numpy()
        layout, parts = self.cuts[values.size]
        out = np.empty_like(values)
        for a, b in parts:
            out[a:b] = layout.round_trip(values[a:b], a)
        return torch.from_numpy(out)

    def finish(self, average: Any) -> Any:
        if self.layout.gathers:
            return average  # the exact mean of the decoded slices, as every receiver computes

        def wrapped(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
            outcome = average(round, vector, weight)
            return dataclasses.replace(outcome, vector=self.round_trip(outcome.vector))

        return wrapped


def run_diloco(
    corpus: Any,
    args: argparse.Namespace,
    evals: Evals,
    *,
    aggregation: str = "mean",
    wrap: Callable[[int, Average], Average] | None = None,
    compression: Codec | None = None,
    outer_momentum: float | None = None,
    outer_lr: float | None = None,
    error_decay: float = 1.0,
    overlap: bool = False,
    on_round: Callable[[], None] | None = None,
) -> dict[str, float]:
    """DiLoCo's loss on each of ``evals`` after the run. ``aggregation``: ``LocalAverage``'s
    rule; ``wrap`` (worker, its average) -> what that worker calls instead (``bench.byzantine``'s
    attacker); ``compression``, ``outer_momentum`` and ``outer_lr``: instead of ``args``', and
    ``error_decay`` (``DiLoCo(error_feedback_decay=)``): the sparse run's; ``overlap``:
    ``DiLoCo(overlap=True)``;
    ``on_round``: told when worker 0 finishes a round (progress)."""
    local = LocalAverage(args.workers, timeout_s=3600, aggregation=aggregation)
    models = [ByteTransformer(seed=0) for _ in range(args.workers)]
    sizes = [p.numel() for p in models[0].parameters()]
    codec = args.compression if compression is None else compression
    wire = None if codec is Compression.NONE else _Wire(sizes, args.workers, codec, args.fragments)
    momentum = args.outer_momentum if outer_momentum is None else outer_momentum
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            model = models[k]
            inner, scheduler = _inner_optimizer(model, args)
            average: Average = local.member(f"w{k}")
            if wrap is not None:
                average = wrap(k, average)
            with DiLoCo(
                model,
                inner,
                average if wire is None else wire.finish(average),
                inner_steps=args.schedule_h,
                outer_lr=args.outer_lr if outer_lr is None else outer_lr,
                outer_momentum=momentum,
                outer_momentum_warmup=args.outer_momentum_warmup,
                compress=None if wire is None else wire.round_trip,
                error_feedback_decay=error_decay,
                fragments=args.fragments,
                overlap=overlap,
            ) as diloco:
                for r in range(len(args.schedule_h)):
                    for inputs, targets in _batches(corpus, args, r, k):
                        model.loss(inputs, targets).backward()
                        diloco.step(samples=inputs.shape[0])
                        diloco.zero_grad()
                        scheduler.step()
                    if k == 0 and on_round is not None:
                        on_round()
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
    return _evaluate(models[0], evals)


def run_data_parallel(
    corpus: Any,
    args: argparse.Namespace,
    evals: Evals,
    workers: list[int],
    on_round: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Gradients averaged every step over ``workers``' windows: one model, one big batch.

    Each worker's gradient is computed in its own thread (as data-parallel workers would) and the
    mean of the equal-sized shares' gradients is the big batch's gradient. Why threads: on a
    shared machine one thread gets one thread's share of the cores, and data parallel does as
    much arithmetic as DiLoCo's threaded workers.
    """
    model = ByteTransformer(seed=0)
    params = list(model.parameters())
    optimizer, scheduler = _inner_optimizer(model, args)

    def gradient(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(model.loss(*batch), params)

    with ThreadPoolExecutor(len(workers)) as pool:
        for r, h in enumerate(args.schedule_h):
            shares = [_batches(corpus, args, r, k) for k in workers]
            for step in range(h):
                grads = list(pool.map(gradient, [share[step] for share in shares]))
                for param, per_worker in zip(params, zip(*grads, strict=True), strict=True):
                    param.grad = torch.stack(per_worker).mean(dim=0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if on_round is not None:
                on_round()
    return _evaluate(model, evals)


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The options of the DiLoCo setting (workers, steps, schedule, optimizers, codec, held-out
    batches), with this bench's defaults; ``bench.byzantine`` runs the same setting."""
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000, help="inner steps per worker")
    parser.add_argument(
        "--inner-steps", default="125", help="H, or a comma list of H per round (last repeats)"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--schedule", default="cosine", choices=["constant", "cosine"])
    parser.add_argument("--warmup", type=float, default=0.05, help="share of steps (cosine)")
    parser.add_argument("--final-lr", type=float, default=0.1, help="end of the decay (cosine)")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument(
        "--outer-momentum-warmup", type=int, default=OUTER_MOMENTUM_WARMUP, help="rounds"
    )
    parser.add_argument(
        "--compression", default="int8", choices=["int8", "none", "sparse"],
        help="sparse: int8 DiLoCo and sparse DiLoCo side by side",
    )  # fmt: skip
    add_sparse_options(parser)
    parser.add_argument(
        "--fragments", type=int, default=1,
        help="streaming DiLoCo: round r averages fragment r mod F of the model only",
    )  # fmt: skip
    parser.add_argument("--eval-batches", type=int, default=8, help="of each held-out half")
    parser.add_argument(
        "--split-seed", type=int, default=0,
        help="deals the held-out files into the validation and the test half",
    )  # fmt: skip


def add_sparse_options(parser: argparse.ArgumentParser) -> None:
    """The sparse codec's and sparse DiLoCo's options (``bench.diloco_wan`` takes them too)."""
    # The defaults: the best on the validation half (docs/diloco_tuning.md).
    parser.add_argument("--sparse-density", type=float, default=0.0146, help="60 of 4096")
    parser.add_argument("--sparse-bits", type=int, default=2)
    parser.add_argument("--sparse-chunk", type=int, default=4096)
    parser.add_argument(
        "--sparse-select", default="part", choices=list(SELECTIONS),
        help="chunk: the top of every chunk; part: the top of each part wherever it lies "
        "(chunks keep only the scales)",
    )  # fmt: skip
    parser.add_argument(
        "--sparse-outer-momentum", type=float, default=None,
        help="sparse DiLoCo's (default --outer-momentum; 0: SparseLoCo's plain outer step)",
    )  # fmt: skip
    parser.add_argument(
        "--sparse-outer-lr", type=float, default=2.0, help="sparse DiLoCo's outer learning rate"
    )
    parser.add_argument(
        "--sparse-error-decay", type=float, default=1.0,
        help="sparse DiLoCo's error feedback: the residual scaled by this before it is added",
    )  # fmt: skip


def sparse_codec(args: argparse.Namespace) -> SparseCodec:
    """The codec ``add_sparse_options``' values name. Raises ValueError (naming the option) on
    a bad density, bits or chunk, or an outer lr or error decay out of range."""
    if not 0 <= args.sparse_error_decay <= 1:
        raise ValueError(f"--sparse-error-decay {args.sparse_error_decay}: expected 0 to 1")
    if not args.sparse_outer_lr > 0:
        raise ValueError(f"--sparse-outer-lr {args.sparse_outer_lr}: expected a positive number")
    return SparseCodec.from_density(
        args.sparse_density, args.sparse_bits, args.sparse_chunk, args.sparse_select
    )


def parse_schedule(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Turn the parsed options into what ``run_diloco`` reads: the codec (``--compression
    sparse``: int8, and the sparse codec as ``args.sparse``), H of every round."""
    try:  # every sparse option checked, also where unused: a mistyped one is refused anyway
        codec = sparse_codec(args)
    except ValueError as error:
        parser.error(str(error))
    args.sparse = codec if args.compression == "sparse" else None
    if args.compression == "sparse":
        args.compression = "int8"
    args.compression = Compression[args.compression.upper()]
    try:
        args.schedule_h = h_schedule(args.inner_steps, args.steps)
    except ValueError as error:
        parser.error(str(error))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_options(parser)
    parser.add_argument(
        "--sequential", dest="concurrent", action="store_false", help="one method at a time"
    )
    parser.add_argument(
        "--only", default=None, help="comma list of methods to run (default: all; "
        "diloco,data_parallel,alone and with --compression sparse diloco_sparse)",
    )  # fmt: skip
    parser.add_argument(
        "--overlap", action="store_true",
        help="the one-round-delayed outer step: the sparse run's with --compression sparse, "
        "else the int8 run's (as bench.diloco_wan)",
    )  # fmt: skip
    parser.add_argument(
        "--wan", action="store_true", help="then run bench.diloco_wan (root) for wan_loss_ratio"
    )
    parser.add_argument("--wan-budget-s", type=float, default=150.0, help="per method")
    parser.add_argument(
        "--config", help="a run.toml: its DiLoCo in one process, as its nodes run it "
        "(bench.diloco_spec; the options above but --workers are then unused)",
    )  # fmt: skip
    parser.add_argument("--peer-ids", default="", help="--config: the workers' peer ids")
    parser.add_argument("--threads", type=int, default=1, help="--config: torch threads")
    args = parser.parse_args()
    if args.config:
        diloco_spec.main(args, parser)
        return
    parse_schedule(args, parser)
    torch.manual_seed(0)
    corpus = load_stdlib_corpus()
    evals = split_evals(corpus, args)
    params = sum(p.numel() for p in ByteTransformer(seed=0).parameters())
    rounds = len(args.schedule_h)
    codecs = args.compression.name + (" with overlap" if args.overlap and not args.sparse else "")
    if args.sparse is not None:
        codecs += (
            f" and {args.sparse.name} (outer lr {_sparse_lr(args)} momentum "
            f"{_sparse_momentum(args)}, error feedback decay {args.sparse_error_decay}"
            f"{', overlap' if args.overlap else ''})"
        )
    h_text = str(args.schedule_h[0]) if len(set(args.schedule_h)) == 1 else args.inner_steps
    print(
        f"=== DiLoCo vs data parallel vs alone ({git_sha()}): {args.workers} workers x "
        f"{args.steps} steps of {args.batch}x{args.context} bytes, {params} parameters, "
        f"H={h_text} ({rounds} rounds), outer Nesterov lr {args.outer_lr} momentum "
        f"{args.outer_momentum} (warm-up {args.outer_momentum_warmup} rounds), inner AdamW "
        f"{args.inner_lr} {args.schedule}, {codecs} pseudo-gradients, "
        f"{os.cpu_count()} cores ===",
        flush=True,
    )
    progress = BenchProgress()

    def tick(name: str) -> Callable[[], None]:
        return lambda: progress.advance(name)

    everyone = [*range(args.workers)]
    methods = {
        "diloco": lambda: run_diloco(
            corpus,
            args,
            evals,
            overlap=args.overlap and args.sparse is None,
            on_round=tick("diloco"),
        ),
        "data_parallel": lambda: run_data_parallel(
            corpus, args, evals, everyone, tick("data_parallel")
        ),
        "alone": lambda: run_data_parallel(corpus, args, evals, [0], tick("alone")),
    }
    if args.sparse is not None:
        methods["diloco_sparse"] = lambda: run_diloco(
            corpus, args, evals, compression=args.sparse,
            outer_momentum=_sparse_momentum(args), outer_lr=_sparse_lr(args),
            error_decay=args.sparse_error_decay, overlap=args.overlap,
            on_round=tick("diloco_sparse"),
        )  # fmt: skip
    losses: dict[str, dict[str, float]] = {}
    names = list(methods) if args.only is None else args.only.split(",")
    for name in names:
        progress.add(name, rounds)
    # Concurrently (one thread per method) unless asked otherwise: each method's result does not
    # depend on the others, and on a shared machine running them side by side finishes sooner.
    with ThreadPoolExecutor(len(names) if args.concurrent else 1) as pool:
        start = time.perf_counter()
        futures = {pool.submit(methods[name]): name for name in names}
        for future in as_completed(futures):
            name = futures[future]
            losses[name] = future.result()
            print(
                f"{name:>13}: held-out {losses[name]['heldout']:.4f} nats/byte, validation "
                f"{losses[name]['validation']:.4f} ({time.perf_counter() - start:.0f} s after "
                "the start)",
                flush=True,
            )
    progress.close()
    results = {name: losses[name]["heldout"] for name in names}
    validation = {name: losses[name]["validation"] for name in names}
    n = args.workers
    share = 2 * (n - 1) / n
    sizes = [p.numel() for p in ByteTransformer(seed=0).parameters()]
    dp_bytes = share * 4 * params * args.steps
    diloco_bytes = _Wire(sizes, n, args.compression, args.fragments).bytes_per_worker(rounds)
    if not {"diloco", "data_parallel", "alone"} <= results.keys():
        print(json.dumps({"heldout": results, "validation": validation, "config": _config(args)}))
        return
    gap = results["alone"] - results["data_parallel"]
    wan = run_wan(args.wan_budget_s) if args.wan else None
    summary = {
        "bytes_ratio": dp_bytes / diloco_bytes,
        "loss_ratio": results["diloco"] / results["data_parallel"],
        "recovered_fraction": (results["alone"] - results["diloco"]) / gap if gap else None,
        "wan_loss_ratio": wan["wan_loss_ratio"] if wan else None,
        "heldout": results,
        "validation": {
            "heldout": validation,
            "recovered_fraction": _recovered(validation, "diloco"),
            "sparse_recovered_fraction": _recovered(validation, "diloco_sparse"),
        },
        "bytes_per_worker": {"data_parallel": dp_bytes, "diloco": diloco_bytes},
        **_sparse_summary(args, results, sizes, dp_bytes),
        "config": _config(args),
        "git_sha": git_sha(),
        "wan": wan,
    }
    print(
        f"bytes sent per worker: data parallel {dp_bytes / 1e6:.1f} MB, DiLoCo "
        f"{diloco_bytes / 1e6:.2f} MB -> bytes_ratio {summary['bytes_ratio']:.0f}; loss_ratio "
        f"{summary['loss_ratio']:.3f}; recovered_fraction "
        f"{np.nan if gap == 0 else summary['recovered_fraction']:.2f}; wan_loss_ratio "
        + (f"{wan['wan_loss_ratio']:.3f}" if wan else "not run (--wan)")
    )
    if "sparse_bytes_ratio" in summary:
        print(
            f"sparse DiLoCo ({args.sparse.name}): "
            f"{summary['bytes_per_worker']['diloco_sparse'] / 1e6:.3f} MB -> sparse_bytes_ratio "
            f"{summary['sparse_bytes_ratio']:.0f}; sparse_loss_ratio "
            f"{summary['sparse_loss_ratio']:.3f}; sparse_recovered_fraction "
            f"{np.nan if gap == 0 else summary['sparse_recovered_fraction']:.2f}"
        )
    print(json.dumps(summary))


def _recovered(losses: dict[str, float], name: str) -> float | None:
    """(alone - name) / (alone - data parallel); None when ``name`` did not run or no gap."""
    gap = losses["alone"] - losses["data_parallel"]
    return (losses["alone"] - losses[name]) / gap if gap and name in losses else None


def _sparse_lr(args: argparse.Namespace) -> float:
    return float(args.sparse_outer_lr)


def _sparse_momentum(args: argparse.Namespace) -> float:
    given = args.sparse_outer_momentum
    return args.outer_momentum if given is None else given


def _sparse_summary(
    args: argparse.Namespace, results: dict[str, float], sizes: list[int], dp_bytes: float
) -> dict[str, Any]:
    """The sparse run's keys of the last line (none without ``--compression sparse``)."""
    if "diloco_sparse" not in results:
        return {}
    rounds = len(args.schedule_h)
    sparse_bytes = _Wire(sizes, args.workers, args.sparse, args.fragments).bytes_per_worker(rounds)
    gap = results["alone"] - results["data_parallel"]
    return {
        "sparse_bytes_ratio": dp_bytes / sparse_bytes,
        "sparse_loss_ratio": results["diloco_sparse"] / results["data_parallel"],
        "sparse_recovered_fraction": (
            (results["alone"] - results["diloco_sparse"]) / gap if gap else None
        ),
        "bytes_per_worker": {
            "data_parallel": dp_bytes,
            "diloco": _Wire(sizes, args.workers, args.compression, args.fragments).bytes_per_worker(
                rounds
            ),
            "diloco_sparse": sparse_bytes,
        },
    }


def run_wan(budget_s: float) -> dict[str, Any] | None:
    """``bench.diloco_wan`` in a child process (it sets up the NAT lab, which needs root), its
    output passed through; its last line's JSON, or None when it failed (the reason is shown)."""
    argv = [sys.executable, "-m", "bench.diloco_wan", "--budget-s", str(budget_s)]
    print(f"--- equal wall-clock over shaped links: {' '.join(argv[1:])}", flush=True)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=6 * budget_s + 600)
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    if proc.returncode != 0 or not lines:
        print(f"bench.diloco_wan failed (exit {proc.returncode}): no wan_loss_ratio", flush=True)
        return None
    return json.loads(lines[-1])


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: (v.name if isinstance(v, Compression | SparseCodec) else v)
        for k, v in vars(args).items()
    }


if __name__ == "__main__":
    main()
