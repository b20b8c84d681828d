"""``swarmtrain node``: the volunteer. Join a run, train with DiLoCo, contribute through the swarm.

One process is one peer: a p2p node with the swarm averager in a background thread
(``BlockingAverager``), and the torch training loop in the main thread. Each round the peer runs H
inner AdamW steps on its own deterministic data shard (``inner_batches`` seeded by run, round and
peer id), then DiLoCo averages the pseudo-gradient with the round's peers and applies the same
outer Nesterov step everywhere. After the round the peer publishes its state hash and reads back
the others', so the progress line can say whether the shared state is bit-identical.

Round numbers come from DiLoCo's checkpointed counter, so peers that started together meet under
the same matchmaking key each round. Checkpoints (DiLoCo's ``state_dir``) are written at every
round boundary: Ctrl+C loses at most the inner phase in progress, and a restart with the same
state directory resumes at the last boundary. Not yet here: downloading the state from peers
(a node restarted behind the others stays on its own round numbers) and re-syncing when its hash
disagrees with the majority.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import swarm
from diloco import (
    ByteTransformer,
    Corpus,
    DiLoCo,
    eval_batches,
    evaluate,
    inner_batches,
    load_stdlib_corpus,
)
from p2p import HostConfig, NodeConfig, load_or_create_identity, peer_id_of
from swarmtrain.swarm_average import SwarmAverage

log = logging.getLogger(__name__)

# How long after a round we wait for the round's peers to publish their state hashes.
AGREEMENT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class NodeOptions:
    join: tuple[str, ...]
    state_dir: Path
    identity: Path | None = None  # default: state_dir / "identity.key"
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    run_id: str = "default"
    rounds: int = 5
    inner_steps: int = 20
    batch_size: int = 8
    context: int = 64
    inner_lr: float = 3e-3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    threads: int | None = None
    matchmaking_timeout_s: float = 4.0
    allreduce_timeout_s: float = 30.0
    json_path: Path | None = None

    def __post_init__(self) -> None:
        for name in ("rounds", "inner_steps", "batch_size", "context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")


@dataclass
class NodeSummary:
    peer_id: str
    first_round: int  # the round this process started at (> 0 after a resume)
    rounds_contributed: int = 0
    rounds_failed: int = 0
    last_round: int = -1
    state_hash: str = ""
    loss_first: float | None = None
    loss_last: float | None = None
    eval_loss: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    agree: bool | None = None  # the last round's state hash equals the majority's
    round_seconds: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id,
            "first_round": self.first_round,
            "rounds_contributed": self.rounds_contributed,
            "rounds_failed": self.rounds_failed,
            "last_round": self.last_round,
            "state_hash": self.state_hash,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "eval_loss": self.eval_loss,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "agree": self.agree,
            "round_seconds": [round(s, 3) for s in self.round_seconds],
        }


def run_seed_of(run_id: str) -> int:
    """The run's seed for the initial parameters and the data assignment: every peer of a run
    derives the same one from the run id, so nobody has to download round 0's parameters."""
    return int.from_bytes(hashlib.sha256(b"swarmtrain/run-seed/" + run_id.encode()).digest()[:8])


def averager_config(options: NodeOptions) -> swarm.AveragerConfig:
    # compression=None lets the swarm pick per tensor (int8 above 64K elements, exact below). Its
    # quantization is deterministic, so the state stays bit-identical either way; for the default
    # 0.9M-parameter model nearly every tensor is below the threshold, so this is close to exact.
    return swarm.AveragerConfig(
        run_id=options.run_id,
        matchmaking_timeout_s=options.matchmaking_timeout_s,
        allreduce_timeout_s=options.allreduce_timeout_s,
        compression=None,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_node(options: NodeOptions, emit: Callable[[str], None]) -> NodeSummary:
    """Train until DiLoCo's round reaches ``options.rounds``; ``emit`` gets one progress line per
    round. Returns the summary (also written to ``options.json_path``). KeyboardInterrupt
    propagates after the averager is closed (the last round boundary's checkpoint is on disk).
    Raises P2PError when the node cannot join, ValueError for a checkpoint of another config."""
    if options.threads:
        torch.set_num_threads(options.threads)
    options.state_dir.mkdir(parents=True, exist_ok=True)
    key_pair = load_or_create_identity(options.identity or options.state_dir / "identity.key")
    seed = run_seed_of(options.run_id)
    corpus = load_stdlib_corpus()
    model = ByteTransformer(seed=seed)
    inner = torch.optim.AdamW(model.parameters(), lr=options.inner_lr)
    node_config = NodeConfig(
        HostConfig(key_pair, listen_addrs=options.listen), bootstrap=options.join
    )
    averager = swarm.BlockingAverager(node_config, averager_config(options))
    try:
        assert averager.node is not None
        peer = averager.node.host.peer_id
        average = SwarmAverage(averager)
        diloco = DiLoCo(
            model,
            inner,
            average,
            inner_steps=options.inner_steps,
            outer_lr=options.outer_lr,
            outer_momentum=options.outer_momentum,
            state_dir=options.state_dir,
            run_id=options.run_id,
        )
        summary = NodeSummary(str(peer_id_of(key_pair)), first_round=diloco.round)
        how = "resumed from checkpoint at" if diloco.round else "starting at"
        emit(f"node {summary.peer_id} {how} round {diloco.round} of {options.rounds}")
        try:
            while diloco.round < options.rounds:
                _train_round(options, diloco, average, corpus, peer.to_bytes(), seed, summary, emit)
        finally:
            diloco.close()
        summary.state_hash = diloco.state_hash()
        summary.bytes_sent, summary.bytes_received = average.bytes_sent, average.bytes_received
        # Held-out loss of the global parameters (the model holds them after an applied round).
        summary.eval_loss = evaluate(
            model, eval_batches(corpus, batches=4, context=options.context)
        )
    finally:
        averager.close()
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(summary.to_json()) + "\n")
    return summary


def _train_round(
    options: NodeOptions,
    diloco: DiLoCo,
    average: SwarmAverage,
    corpus: Corpus,
    peer_bytes: bytes,
    seed: int,
    summary: NodeSummary,
    emit: Callable[[str], None],
) -> None:
    r = diloco.round
    batches = inner_batches(
        corpus,
        run_seed=seed,
        round=r,
        peer_id=peer_bytes,
        steps=options.inner_steps,
        batch_size=options.batch_size,
        context=options.context,
    )
    started = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    inner_s = 1e-9
    for step, (inputs, targets) in enumerate(batches):
        loss = diloco.model.loss(inputs, targets)  # type: ignore[operator]
        loss.backward()
        losses.append(float(loss.detach()))
        tokens += inputs.numel()
        if step == len(batches) - 1:
            inner_s = time.perf_counter() - started
        diloco.step(samples=inputs.numel())  # the H-th step runs the outer round in this call
        diloco.zero_grad()
    round_s = time.perf_counter() - started
    mean_loss = sum(losses) / len(losses)
    report = average.last
    ok = report is not None and report.ok and report.round == r
    summary.last_round = r
    summary.round_seconds.append(round_s)
    summary.loss_first = mean_loss if summary.loss_first is None else summary.loss_first
    summary.loss_last = mean_loss
    state_hash = diloco.state_hash()
    if not ok:
        summary.rounds_failed += 1
        why = report.error if report is not None else "no averaging"
        emit(
            f"round {r} loss {mean_loss:.3f} {tokens / inner_s:.0f} tok/s FAILED ({why}); "
            f"state {state_hash[:12]} {round_s:.1f} s"
        )
        return
    assert report is not None
    summary.rounds_contributed += 1
    average.publish_state(r, state_hash)
    agreement = average.agreement(r, report.peers, AGREEMENT_TIMEOUT_S)
    summary.agree = agreement.agrees if agreement is not None else None
    agree = (
        "unknown"
        if agreement is None
        else f"{'yes' if agreement.agrees else 'NO'} ({agreement.agreeing}/{agreement.peers})"
    )
    emit(
        f"round {r} loss {mean_loss:.3f} {tokens / inner_s:.0f} tok/s peers {report.peers} "
        f"sent {_mib(report.bytes_sent)} recv {_mib(report.bytes_received)} "
        f"allreduce {report.allreduce_s:.2f} s state {state_hash[:12]} agree {agree} "
        f"{round_s:.1f} s"
    )
