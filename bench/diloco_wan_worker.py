"""One peer of ``bench.diloco_wan``: a swarm node that trains data parallel or DiLoCo for a budget.

    python -m bench.diloco_wan_worker --method dp|diloco --join MULTIADDR --ip IP --rank K
        --peers N [--inner-steps 125] [--batch 8] [--context 128] [--inner-lr 2e-3]
        [--outer-lr 0.7] [--outer-momentum 0.9] [--outer-momentum-warmup 0]
        [--compression int8|none|sparse] [--overlap] [--sparse-outer-momentum-warmup 12]
        [bench.diloco's --sparse-* options] [-v]

Built like ``swarmtrain node``: a p2p node with the swarm ``Averager`` in the trio loop of a
``PeerRuntime`` thread, torch in the main thread (``torch.set_num_threads(1)``). Model, data and
held-out set are ``bench.diloco``'s: ``ByteTransformer(seed=0)``, worker ``K`` draws
``inner_batches(corpus, 0, round, b"worker-K", H, batch, context)``, so data-parallel step ``s``
of worker K uses the batch DiLoCo worker K uses at its inner step ``s``.

DiLoCo's codec: ``int8`` (``bench.diloco._codec`` as ``compress``, int8 on the wire), ``none``,
or ``sparse``: ``bench.diloco.sparse_codec`` of the ``--sparse-*`` options on the wire (the
averager's codec, as a node with ``compression = "sparse"`` runs it) with error feedback from
what the peers decoded (``error_feedback=True``), and sparse DiLoCo's outer lr, momentum and
residual decay (``--sparse-outer-lr`` ...), its outer momentum ramped up over
``--sparse-outer-momentum-warmup`` rounds (bench.diloco's 12, under which those were chosen;
without it, momentum 0.9 from round 0 at outer lr 2.0 diverged after five rounds). ``--overlap``:
``DiLoCo(overlap=True)``, the one-round-delayed outer step, the averaging running behind the
next inner phase.

Talks JSON lines with the driver: prints ``{"ready": peer id hex, ...}`` once the node is up, then
reads commands: ``{"cmd": "tcp_rtt", "ip", "port"}`` (one plain TCP connect time, for the lab
line) and ``{"cmd": "start", "t_start", "budget_s", "nominal_s", "expected": [peer id hex]}``,
after which it trains from ``t_start`` until ``t_start + budget_s`` (rule below), prints one
result line and keeps its node up until stdin closes (a peer still finishing a round with us is
not cut off). ``nominal_s`` (default ``budget_s``) marks the "within" parameters below.

Stopping at the budget without a race: every averaging carries each peer's vote, "go on" or
"the budget is over for me", and every peer of the round reads the same votes, so all stop at
the same step or round. Data parallel's vote is one more element of the averaged gradient
(float32, lossless): 1.0 or 0.0, go on only when the mean is above 1 - min weight / (2 x total
weight). DiLoCo's vote rides the round's weight instead, because a sparse codec would drop or
quantize a vote element (and error feedback would carry it on): a peer voting to stop declares
its weight (samples) plus ``STOP_MARK`` = 2**-8; samples are whole numbers, so the round's
contributors (peer -> declared weight, identical on every peer of the round) say exactly who voted
to stop. It tilts that round's weighted mean by under 4e-6 of a peer's share.

When the votes are read:

- Synchronous DiLoCo (and data parallel): the vote is cast as the averaging starts and says
  whether that averaging (lasting as long as the last one did) will end before
  ``t_start + budget_s``; it is read when the call returns. Everyone goes on only when nobody
  voted to stop, so all peers stop at the first step or round boundary at or past the budget.
- Overlapped DiLoCo: round r's averaging starts when inner phase r ends (boundary T_r) and its
  result, with the votes, is only read at T_{r+1}, after round r+1 was already sent. So the
  vote cast at T_r is about T_{r+1}: "go on" when T_r plus the length of the last phase (T_r -
  T_{r-1}; the first from ``t_start``) is before the budget's end. At T_{r+1} every peer reads
  round r's votes (the same on all); on "stop" none starts another phase: each waits for round
  r+1 (sent at T_{r+1} by all, since all read round r's verdict only then) and applies it. So
  all peers end on the same global state after round r+1, at the first boundary predicted at
  or past the budget plus that last round's averaging (counted as exposed, below). The
  prediction is one phase long: when phases vary (a shared machine) the run can end a phase
  before the budget or one after the first boundary past it, the same for every peer.

A round that does not hold every peer's contribution is treated as failed by all who got it (no
step, no outer update), so a partial round cannot split the parameters; after a failed round a
peer falls back on its own clock. Every wait is bounded (matchmaking and all-reduce timeouts).

The evaluated parameters are those after the last successful round (DiLoCo: its global
parameters, not a local inner state); also reported: the parameters after the last round that
was applied by ``t_start + nominal_s``, and the sha256 of both, so the driver can check that all
peers agree. ``exposed_s``: the wall time the training thread waited on averaging (data parallel
and synchronous DiLoCo: every averaging call; overlapped DiLoCo: ``RoundOutcome.exposed_s``, the
wait for a round's result that the inner phase did not hide, the last round's included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import swarm
from bench.diloco import (
    OUTER_MOMENTUM_WARMUP,
    _batches,
    _codec,
    _sparse_lr,
    _sparse_momentum,
    add_sparse_options,
    sparse_codec,
)
from bench.netlab_worker import tcp_rtt_ms
from diloco import (
    AverageOutcome,
    AveragingFailed,
    ByteTransformer,
    Corpus,
    DiLoCo,
    RoundOutcome,
    eval_batches,
    evaluate,
    load_stdlib_corpus,
)
from p2p import HostConfig, NodeConfig
from swarmtrain.runtime import PeerRuntime
from swarmtrain.training.swarm_average import RoundReport, SwarmAverage

log = logging.getLogger("bench.diloco_wan_worker")

EVAL_BATCHES = 8


# ---------------------------------------------------------------------------- the vote


def vote(t_end: float, lead_s: float) -> torch.Tensor:
    """This peer's vote, a 1-element float32 tensor: 1.0 to go on, 0.0 when the budget is over.
    It is cast as the averaging starts, which ends the step or round ``lead_s`` later (the last
    averaging call's duration): go on only if that end still falls before ``t_end``."""
    return torch.tensor([1.0 if time.time() + lead_s < t_end else 0.0], dtype=torch.float32)


# DiLoCo's stop vote, added to the declared weight (module docstring): exact in float64 for any
# whole number of samples below 2**44, and far below a sample.
STOP_MARK = 2.0**-8


def marked(weight: float, go_on: bool) -> float:
    """The weight a DiLoCo peer declares: its samples, plus ``STOP_MARK`` to vote stop."""
    if weight != int(weight):
        raise ValueError(f"weight {weight}: the stop vote needs a whole number of samples")
    return weight if go_on else weight + STOP_MARK


def weights_verdict(contributors: dict[str, float]) -> bool:
    """Go on? True only when no contributor's declared weight carries ``STOP_MARK``."""
    return all(w == int(w) for w in contributors.values())


def verdict(mean_vote: float, contributors: dict[str, float]) -> bool:
    """Go on? True only when every contributor voted 1.0: one 0.0 vote of weight w pulls the
    weighted mean down by w / total, far more than int8's error (under 1%)."""
    total = sum(contributors.values())
    least = min(contributors.values())
    return mean_vote > 1.0 - 0.5 * least / total


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])


def sha256_of(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.contiguous().numpy().tobytes()).hexdigest()


def heldout_loss(flat: torch.Tensor, heldout: list[Any]) -> float:
    model = ByteTransformer(seed=0)
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    return evaluate(model, heldout)


@dataclass
class Tally:
    """What a worker reports. ``within``: (round, steps, rounds, params) after each of the last
    two rounds applied by the nominal mark, oldest first (round -1: the initial params). Peers
    apply a round at times a few seconds apart with overlap, so the last one a peer applied by
    the mark may be one round later than another's; the driver takes the latest round every peer
    has, which each one still holds."""

    steps: int = 0  # optimizer steps applied (data parallel) / inner steps taken (DiLoCo)
    rounds: int = 0  # successful averaging rounds
    rounds_failed: int = 0
    tokens: int = 0
    comm_s: float = 0.0  # wall time in averaging calls (waiting for peers included)
    exposed_s: float = 0.0  # of it, the wall time the training thread waited for it
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    stop: str = ""
    errors: list[str] = field(default_factory=list)
    within: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)

    def keep_within(self, round: int, params: torch.Tensor) -> None:
        self.within = [*self.within[-1:], (round, self.steps, self.rounds, params)]


# ---------------------------------------------------------------------------- data parallel


def train_dp(
    args: argparse.Namespace,
    runtime: PeerRuntime,
    averager: swarm.Averager,
    corpus: Corpus,
    expected: list[bytes],
    t_end: float,
    t_within: float,
) -> tuple[torch.Tensor, Tally]:
    """Every step: own batch's gradient, averaged (float32) with all peers, then AdamW."""
    model = ByteTransformer(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    params = list(model.parameters())
    tally = Tally()
    tally.keep_within(-1, flat_params(model))
    batches: list[Any] = []
    step = 0  # the swarm round number: every attempt counts, so peers stay aligned
    lead_s = 0.0  # how long the last averaging call took
    while True:
        if step % args.inner_steps == 0 or not batches:
            batches = _batches(corpus, args, step // args.inner_steps, args.rank)
        inputs, targets = batches[step % args.inner_steps]
        model.loss(inputs, targets).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        mine = vote(t_end, lead_s)
        started = time.perf_counter()

        async def average(
            grad: torch.Tensor = grad, mine: torch.Tensor = mine, step: int = step
        ) -> swarm.AveragingResult:
            return await averager.average(
                [grad, mine], 1.0, round_number=step, expected_peers=expected
            )

        result: swarm.AveragingResult | None = None
        try:
            result = runtime.call(average)
        except (swarm.AveragingFailed, ValueError) as exc:
            tally.errors.append(f"step {step}: {exc}")
            log.warning("step %d failed: %s", step, exc)
        lead_s = time.perf_counter() - started
        tally.comm_s += lead_s
        tally.exposed_s += lead_s  # synchronous: training waits for all of it
        if result is not None:
            tally.bytes_sent += result.bytes_sent
            tally.bytes_received += result.bytes_received
            tally.matchmaking_s += result.matchmaking_s
            tally.allreduce_s += result.allreduce_s
            log.info(
                "step %d: %d peers, matchmaking %.2f s, all-reduce %.2f s, %.2f s in the call",
                step,
                len(result.contributors),
                result.matchmaking_s,
                result.allreduce_s,
                time.perf_counter() - started,
            )
        if result is not None and len(result.contributors) < args.peers:
            tally.errors.append(f"step {step}: {len(result.contributors)} of {args.peers} peers")
            log.warning(
                "step %d: only %d contributors; not applied", step, len(result.contributors)
            )
            result = None
        if result is None:
            tally.rounds_failed += 1
            go_on = time.time() < t_end
        else:
            averaged, mean_vote = result.tensors
            offset = 0
            with torch.no_grad():
                for p in params:
                    n = p.numel()
                    p.grad.copy_(averaged[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                    offset += n
            optimizer.step()
            tally.steps += 1
            tally.rounds += 1
            tally.tokens += inputs.numel()
            go_on = verdict(float(mean_vote[0]), result.contributors)
            if time.time() <= t_within:
                tally.keep_within(step, flat_params(model))
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if not go_on:
            tally.stop = f"budget over at step {step - 1}"
            return flat_params(model), tally


# ---------------------------------------------------------------------------- DiLoCo


class VotingAverage:
    """diloco's ``Average`` on ``SwarmAverage``, plus the vote (in the weight), the full-group
    rule and timing. ``overlap``: the vote is about the next boundary (module docstring); the
    calls then run in DiLoCo's averaging thread, one at a time."""

    def __init__(
        self, inner: SwarmAverage, peers: int, t_start: float, t_end: float, overlap: bool
    ) -> None:
        self.inner = inner
        self.peers = peers
        self.t_end = t_end
        self.overlap = overlap
        self.comm_s = 0.0
        self.lead_s = 0.0  # how long the last call took
        self.last_start = t_start  # when the last call started (the start time before one)
        self.matchmaking_s = 0.0
        self.allreduce_s = 0.0
        self.verdicts: dict[int, bool] = {}  # by round, of those applied
        self.bytes_sent = self.bytes_received = 0

    def go_on(self, now: float) -> bool:
        if self.overlap:
            # The next boundary: one more phase as long as the last (module docstring).
            return now + (now - self.last_start) < self.t_end
        return now + self.lead_s < self.t_end  # this averaging ends before the budget's end

    def __call__(self, round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        started, now = time.perf_counter(), time.time()
        declared = marked(weight, self.go_on(now))
        self.last_start = now
        report: RoundReport | None = None
        try:
            outcome = self.inner(round, vector, declared)
            report = outcome.detail
        finally:
            self.lead_s = time.perf_counter() - started
            self.comm_s += self.lead_s
            if report is not None:
                self.matchmaking_s += report.matchmaking_s
                self.allreduce_s += report.allreduce_s
                self.bytes_sent += report.bytes_sent
                self.bytes_received += report.bytes_received
            log.info(
                "round %d: %s, %.2f s in the call", round, report, time.perf_counter() - started
            )
        if len(outcome.contributors) < self.peers:
            raise AveragingFailed(
                f"round {round}: {len(outcome.contributors)} of {self.peers} peers; not applied"
            )
        self.verdicts[round] = weights_verdict(outcome.contributors)
        log.info("round %d: weights %s", round, sorted(outcome.contributors.values()))
        return outcome


def train_diloco(
    args: argparse.Namespace,
    runtime: PeerRuntime,
    averager: swarm.Averager,
    corpus: Corpus,
    expected: list[bytes],
    t_end: float,
    t_within: float,
    t_start: float,
) -> tuple[torch.Tensor, Tally]:
    """DiLoCo with H inner AdamW steps, pseudo-gradients averaged through ``SwarmAverage``."""
    model = ByteTransformer(seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    sizes = [p.numel() for p in model.parameters()]
    swarm_average = SwarmAverage(runtime, averager, lambda _: expected, sizes=sizes)
    average = VotingAverage(swarm_average, args.peers, t_start, t_end, args.overlap)
    sparse = args.compression == "sparse"
    tally = Tally()
    tally.keep_within(-1, flat_params(model))
    with DiLoCo(
        model,
        inner,
        average,
        inner_steps=args.inner_steps,
        outer_lr=_sparse_lr(args) if sparse else args.outer_lr,
        outer_momentum=_sparse_momentum(args) if sparse else args.outer_momentum,
        outer_momentum_warmup=(
            args.sparse_outer_momentum_warmup if sparse else args.outer_momentum_warmup
        ),
        # Sparse: the averager's codec, its round trip (``sent``) as the residual's reference.
        compress=_codec(swarm.Compression.INT8) if args.compression == "int8" else None,
        error_feedback=sparse,
        error_feedback_decay=args.sparse_error_decay if sparse else 1.0,
        overlap=args.overlap,
    ) as diloco:

        def judge(outcome: RoundOutcome) -> bool:
            """Count the round that ``outcome`` ends; go on?"""
            tally.exposed_s += outcome.exposed_s
            verdict = average.verdicts.get(outcome.round)
            if log.isEnabledFor(logging.INFO):
                state = diloco.state_hash()
                log.info("round %d: go on %s, state %s", outcome.round, verdict, state)
            if outcome.ok and verdict is not None:
                tally.rounds += 1
                if time.time() <= t_within:
                    tally.keep_within(outcome.round, diloco.global_state.params.clone())
                return verdict
            tally.rounds_failed += 1
            tally.errors.append(f"round {outcome.round}: {outcome.error or 'not applied'}")
            return time.time() < t_end

        while True:
            r = diloco.round
            outcome: RoundOutcome | None = None
            for inputs, targets in _batches(corpus, args, r, args.rank):
                model.loss(inputs, targets).backward()
                # The H-th step runs round r (with overlap: starts it and finishes round r-1).
                outcome = diloco.step(samples=inputs.shape[0]) or outcome
                diloco.zero_grad()
                tally.steps += 1
                tally.tokens += inputs.numel()
            if outcome is None:
                continue  # overlap's first phase: its round runs behind the next one
            if not judge(outcome):
                last = diloco.finish_pending()  # overlap: the round sent at this boundary
                if last is not None:
                    judge(last)
                tally.stop = f"budget over at round {diloco.round - 1}"
                break
        final = diloco.global_state.params.clone()
    tally.comm_s = average.comm_s
    tally.matchmaking_s, tally.allreduce_s = average.matchmaking_s, average.allreduce_s
    tally.bytes_sent, tally.bytes_received = average.bytes_sent, average.bytes_received
    return final, tally


# ---------------------------------------------------------------------------- main


def serve(args: argparse.Namespace) -> int:
    from libp2p.crypto.ed25519 import create_new_key_pair

    torch.set_num_threads(1)
    torch.manual_seed(0)
    corpus = load_stdlib_corpus()
    heldout = eval_batches(corpus, batches=EVAL_BATCHES, context=args.context)
    config = NodeConfig(
        host=HostConfig(create_new_key_pair(), listen_addrs=(f"/ip4/{args.ip}/tcp/0",)),
        bootstrap=(args.join,),
    )
    runtime = PeerRuntime(config)
    try:
        node = runtime.node
        assert node is not None
        compression: swarm.Compression | swarm.SparseCodec = swarm.Compression.NONE
        if args.method == "diloco" and args.compression == "int8":
            compression = swarm.Compression.INT8
        elif args.method == "diloco" and args.compression == "sparse":
            compression = sparse_codec(args)
        averager = swarm.Averager(
            node,
            swarm.AveragerConfig(
                run_id=f"diloco-wan-{args.method}",
                compression=compression,
                matchmaking_timeout_s=args.matchmaking_timeout,
                allreduce_timeout_s=args.allreduce_timeout,
                bandwidth_bps=args.rate_bps,
            ),
        )
        runtime.start(averager.run)
        ready = {
            "ready": node.host.peer_id.to_bytes().hex(),
            "bulk_listener": node.bulk_listener is not None,
            "addr": str(node.host.addrs()[0]),
        }
        print(json.dumps(ready), flush=True)
        while True:
            line = sys.stdin.readline()
            if not line:
                return 0  # the driver went away before the start
            if not line.strip():
                continue
            request = json.loads(line)
            if request["cmd"] == "tcp_rtt":
                rtt = runtime.call(tcp_rtt_ms, request["ip"], request["port"])
                print(json.dumps({"rtt_ms": rtt}), flush=True)
            elif request["cmd"] == "start":
                break
        expected = [bytes.fromhex(p) for p in request["expected"]]
        t_start, budget_s = float(request["t_start"]), float(request["budget_s"])
        t_end = t_start + budget_s
        t_within = t_start + float(request.get("nominal_s", budget_s))
        time.sleep(max(0.0, t_start - time.time()))
        if args.method == "dp":
            final, tally = train_dp(args, runtime, averager, corpus, expected, t_end, t_within)
        else:
            final, tally = train_diloco(
                args, runtime, averager, corpus, expected, t_end, t_within, t_start
            )
        elapsed = time.time() - t_start
        within = [
            {
                "round": r,
                "steps": steps,
                "rounds": rounds,
                "loss": heldout_loss(params, heldout),
                "hash": sha256_of(params),
            }
            for r, steps, rounds, params in tally.within
        ]
        result = {
            "rank": args.rank,
            "method": args.method,
            "steps": tally.steps,
            "rounds": tally.rounds,
            "rounds_failed": tally.rounds_failed,
            "tokens": tally.tokens,
            "elapsed_s": round(elapsed, 3),
            "comm_s": round(tally.comm_s, 3),
            "exposed_s": round(tally.exposed_s, 3),
            "matchmaking_s": round(tally.matchmaking_s, 3),
            "allreduce_s": round(tally.allreduce_s, 3),
            "bytes_sent": tally.bytes_sent,
            "bytes_received": tally.bytes_received,
            "loss": heldout_loss(final, heldout),
            "param_hash": sha256_of(final),
            "within": within,
            "stop": tally.stop,
            "errors": tally.errors[-5:],
        }
        print(json.dumps(result), flush=True)
        for _ in sys.stdin:  # stay up for peers still in a round with us, until the driver ends
            pass
        return 0
    finally:
        runtime.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=["dp", "diloco"], required=True)
    parser.add_argument("--join", required=True)
    parser.add_argument("--ip", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, default=125)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--compression", choices=["int8", "none", "sparse"], default="int8")
    parser.add_argument("--overlap", action="store_true", help="DiLoCo's delayed outer step")
    parser.add_argument("--outer-momentum-warmup", type=int, default=0, help="rounds")
    parser.add_argument(
        "--sparse-outer-momentum-warmup", type=int, default=OUTER_MOMENTUM_WARMUP, help="rounds"
    )
    add_sparse_options(parser)
    parser.add_argument("--rate-bps", type=float, default=None)
    parser.add_argument("--matchmaking-timeout", type=float, default=30.0)
    parser.add_argument("--allreduce-timeout", type=float, default=60.0)
    parser.add_argument("-v", action="store_true", help="INFO logging on stderr")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO if args.v else logging.WARNING,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    try:
        return serve(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
