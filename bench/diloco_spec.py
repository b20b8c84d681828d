"""``bench.diloco --config run.toml``: a run spec's DiLoCo in one process, as its nodes run it.

    python -m bench.diloco --config run.toml [--peer-ids ID,ID,...] [--workers N] [--threads 1]

Each worker is one node of the run without the network: the spec's model (``build_model``, from
the run seed) and data (``load_data``), the node's own inner phase
(``swarmtrain.training.loop.native_inner_phase``: every ``[training]`` setting, batches drawn for
the run seed, the round and the worker's peer id) and the node's DiLoCo (``build_diloco``),
averaged in-process by ``LocalAverage`` (float64 in sorted peer order, one cast to float32: the
swarm's exact all-reduce). Given the peer ids of a real run's nodes (``--peer-ids``; default
``worker-0`` ... ), its loss per round and its final state hash are that run's own when the run
averages exactly (``[swarm] compression = "none"``; the swarm's int8 blocks follow each round's
parts, which depend on the group, so a lossy run is close, not equal).
``tests/integration/test_bench_spec.py`` checks it against real node processes.

Prints one line per round (each worker's mean inner loss) and, last, one JSON object with
``round_losses`` ({peer id: [loss of round 0, 1, ...]}), ``state_hash`` and ``eval_loss`` (held-out,
of the final global parameters).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
from pathlib import Path

import torch

from bench.progress import BenchProgress
from diloco import LocalAverage, eval_batches, evaluate
from p2p import PeerID
from swarmtrain.config import ConfigError, RunConfig, load_config, run_seed_of, with_base
from swarmtrain.training.loop import build_diloco, native_inner_phase
from swarmtrain.training.progress_bar import InnerProgress
from swarmtrain.training.workload import build_model, load_data


def _peer_bytes(name: str) -> bytes:
    """What a node draws its shard with: its peer id's bytes (a base58 id), else the name."""
    try:
        return PeerID.from_base58(name).to_bytes()
    except Exception:
        return name.encode()


def run_spec(
    config: RunConfig, peers: list[str], progress: BenchProgress | None = None
) -> dict[str, object]:
    """Train ``config``'s rounds with one thread per peer; the JSON result (module docstring).
    ``progress``: a bar of the workers' rounds on a terminal (their round lines otherwise)."""
    progress = progress or BenchProgress(io.StringIO())
    progress.add("diloco", config.run.rounds * len(peers), "worker rounds", plain_lines=False)
    corpus = load_data(config)
    models = [build_model(config, corpus.vocab_size) for _ in peers]
    averaging = LocalAverage(len(peers), timeout_s=3600)
    losses: dict[str, list[float]] = {peer: [] for peer in peers}
    hashes: dict[str, str] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        peer = peers[k]
        quiet = InnerProgress(io.StringIO())  # not a terminal: no bar
        try:
            with build_diloco(config, models[k], averaging.member(peer)) as diloco:
                while diloco.round < config.run.rounds:
                    r = diloco.round
                    step_losses = native_inner_phase(
                        config, diloco, corpus, _peer_bytes(peer), quiet
                    )[0]
                    losses[peer].append(sum(step_losses) / len(step_losses))
                    progress.line(f"round {r} worker {k} loss {losses[peer][-1]:.4f}")
                    progress.advance("diloco")
                hashes[peer] = diloco.state_hash()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(peers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    if len(set(hashes.values())) != 1:
        raise AssertionError(f"the workers' states differ: {hashes}")
    heldout = eval_batches(corpus, batches=4, context=config.training.sequence_length)
    return {
        "run_id": config.run.id,
        "run_seed": run_seed_of(config.run.id),
        "round_losses": losses,
        "state_hash": next(iter(hashes.values())),
        "eval_loss": evaluate(models[0], heldout),
    }


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        # Relative paths from the run.toml's folder, as the coordinator reads them.
        config = with_base(
            load_config(Path(args.config)),
            Path(args.config).parent,
            warn=lambda line: print(f"warning: {line}", file=sys.stderr),
        )
    except (OSError, ConfigError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    if config.is_pipeline or config.verify.rate > 0:
        parser.error(f"--config {args.config}: only plain DiLoCo runs (no pipeline, no verify)")
    if not config.run.id:
        # The run id seeds the model and the data: a spec without one has no curve to match.
        config = config.replace(run={"id": "bench"})
    peers = (
        args.peer_ids.split(",") if args.peer_ids else [f"worker-{k}" for k in range(args.workers)]
    )
    torch.set_num_threads(args.threads)
    print(
        f"=== run spec {args.config} (run {config.run.id}) in one process: {len(peers)} "
        f"workers, {config.run.rounds} rounds, H={config.training.inner_steps}, "
        f"{args.threads} torch thread(s) ===",
        flush=True,
    )
    with BenchProgress() as progress:
        result = run_spec(config, peers, progress)
    print(json.dumps(result), flush=True)
