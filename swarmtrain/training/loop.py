"""A DiLoCo volunteer's rounds, from the spec it verified to its last round's summary.

Each round the peer runs H inner AdamW steps on its own deterministic data shard
(``inner_batches`` seeded by run, round and peer id), then DiLoCo averages the pseudo-gradient
with the round's peers and applies the same outer Nesterov step everywhere. After the round the
peer publishes its state hash and reads back the others', so the progress line can say whether
the shared state is bit-identical.

Round numbers come from DiLoCo's checkpointed counter, so peers that started together meet under
the same matchmaking key each round. Checkpoints (DiLoCo's ``state_dir``) are written at every
round boundary: Ctrl+C loses at most the inner phase in progress, and a restart with the same
state directory resumes at the last boundary. Around its rounds,
``swarmtrain.membership.elastic`` catches up with a swarm that is ahead (download of the agreed
state from several peers), serves our state to joiners, re-syncs when our hash disagrees with
the majority, and publishes the progress records ``swarmtrain status`` reads.

In a verified run (``[verify] rate > 0``, docs/verification.md) the inner phase is a RepOps task
on the CPU instead (``swarmtrain.verified.volunteer``): re-executed for other peers when drawn,
gated on the verifiers' agreement and the coordinator's verdicts before averaging, and the
all-reduce's drawn parts audited before the outer step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import swarm
from diloco import (
    Average,
    AverageOutcome,
    Corpus,
    DiLoCo,
    RoundOutcome,
    eval_batches,
    evaluate,
    fragment_at,
    fragments_of,
)
from p2p import PeerID
from swarmtrain.config import RunConfig, run_seed_of
from swarmtrain.faults import NO_FAULTS, Faults
from swarmtrain.membership.elastic import Elastic, RunOver
from swarmtrain.membership.progress import Progress, member_list
from swarmtrain.membership.state_sync import StateServer
from swarmtrain.metrics import RoundSample
from swarmtrain.runtime import PeerRuntime
from swarmtrain.training.inner_step import (
    accumulate,
    grad_scaler,
    inner_optimizer,
    phase_batches,
    set_lr,
)
from swarmtrain.training.progress_bar import InnerProgress
from swarmtrain.training.ranks import LocalRanks
from swarmtrain.training.swarm_average import RoundReport, SwarmAverage
from swarmtrain.verified.volunteer import Banned, Verification

log = logging.getLogger(__name__)

# How long after a round we wait for the round's peers to publish their state hashes.
AGREEMENT_TIMEOUT_S = 3.0
# After the last round, how long a node keeps serving a peer that is re-syncing to the final state.
FINAL_LINGER_S = 15.0
# Round buffers the averager keeps between rounds (bench.memory: a node's peak RSS).
NODE_BUFFER_POOL_BYTES = 64 << 20


@dataclass
class NodeSummary:
    peer_id: str
    first_round: int  # the round this process started at (> 0 after a resume or a sync)
    rounds_contributed: int = 0
    rounds_failed: int = 0
    last_round: int = -1
    state_hash: str = ""
    loss_first: float | None = None
    loss_last: float | None = None
    eval_loss: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    # Seconds training waited for averaging (all of it without overlap; with overlap the wait
    # for a result the next inner phase did not hide), summed over this process's rounds.
    averaging_exposed_s: float = 0.0
    agree: bool | None = None  # the last round's state hash equals the majority's
    syncs: int = 0  # states downloaded from peers (joining, catching up, re-syncing)
    round_seconds: list[float] = field(default_factory=list)
    round_losses: dict[int, float] = field(default_factory=dict)  # mean inner loss by round
    banned: str = ""  # a verified run's verdict against this peer
    run_over: str = ""  # joined after the run's end and could not fetch its final state
    nproc_per_node: int = 1  # local ranks (--nproc-per-node) sharing each inner phase
    rank_digests: list[str] = field(default_factory=list)  # by rank, after the last phase
    ranks_agree: bool | None = None  # every phase ended with the same bytes on every rank
    # Told every finished round (``--metrics-port``: ``swarmtrain.metrics``); not in the JSON.
    on_round: Callable[[RoundSample], None] | None = field(default=None, repr=False)

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
            "averaging_exposed_s": round(self.averaging_exposed_s, 3),
            "agree": self.agree,
            "syncs": self.syncs,
            "round_seconds": [round(s, 3) for s in self.round_seconds],
            "round_losses": {str(r): loss for r, loss in self.round_losses.items()},
            "banned": self.banned,
            "run_over": self.run_over,
            "nproc_per_node": self.nproc_per_node,
            "rank_digests": self.rank_digests,
            "ranks_agree": self.ranks_agree,
        }

    def done_line(self) -> str:
        loss_first = "n/a" if self.loss_first is None else f"{self.loss_first:.3f}"
        loss_last = "n/a" if self.loss_last is None else f"{self.loss_last:.3f}"
        held_out = "n/a" if self.eval_loss is None else f"{self.eval_loss:.3f}"
        return (
            f"done: {self.rounds_contributed} rounds contributed, last round "
            f"{self.last_round}, loss {loss_first} -> {loss_last}, "
            f"held-out {held_out}, state {self.state_hash[:12]}"
        )


def averager_config(config: RunConfig, coordinator: PeerID | None = None) -> swarm.AveragerConfig:
    # "auto" (compression=None) lets the swarm pick per tensor (int8 above 64K elements, exact
    # below). Its quantization is deterministic, so the state stays bit-identical either way; for
    # the default 0.9M-parameter model nearly every tensor is below the threshold, so this is close
    # to exact. A verified run averages exactly, so the coordinator can recompute any part's sum
    # from its inputs (an aggregation audit), and lets only the coordinator fetch our slices.
    verified = config.verify.rate > 0
    return swarm.AveragerConfig(
        weight_bounds=weight_bounds(config),
        run_id=config.run.id,
        matchmaking_timeout_s=config.swarm.matchmaking_timeout_s,
        allreduce_timeout_s=config.swarm.allreduce_timeout_s,
        compression=swarm.Compression.NONE if verified else compression(config),
        audit=verified,
        aggregation=config.swarm.aggregation,
        auditor=coordinator.to_bytes() if verified and coordinator is not None else None,
        # Round buffers of a large model (a copy of the pseudo-gradient, the mean, the slices
        # received: over twice the parameters' bytes) are given back after the round rather
        # than kept resident through the inner phase; the default model's still fit.
        buffer_pool_bytes=NODE_BUFFER_POOL_BYTES,
        schedule=round_schedule(config),
        matchmaking_shards=swarm.shard_count(config.swarm.expected_peers),
        row_size=config.swarm.row_size or None,
    )


def round_schedule(config: RunConfig) -> swarm.RoundSchedule | None:
    """Scheduled rounds for a swarm of about ``[swarm] expected_peers`` (0: none)."""
    expected = config.swarm.expected_peers
    if not expected:
        return None
    return swarm.RoundSchedule.for_swarm(expected, swarm.shard_count(expected))


def matchmaking_wait_s(config: RunConfig) -> float:
    """How long a round's matchmaking may take: ``matchmaking_timeout_s``, or a scheduled
    round's longest window and its propagation grace."""
    schedule = round_schedule(config)
    if schedule is None:
        return config.swarm.matchmaking_timeout_s
    return schedule.long_window_s + schedule.grace_s


def tokens_per_round(config: RunConfig) -> int:
    """What one process's inner phase processes: a round's contribution weight."""
    t = config.training
    return t.inner_steps * t.grad_accumulation * t.batch_size * t.sequence_length


def weight_bounds(config: RunConfig) -> tuple[float, float]:
    """The weights the run's reducers accept (``[swarm] max_weight_rounds``, per fragment: a
    streaming fragment syncs every ``fragments`` rounds and weighs the tokens of all of them); a
    verified run's tasks are one round each, so its weight is exactly one round's tokens."""
    one = float(tokens_per_round(config))
    if config.verify.rate > 0:
        return one, one
    return 0.0, one * config.swarm.max_weight_rounds * config.training.fragments


def round_sizes(config: RunConfig, model: nn.Module) -> Callable[[int], tuple[int, ...]]:
    """The segments of DiLoCo's vector in round r: the sizes of the trainable parameters of the
    round's fragment (``[training] fragments``; all of them when 1), in model order, as
    ``DiLoCo`` cuts the same model. Raises ValueError naming the key when there are more
    fragments than trainable tensors."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    count = config.training.fragments
    if count > len(sizes):
        raise ValueError(
            f"training.fragments = {count} is more than the model's {len(sizes)} trainable "
            "tensors (a fragment holds whole tensors)"
        )
    fragments = fragments_of(sizes, count)
    return lambda round: fragment_at(fragments, round).sizes


_COMPRESSIONS = {
    "auto": None,
    "int8": swarm.Compression.INT8,
    "none": swarm.Compression.NONE,
}


def compression(config: RunConfig) -> swarm.Compression | swarm.SparseCodec | None:
    """The codec ``[swarm] compression`` names (None: chosen per tensor), with the sparse keys."""
    sw = config.swarm
    if sw.compression == "sparse":
        return swarm.SparseCodec.from_density(
            sw.sparse_density, sw.sparse_bits, sw.sparse_chunk, sw.sparse_select
        )
    return _COMPRESSIONS[sw.compression]


def _reach(runtime: PeerRuntime) -> str:
    """Our dial-back verdict, for the progress record (``swarmtrain status`` shows it)."""
    node = runtime.node
    return "unknown" if node is None else node.reachability.status.value


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def train(
    config: RunConfig,
    model: nn.Module,
    runtime: PeerRuntime,
    averager: swarm.Averager,
    server: StateServer,
    corpus: Corpus,
    device: torch.device,
    emit: Callable[[str], None],
    coordinator: PeerID,
    *,
    state_dir: Path,
    join_wait_s: float,
    faults: Faults = NO_FAULTS,
    ranks: LocalRanks | None = None,
    on_round: Callable[[RoundSample], None] | None = None,
) -> NodeSummary:
    """Train ``model`` (the spec's, with its round-0 parameters: ``workload.build_model``)
    through the spec's rounds from wherever DiLoCo's checkpoint in ``state_dir`` is (after
    catching up with the swarm, waiting at most ``join_wait_s`` for a round boundary); ``emit``
    gets one progress line per round. ``faults``: a verified run's tampering test hook.
    ``ranks``: the node's other local ranks (``--nproc-per-node``), which share each inner
    phase; the caller closes them. ``on_round``: told every finished round (metrics)."""
    # DiLoCo keeps the global state as a CPU float32 vector and computes the outer step there,
    # so peers on different devices still agree bit for bit; only the inner steps move.
    model = model.to(device)
    inner = inner_optimizer(model, config.training)
    if ranks is not None:
        # Before DiLoCo's hook exists, and before we announce our start to the swarm.
        ranks.connect(model, inner)
    verification = None
    if config.verify.rate > 0:
        verification = Verification(
            runtime,
            config,
            corpus,
            run_seed_of(config.run.id),
            coordinator,
            faults=faults,
            emit=emit,
            model=model,
        )
        averager.check_slice = verification.check_slice
        averager.slice_root = verification.slice_root
        emit(
            f"verified run: {config.verify.rate:.0%} of tasks re-executed by a second peer; "
            "inner phases run under RepOps"
        )
    average = SwarmAverage(
        runtime,
        averager,
        check=verification.check_aggregation if verification is not None else None,
        # DiLoCo's vector is its trainable parameters (of the round's fragment) in model order;
        # each is one segment, so the averager picks codecs per parameter.
        sizes=round_sizes(config, model),
        only=verification.allowed if verification is not None else None,
        # DiLoCo reads its handed-over vector after a round only for error feedback and in
        # overlap mode: otherwise the mean lands in it (a model-sized buffer less).
        overwrite=not (error_feedback(config) or config.training.overlap),
        error_feedback=error_feedback(config),
    )
    diloco = build_diloco(config, model, average, state_dir, inner)
    if ranks is not None:
        ranks.share_scaler(diloco.grad_scaler)  # a resumed scale reaches every rank
    elastic = Elastic(
        runtime, server, config.run.id, diloco, emit, rounds=config.run.rounds,
        quorum=config.swarm.state_quorum,
    )  # fmt: skip
    if verification is not None:
        verification.joiners = elastic.joiners
        elastic.ignored = verification.banned_peers
    # The membership needs DiLoCo, which needs the averaging: its rules come last.
    average.set_rules(
        expected=elastic.expected_peers,
        exclude=lambda r: _excluded(r, elastic, verification),
        behind=elastic.behind,
    )
    peer = runtime.peer_id
    how = "resumed from checkpoint at" if diloco.round else "starting at"
    schedule = round_schedule(config)
    scheduled = "" if schedule is None else (
        f"; rounds scheduled for about {config.swarm.expected_peers} peers over "
        f"{swarm.shard_count(config.swarm.expected_peers)} key(s), window {schedule.window_s:g} s"
    )  # fmt: skip
    emit(f"node {peer} {how} round {diloco.round} of {config.run.rounds} on {device}{scheduled}")
    try:
        if diloco.round:
            elastic.serve_current()  # our checkpoint may be what a peer behind us needs
        run_over = ""
        try:
            elastic.catch_up(join_wait_s, config.run.rounds)
        except RunOver as exc:
            # Training alone would end on a state nobody shares: a run's end is final.
            emit(f"{exc}; stopping")
            run_over = str(exc)
        summary = NodeSummary(str(peer), first_round=diloco.round, run_over=run_over)
        summary.on_round = on_round
        progress = InnerProgress()  # a bar of the inner phase on a terminal, nothing elsewhere
        if not run_over:
            elastic.announce_start()
            wanted = config.swarm.min_peers
            if diloco.round == 0 and wanted > 1:
                emit(f"waiting for {wanted} peers to start (at most {join_wait_s:.0f} s)")
                started = elastic.wait_for_start(wanted, join_wait_s)
                emit(f"{started} peer(s) started; training" + ("" if started >= wanted else
                     f" without the {wanted - started} missing"))  # fmt: skip
            if faults.slow_start_s:
                time.sleep(faults.slow_start_s)
        phases: dict[int, Phase] = {}
        while diloco.round < config.run.rounds and not run_over:
            try:
                _train_round(
                    config, diloco, average, elastic, corpus, peer.to_bytes(), summary, emit,
                    verification, progress, phases, ranks,
                )  # fmt: skip
            except Banned as exc:
                summary.banned = str(exc)
                emit(f"this peer was {exc}; stopping")
                break
        # Overlap: the last round's averaging ran behind nothing; wait for it and report it.
        last = diloco.finish_pending()
        if last is not None and last.round in phases:
            _record_round(config, diloco, average, elastic, phases[last.round], last, summary,
                          emit)  # fmt: skip
        if summary.last_round == config.run.rounds - 1 and summary.agree:
            elastic.linger(summary.last_round, FINAL_LINGER_S)
    finally:
        diloco.close()
    summary.syncs = elastic.syncs
    summary.state_hash = diloco.state_hash()
    if ranks is not None:
        summary.nproc_per_node = ranks.nproc
        summary.rank_digests = list(ranks.digests.last)
        summary.ranks_agree = ranks.digests.agree
    # Held-out loss of the global parameters (the model holds them after an applied round).
    summary.eval_loss = evaluate(
        model, eval_batches(corpus, batches=4, context=config.training.sequence_length)
    )
    return summary


def build_diloco(
    config: RunConfig,
    model: nn.Module,
    average: Average | Callable[[int, torch.Tensor, float], AverageOutcome],
    state_dir: Path | None = None,
    inner: torch.optim.Optimizer | None = None,
) -> DiLoCo:
    """DiLoCo over ``model`` with ``inner`` (default: the AdamW ``inner_optimizer`` builds), as
    the spec's ``[training]`` sets them (``bench.diloco --config`` builds its in-process workers
    with this too)."""
    training = config.training
    if inner is None:
        inner = inner_optimizer(model, training)
    return DiLoCo(
        model,
        inner,
        average,
        inner_steps=training.inner_steps,
        outer_lr=training.outer_lr,
        outer_momentum=training.outer_momentum,
        outer_momentum_warmup=training.outer_momentum_warmup,
        state_dir=state_dir,
        run_id=config.run.id,
        error_feedback=error_feedback(config),
        error_feedback_decay=training.error_feedback_decay,
        overlap=training.overlap,
        grad_scaler=grad_scaler(model, training),
        fragments=training.fragments,
    )


def error_feedback(config: RunConfig) -> bool:
    """Whether DiLoCo keeps what the codec dropped: when the spec says so, and always for
    sparse rounds, which drop most of each pseudo-gradient (without its residual it is lost)."""
    return config.training.error_feedback or config.swarm.compression == "sparse"


def _excluded(round_number: int, elastic: Elastic, verification: Verification | None) -> set[bytes]:
    """Peers a round's matchmaking leaves out: those done with the round already (stale
    declarations, ``Elastic.past_peers``) and, in a verified run, banned or failed ones."""
    left_out = elastic.past_peers(round_number)
    if verification is not None:
        left_out |= set(verification.excluded(round_number))
    return left_out


@dataclass(frozen=True)
class Phase:
    """One inner phase as the round's line reports it."""

    round: int
    loss: float  # mean over its inner steps
    tokens: int
    inner_s: float
    round_s: float  # the phase and, without overlap, its round's averaging


def native_inner_phase(
    config: RunConfig,
    diloco: DiLoCo,
    corpus: Corpus,
    peer_bytes: bytes,
    progress: InnerProgress,
    ranks: LocalRanks | None = None,
) -> tuple[list[float], int, float, RoundOutcome | None]:
    """H AdamW steps on our shard; the H-th runs the round (with overlap: starts it, and
    finishes the previous one). With ``ranks``, each step's batch is shared with the node's
    other ranks (``ranks.shard`` of the node's draw), its gradients averaged across them, its
    loss and tokens the node's.
    (losses, tokens, inner seconds, the outcome of the round the H-th step finished, if any)"""
    if ranks is not None and ranks.fsdp:
        return _sharded_inner_phase(config, diloco, corpus, peer_bytes, progress, ranks)
    training = config.training
    steps, micro = training.inner_steps, training.grad_accumulation
    if ranks is not None:
        ranks.begin_phase(diloco.round, steps)
    shard = ranks.shard if ranks is not None else (0, 1)
    batches = phase_batches(config, corpus, diloco.round, peer_bytes, steps, shard)
    started = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    inner_s = 1e-9
    outcome: RoundOutcome | None = None
    progress.start(diloco.round, steps)
    try:
        for step in range(steps):
            set_lr(diloco.inner_optimizer, training, diloco.round * steps + step,
                   config.run.rounds * steps)  # fmt: skip
            loss, step_tokens = accumulate(
                diloco.model, batches[step * micro : (step + 1) * micro], training,
                ranks.ddp if ranks is not None else None,
                diloco.grad_scaler, diloco.inner_optimizer,
            )  # fmt: skip
            if ranks is not None:
                loss, step_tokens = ranks.mean_loss(loss), step_tokens * ranks.nproc
            losses.append(loss)
            tokens += step_tokens
            progress.step(loss, step_tokens)
            if step == steps - 1:
                inner_s = time.perf_counter() - started
                progress.stop()  # before the round's averaging logs and its line
            # The H-th step runs the outer round in this call and returns its outcome.
            outcome = diloco.step(samples=step_tokens) or outcome
            diloco.zero_grad()
    finally:
        progress.stop()
    assert outcome is not None or diloco.overlap, "the inner phase ended without its round"
    return losses, tokens, inner_s, outcome


def _sharded_inner_phase(
    config: RunConfig,
    diloco: DiLoCo,
    corpus: Corpus,
    peer_bytes: bytes,
    progress: InnerProgress,
    ranks: LocalRanks,
) -> tuple[list[float], int, float, RoundOutcome]:
    """``--fsdp``: the H steps on the ranks' sharded copy, from DiLoCo's model (scattered into
    the shards), on the node's batches as ``native_inner_phase`` shares them; then every rank
    gathers the full parameters, which DiLoCo's round takes as the phase's end
    (``finish_inner_phase``; ``ranks_plan.check_fsdp`` refused overlap and fragments), and the
    inner AdamW state, which its checkpoint carries (a resume scatters it back)."""
    training = config.training
    steps, micro = training.inner_steps, training.grad_accumulation
    sharded = ranks.sharded
    ranks.begin_sharded_phase(diloco.round, steps, diloco.model, diloco.inner_optimizer)
    batches = phase_batches(config, corpus, diloco.round, peer_bytes, steps, ranks.shard)
    started = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    progress.start(diloco.round, steps)
    try:
        for step in range(steps):
            set_lr(sharded.optimizer, training, diloco.round * steps + step,
                   config.run.rounds * steps)  # fmt: skip
            loss, step_tokens = sharded.step(batches[step * micro : (step + 1) * micro])
            loss, step_tokens = ranks.mean_loss(loss), step_tokens * ranks.nproc
            losses.append(loss)
            tokens += step_tokens
            progress.step(loss, step_tokens)
        numel = sum(p.numel() for p in diloco.model.parameters() if p.requires_grad)
        local = torch.empty(numel, dtype=torch.float32)  # DiLoCo's flat vector
        ranks.end_sharded_phase(local, diloco.model, diloco.inner_optimizer)
        inner_s = time.perf_counter() - started
    finally:
        progress.stop()
    outcome = diloco.finish_inner_phase(local, samples=tokens, from_model=True)
    # Checkpointed with the round: the ranks keep their shards of it, rank 0 no whole copy.
    diloco.inner_optimizer.state.clear()
    return losses, tokens, inner_s, outcome


def _verified_inner_phase(
    config: RunConfig, diloco: DiLoCo, verification: Verification
) -> tuple[list[float], int, float, RoundOutcome]:
    """Our RepOps task (and those we verify), the verification gate, then the round.
    Raises ``Banned`` when the coordinator named us a cheater."""
    r = diloco.round
    params = {n: t.numpy() for n, t in diloco.global_parameters().items()}
    started = time.perf_counter()
    work = verification.run_tasks(r, params)
    inner_s = time.perf_counter() - started
    verification.settle(r)
    local = torch.cat([torch.from_numpy(work.params[n]).reshape(-1) for n in params])
    if verification.faults.send_round == r:  # a test's cheater: not the task it committed
        local = torch.add(local, torch.sub(diloco.global_state.params, local), alpha=-0.5)
    tokens = tokens_per_round(config)  # the weight the run fixes for a verified task
    outcome = diloco.finish_inner_phase(local, samples=tokens)
    return work.losses, tokens, inner_s, outcome


def _train_round(
    config: RunConfig,
    diloco: DiLoCo,
    average: SwarmAverage,
    elastic: Elastic,
    corpus: Corpus,
    peer_bytes: bytes,
    summary: NodeSummary,
    emit: Callable[[str], None],
    verification: Verification | None = None,
    progress: InnerProgress | None = None,
    phases: dict[int, Phase] | None = None,
    ranks: LocalRanks | None = None,
) -> None:
    """One inner phase, then the round it finished: its own, or with overlap the previous one
    (``phases`` keeps the phases whose rounds are still running)."""
    r = diloco.round
    progress = progress or InnerProgress()
    phases = {} if phases is None else phases
    started = time.perf_counter()
    if verification is None:
        losses, tokens, inner_s, outcome = native_inner_phase(
            config, diloco, corpus, peer_bytes, progress, ranks
        )
    else:
        losses, tokens, inner_s, outcome = _verified_inner_phase(config, diloco, verification)
    phase = Phase(r, sum(losses) / len(losses), tokens, inner_s, time.perf_counter() - started)
    phases[r] = phase
    for old in [k for k in phases if k < r - 1]:
        del phases[old]  # a round in flight dropped by a state download never reports
    if outcome is None:
        emit(
            f"round {r} loss {phase.loss:.3f} {tokens / inner_s:.0f} tok/s: inner phase done, "
            f"averaging while round {r + 1} trains"
        )
        return
    _record_round(
        config, diloco, average, elastic, phases.pop(outcome.round, phase), outcome, summary,
        emit, verification,
    )  # fmt: skip


def _record_round(
    config: RunConfig,
    diloco: DiLoCo,
    average: SwarmAverage,
    elastic: Elastic,
    phase: Phase,
    outcome: RoundOutcome,
    summary: NodeSummary,
    emit: Callable[[str], None],
    verification: Verification | None = None,
) -> None:
    """A finished round: the summary, our progress record, its line, and the membership's
    follow-up (adopt the others' state after a failure or a disagreeing hash)."""
    r = outcome.round
    mean_loss, tokens, inner_s, round_s = phase.loss, phase.tokens, phase.inner_s, phase.round_s
    # The round's outcome as ``DiLoCo`` returned it; the swarm's report of it when it succeeded.
    report = outcome.detail if outcome.ok else None
    assert report is None or isinstance(report, RoundReport)
    ok = report is not None
    summary.last_round = r
    summary.round_seconds.append(round_s)
    if verification is not None:
        verification.round_done(r, ok, outcome.contributors)
    summary.loss_first = mean_loss if summary.loss_first is None else summary.loss_first
    summary.loss_last = mean_loss
    summary.round_losses[r] = mean_loss
    summary.averaging_exposed_s += outcome.exposed_s
    exposed = f"averaging exposed {outcome.exposed_s:.2f} s"
    state_hash = diloco.state_hash()
    elastic.fresh = False  # only the first round after adopting a state needs the expected set
    # Before the record that tells joiners to ask us for it; after a failed round as well: when
    # the agreed state's holders are all gone, a joiner takes a live member's state from there.
    elastic.serve_current()
    if report is not None:
        summary.rounds_contributed += 1
        summary.bytes_sent += report.bytes_sent
        summary.bytes_received += report.bytes_received
    else:
        summary.rounds_failed += 1
    elastic.publish(
        Progress(
            peer_id=str(summary.peer_id),
            round=r,
            ok=ok,
            state_hash=bytes.fromhex(state_hash),
            loss=mean_loss,
            tokens_per_s=tokens / inner_s,
            peers=report.peers if report is not None else 0,
            bytes_sent=summary.bytes_sent,
            bytes_received=summary.bytes_received,
            rounds_contributed=summary.rounds_contributed,
            published_at=time.time(),
            reach=_reach(elastic.runtime),
            # A failed round carries the list of the round whose state we still hold.
            members=member_list(outcome.contributors) if ok else elastic.held_list(r),
        )
    )
    if report is None and summary.on_round is not None:
        summary.on_round(RoundSample.of(r, mean_loss, tokens / inner_s, None, syncs=elastic.syncs))
    if report is None:
        why = outcome.error or "no averaging"
        emit(
            f"round {r} loss {mean_loss:.3f} {tokens / inner_s:.0f} tok/s FAILED ({why}); "
            f"{exposed} state {state_hash[:12]} {round_s:.1f} s"
        )
        # The others may have succeeded: then their state is ahead of our skipped one. They may
        # still be in the round: its deadlines bound how long it can outlast ours.
        # A peer ahead of live members waits for them: per round of gap, the round's own
        # duration as we saw it plus those deadlines (membership_plan.wait_budget_s).
        outcome_wait_s = matchmaking_wait_s(config) + config.swarm.allreduce_timeout_s + round_s
        if elastic.after_round(r, ok=False, wait_s=outcome_wait_s) is not None:
            summary.agree = True
        return
    average.publish_state(r, state_hash)
    # Only our round's contributors' digests count: the round's key is run-wide, and in an open
    # run anyone may publish there (a liar's digest, larger than a divergent pair's, won the
    # tie-break and both members downloaded the liar's state). A round that ran as sub-groups
    # (its group formed larger than the peers that averaged) is looked at again a round later,
    # against the quorum (``suspect_round``, ``rejoin_majority``).
    group = [PeerID.from_base58(p).to_bytes() for p in outcome.contributors]
    agreement = average.agreement(r, len(group), AGREEMENT_TIMEOUT_S, among=group)
    summary.agree = agreement.agrees if agreement is not None else None
    agree = (
        "unknown"
        if agreement is None
        else f"{'yes' if agreement.agrees else 'NO'} ({agreement.agreeing}/{agreement.peers})"
    )
    if summary.on_round is not None:
        summary.on_round(RoundSample.of(
            r, mean_loss, tokens / inner_s, report, agree=summary.agree, syncs=elastic.syncs,
            verdicts=verification.verdicts if verification is not None else (),
        ))  # fmt: skip
    emit(
        f"round {r} loss {mean_loss:.3f} {tokens / inner_s:.0f} tok/s peers {report.peers} "
        f"sent {_mib(report.bytes_sent)} recv {_mib(report.bytes_received)} "
        f"allreduce {report.allreduce_s:.2f} s {exposed} state {state_hash[:12]} agree {agree} "
        f"{round_s:.1f} s{verification.note(r) if verification is not None else ''}"
    )
    drifted = agreement is not None and not agreement.agrees and agreement.majority is not None
    # Our state drifted from the majority's: adopt theirs before contributing again.
    synced = None
    if drifted and agreement is not None:
        ids = outcome.contributors
        synced = elastic.after_round(r, ok=True, majority=agreement.majority, contributors=ids)
    if synced is not None:
        summary.agree = True
        elastic.suspect_round = None
        return
    earlier, elastic.suspect_round = (
        elastic.suspect_round,
        (r if report.group_size > report.peers else None),
    )
    if earlier is None or earlier >= r:
        return
    # A round later every sub-group of a suspect round has published its digest: one read.
    late = average.agreement(earlier, 0, 0.0)
    if late is not None and late.majority is not None and late.ours is not None and not late.agrees:
        emit(
            f"round {earlier} ran as sub-groups and ours was the smaller "
            f"({late.peers - late.agreeing} of {late.peers} digests ours at most): re-syncing"
        )
        if elastic.rejoin_majority() is not None:
            summary.agree = True
