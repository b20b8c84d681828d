"""One DiLoCo round through sparse codecs: how far each moves the model (issue 20's analysis).

    python -m bench.diloco_sparse_round [--steps 500] [--inner-steps 125] [--round-lrs 1,2,4]
        [--cache PATH] CODEC [CODEC ...]

CODEC is ``exact`` (the float32 mean) or ``SELECT:CHUNK:KEEP:BITS`` (``swarm.SparseCodec``, e.g.
``chunk:256:3:2``, the bench's old default, or ``part:4096:60:2``, pooled at the same bytes).

The first round of ``bench.diloco`` (its workers, batches and inner schedule for ``--steps``),
trained once: each of the 4 workers runs H inner steps from the seeded model and its
pseudo-gradient (init - local) is kept (``--cache``, a .npz, reused when it exists: the training
is the slow part, a few minutes on 2 cores). Then per codec, each worker's pseudo-gradient goes
through the codec as ``bench.diloco``'s ``_Wire`` cuts it (4 parts, tensor segments), the mean of
what was sent is applied with plain SGD at each of ``--round-lrs`` (round 1: the outer momentum is
still 0), and the validation half's loss is printed, with the share of each pseudo-gradient the
sent vector carries (its projection onto it, mean over workers) and the same for ``head.weight``.
Every number is deterministic given the settings. A fast proxy for choosing codecs; the bench's
4-round losses decide (docs/diloco_tuning.md).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from bench import diloco as bench
from diloco import ByteTransformer, evaluate, load_stdlib_corpus
from swarm.averaging.sparse_codec import SparseCodec


def parse_codec(text: str) -> SparseCodec | None:
    """None for ``exact``; a ``SparseCodec`` for ``SELECT:CHUNK:KEEP:BITS``."""
    if text == "exact":
        return None
    select, *numbers = text.split(":")
    if len(numbers) != 3 or not all(n.isdigit() for n in numbers):
        raise ValueError(f"codec {text!r}: expected exact or SELECT:CHUNK:KEEP:BITS")
    chunk, keep, bits = (int(n) for n in numbers)
    return SparseCodec(chunk, keep, bits, select)


def first_round(args: argparse.Namespace, corpus: object) -> tuple[np.ndarray, np.ndarray]:
    """(the seeded model's flat parameters, the workers' stacked pseudo-gradients)."""
    if args.cache and os.path.exists(args.cache):
        saved = np.load(args.cache)
        return saved["init"], saved["pseudo_gradients"]
    init = ByteTransformer(seed=0)
    flat0 = torch.nn.utils.parameters_to_vector(init.parameters()).detach().numpy().copy()
    rows = []
    for k in range(args.workers):
        model = ByteTransformer(seed=0)
        optimizer, scheduler = bench._inner_optimizer(model, args)
        for inputs, targets in bench._batches(corpus, args, 0, k):
            model.loss(inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        local = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
        rows.append((flat0 - local).astype(np.float32))
        print(f"worker {k}: {args.schedule_h[0]} inner steps", flush=True)
    pseudo = np.stack(rows)
    if args.cache:
        np.savez(args.cache, init=flat0, pseudo_gradients=pseudo)
    return flat0, pseudo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_training_options(parser)
    parser.add_argument("--cache", default="", help="a .npz of the first round (reused)")
    parser.add_argument("--round-lrs", default="1,2,4", help="outer learning rates to apply")
    parser.add_argument("codecs", nargs="+", help="exact or SELECT:CHUNK:KEEP:BITS")
    args = parser.parse_args()
    try:
        codecs = [(text, parse_codec(text)) for text in args.codecs]
        lrs = [float(v) for v in args.round_lrs.split(",")]
    except ValueError as error:
        parser.error(str(error))
    bench.parse_schedule(args, parser)
    corpus = load_stdlib_corpus()
    evals = bench.split_evals(corpus, args)["validation"]
    init, pseudo = first_round(args, corpus)
    model = ByteTransformer(seed=0)
    sizes = [p.numel() for p in model.parameters()]
    head = slice(sum(sizes[:-1]), None)  # head.weight, the last tensor

    def share(sent: np.ndarray, whole: np.ndarray) -> float:
        return float(sent.astype(np.float64) @ whole / (whole.astype(np.float64) @ whole))

    for text, codec in codecs:
        if codec is None:
            sent = pseudo
        else:
            wire = bench._Wire(sizes, args.workers, codec)
            sent = np.stack([wire.round_trip(torch.from_numpy(g)).numpy() for g in pseudo])
        mean = sent.mean(axis=0, dtype=np.float64)
        losses = []
        for lr in lrs:
            flat = torch.from_numpy((init - lr * mean).astype(np.float32))
            torch.nn.utils.vector_to_parameters(flat, model.parameters())
            losses.append(f"lr {lr:g}: {evaluate(model, evals):.4f}")
        carried = np.mean([share(s, g) for s, g in zip(sent, pseudo, strict=True)])
        in_head = np.mean([share(s[head], g[head]) for s, g in zip(sent, pseudo, strict=True)])
        print(
            f"{text:>16}: share sent {carried:.3f} (head.weight {in_head:.3f}); validation "
            + ", ".join(losses),
            flush=True,
        )


if __name__ == "__main__":
    main()
