"""One peer of ``bench.diloco_wan``: a swarm node that trains data parallel or DiLoCo for a budget.

    python -m bench.diloco_wan_worker --method dp|diloco --join MULTIADDR --ip IP --rank K
        --peers N [--inner-steps 125] [--batch 8] [--context 128] [--inner-lr 2e-3]
        [--outer-lr 0.7] [--outer-momentum 0.9] [--compression int8|none] [-v]

Built like ``swarmtrain node``: a p2p node with the swarm ``Averager`` in the trio loop of a
``PeerRuntime`` thread, torch in the main thread (``torch.set_num_threads(1)``). Model, data and
held-out set are ``bench.diloco``'s: ``ByteTransformer(seed=0)``, worker ``K`` draws
``inner_batches(corpus, 0, round, b"worker-K", H, batch, context)``, so data-parallel step ``s``
of worker K uses the batch DiLoCo worker K uses at its inner step ``s``.

Talks JSON lines with the driver: prints ``{"ready": peer id hex, ...}`` once the node is up, then
reads commands: ``{"cmd": "tcp_rtt", "ip", "port"}`` (one plain TCP connect time, for the lab
line) and ``{"cmd": "start", "t_start", "budget_s", "nominal_s", "expected": [peer id hex]}``,
after which it trains from ``t_start`` until ``t_start + budget_s`` (rule below), prints one
result line and keeps its node up until stdin closes (a peer still finishing a round with us is
not cut off). ``nominal_s`` (default ``budget_s``) marks the "within" parameters below.

Stopping at the budget without a race: every averaged vector carries one more element, this
peer's vote: 1.0 "go on", 0.0 "the budget is over for me" (the averaging this vote rides on will
end at or past ``t_start + budget_s``, judged by how long the last one took). The mean is
bit-identical on every peer of the round, so all of them read the same verdict: everyone goes on
only when every contributor voted to go on (mean above 1 - min weight / (2 x total weight),
robust to int8 and to unequal weights). So all peers stop at the same step (data parallel) or
round boundary (DiLoCo): the first that ends at or past the budget for any of them. A round that
does not hold every peer's contribution is treated as failed by all who got it (no step, no
outer update), so a partial round cannot split the parameters; after a failed round a peer falls
back on its own clock. Every wait is bounded (matchmaking and all-reduce timeouts).

The evaluated parameters are those after the last successful round (DiLoCo: its global
parameters, not a local inner state); also reported: the parameters after the last round that
completed by ``t_start + nominal_s``, and the sha256 of both, so the driver can check that all
peers agree.
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
from bench.diloco import _batches, _codec
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
    """What a worker reports; ``within`` are the params after the last round done in budget."""

    steps: int = 0  # optimizer steps applied (data parallel) / inner steps taken (DiLoCo)
    rounds: int = 0  # successful averaging rounds
    rounds_failed: int = 0
    steps_within: int = 0
    rounds_within: int = 0
    tokens: int = 0
    comm_s: float = 0.0  # wall time in averaging calls (waiting for peers included)
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    stop: str = ""
    errors: list[str] = field(default_factory=list)
    within: torch.Tensor | None = None


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
    tally = Tally(within=flat_params(model))
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
                tally.within = flat_params(model)
                tally.steps_within = tally.rounds_within = tally.steps
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if not go_on:
            tally.stop = f"budget over at step {step - 1}"
            return flat_params(model), tally


# ---------------------------------------------------------------------------- DiLoCo


class VotingAverage:
    """diloco's ``Average`` on ``SwarmAverage``, plus the vote, the full-group rule and timing."""

    def __init__(self, inner: SwarmAverage, peers: int, t_end: float) -> None:
        self.inner = inner
        self.peers = peers
        self.t_end = t_end
        self.comm_s = 0.0
        self.lead_s = 0.0  # how long the last call took
        self.matchmaking_s = 0.0
        self.allreduce_s = 0.0
        self.go_on: bool | None = None  # the last successful round's verdict
        self.applied_round = -1
        self.bytes_sent = self.bytes_received = 0

    def __call__(self, round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        self.go_on = None
        started = time.perf_counter()
        report: RoundReport | None = None
        try:
            # The vote rides as one more segment at the end of the vector.
            outcome = self.inner(round, torch.cat([vector, vote(self.t_end, self.lead_s)]), weight)
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
        self.go_on = verdict(float(outcome.vector[-1]), outcome.contributors)
        self.applied_round = round
        return AverageOutcome(outcome.vector[:-1], outcome.contributors, outcome.detail)


def train_diloco(
    args: argparse.Namespace,
    runtime: PeerRuntime,
    averager: swarm.Averager,
    corpus: Corpus,
    expected: list[bytes],
    t_end: float,
    t_within: float,
) -> tuple[torch.Tensor, Tally]:
    """DiLoCo with H inner AdamW steps, pseudo-gradients averaged through ``SwarmAverage``."""
    model = ByteTransformer(seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    sizes = [*(p.numel() for p in model.parameters()), 1]  # the parameters, then the vote
    swarm_average = SwarmAverage(runtime, averager, lambda _: expected, sizes=sizes)
    average = VotingAverage(swarm_average, args.peers, t_end)
    compress = _codec(swarm.Compression.INT8) if args.compression == "int8" else None
    tally = Tally(within=flat_params(model))
    with DiLoCo(
        model,
        inner,
        average,
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        compress=compress,
    ) as diloco:
        while True:
            r = diloco.round
            outcome: RoundOutcome | None = None
            for inputs, targets in _batches(corpus, args, r, args.rank):
                model.loss(inputs, targets).backward()
                # The H-th step runs round r in this call and returns its outcome.
                outcome = diloco.step(samples=inputs.shape[0]) or outcome
                diloco.zero_grad()
                tally.steps += 1
                tally.tokens += inputs.numel()
            if average.applied_round == r and average.go_on is not None:
                tally.rounds += 1
                go_on = average.go_on
                if time.time() <= t_within:
                    tally.within = diloco.global_state.params.clone()
                    tally.steps_within, tally.rounds_within = tally.steps, tally.rounds
            else:
                tally.rounds_failed += 1
                why = outcome.error if outcome is not None else "no round"
                tally.errors.append(f"round {r}: {why}")
                go_on = time.time() < t_end
            if not go_on:
                tally.stop = f"budget over at round {r}"
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
        compression = (
            swarm.Compression.INT8
            if args.method == "diloco" and args.compression == "int8"
            else swarm.Compression.NONE
        )
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
        train = train_dp if args.method == "dp" else train_diloco
        final, tally = train(args, runtime, averager, corpus, expected, t_end, t_within)
        elapsed = time.time() - t_start
        within = tally.within if tally.within is not None else final
        result = {
            "rank": args.rank,
            "method": args.method,
            "steps": tally.steps,
            "rounds": tally.rounds,
            "rounds_failed": tally.rounds_failed,
            "tokens": tally.tokens,
            "elapsed_s": round(elapsed, 3),
            "comm_s": round(tally.comm_s, 3),
            "matchmaking_s": round(tally.matchmaking_s, 3),
            "allreduce_s": round(tally.allreduce_s, 3),
            "bytes_sent": tally.bytes_sent,
            "bytes_received": tally.bytes_received,
            "loss": heldout_loss(final, heldout),
            "param_hash": sha256_of(final),
            "steps_within": tally.steps_within,
            "rounds_within": tally.rounds_within,
            "loss_within": heldout_loss(within, heldout),
            "hash_within": sha256_of(within),
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
    parser.add_argument("--compression", choices=["int8", "none"], default="int8")
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
