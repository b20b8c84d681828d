"""``swarmtrain verify``: the Verde dispute game on the default model or any ``transformers``
model, on loopback.

    swarmtrain verify --steps S [--model-config PATH] [--grad-clip C]
                      [--cheat-step K --cheat-op J] [--threads T] [--json]

Starts two provider processes (this module run as ``python -m swarmtrain.commands.verify
provider``), each running the same task (S RepOps training steps from the model's seed-0
initialisation, data windows of the stdlib corpus chosen by ``--seed``) and committing to it;
provider B flips one bit of operator J's output at step K (both 0-based) when asked to. This
process is the referee: it asks both for their commitments and, if they differ, plays the game
over libp2p streams and prints the verdict (who, which step, which operator), the rounds, the
bytes exchanged and the referee's compute time against the time one provider took to run the
task. ``--json`` prints one object instead: ``cheater`` (the peer id, null when nobody is named),
``step``, ``op``, ``op_name``, ``rounds``, ``bytes``, ``referee_seconds``, ``dispute_seconds``
(the game's wall time, queries included), ``task_seconds``,
``honest_final_hash`` (hex; independent of ``--threads``), ``reason``, ``ops_per_step`` (the
records of one step's trace, what ``--cheat-op`` indexes and the operator bisection covers).

Without ``--model-config`` the model is the default ``ByteTransformer`` and its trace the
hand-written graph (``verify.repops``). With it, the model is the ``transformers`` causal LM the
config.json describes (built as a run spec's ``[model] kind = "transformers"`` is, seed 0, batch
8 of min(context, 128) bytes, so its vocabulary must hold the 256 byte values), and the trace is
the dispatch log of its step under ``RepOpsMode`` (``verify.dispatch``): ``--cheat-op`` then
names an aten operator of that list, and the referee recomputes the disputed one. A config whose
step uses an operator RepOps cannot run is refused, with the operator's name, before anything
starts. ``--grad-clip C`` clips each step's gradients to global norm C before AdamW, as a run's
``[training] grad_clip`` does; the default model's step then runs through the dispatch trace as
well (the hand-written graph has no clip), as a verified run's tasks do.

About 470 lines, over the usual 400: the provider process, the refusals made before anything
starts and the referee read the same arguments and build the same step, so they stay together.

The lead wires it into ``swarmtrain.cli`` with ``add_parser(subparsers)`` and ``run(args)``.
Exit status: 0 when the game ended with a verdict (a cheater named, or no dispute), 1 when it was
undecided, 2 when the arguments are refused or a provider process failed to start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmtrain.paths import plain_os_error

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 900.0
CORPUS_BYTES = 1 << 20
BATCH = 8  # a task's batch, either model
CONTEXT = 128  # --model-config's sequence length, or the model's context if shorter


class _Refused(Exception):
    """The command's arguments cannot make a task; the message is the one line to print."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        help="run a task on two providers (one may cheat) and referee their dispute",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
    )
    _task_arguments(parser)
    parser.add_argument("--cheat-step", type=int, help="provider B tampers at this step (0-based)")
    parser.add_argument("--cheat-op", type=int, help="... with this operator (record index)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per referee query [60]"
    )
    return parser


def _task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=4, help="training steps in the task [4]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per provider [1]")
    parser.add_argument("--seed", type=int, default=0, help="data seed of the task [0]")
    parser.add_argument(
        "--model-config",
        metavar="PATH",
        help="a transformers config.json: verify that model's step (default: the default model)",
    )
    parser.add_argument(
        "--grad-clip",
        type=float,
        default=0.0,
        metavar="C",
        help="clip each step's gradients to this global norm, as [training] grad_clip [0: off]",
    )
    # A smaller model of the same architecture, for tests (not the default model).
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)


def _shape(args: argparse.Namespace) -> Any:
    from verify.repops import ModelShape

    return ModelShape(d_model=32, n_layers=1, n_heads=2, context=32) if args.tiny else ModelShape()


def _repops(args: argparse.Namespace) -> Any:
    from diloco import load_stdlib_corpus
    from verify.repops import RepOpsStep

    corpus = load_stdlib_corpus(max_bytes=CORPUS_BYTES).train
    return RepOpsStep(corpus, args.seed, shape=_shape(args), batch_size=BATCH)


def _model_config(path: str) -> dict[str, Any]:
    """A config.json's object without its nulls (transformers' default for those keys)."""
    try:
        table = json.loads(Path(path).read_text())
    except OSError as exc:
        raise _Refused(f"--model-config {path}: cannot read it: {plain_os_error(exc)}") from None
    except ValueError as exc:
        raise _Refused(f"--model-config: {path} is not JSON: {exc}") from None
    if not isinstance(table, dict):
        raise _Refused(f"--model-config: {path} does not hold a JSON object")
    return {k: v for k, v in table.items() if v is not None}


def _dispatch(args: argparse.Namespace) -> Any:
    """The ``DispatchStep`` of ``--model-config``'s model, or of the default model (its
    ``--tiny`` shape) when only ``--grad-clip`` asks for the trace; ``_Refused`` for a config
    that builds no causal LM, or one whose vocabulary cannot hold bytes."""
    from diloco import (
        ByteTransformer,
        ByteTransformerConfig,
        ModelError,
        build_causal_lm,
        load_stdlib_corpus,
    )
    from verify import batch_for
    from verify.dispatch import AdamWSettings, DispatchStep

    if args.model_config:
        try:
            model = build_causal_lm(_model_config(args.model_config), seed=0)
        except ModelError as exc:
            raise _Refused(f"--model-config {args.model_config}: {exc}") from None
        if model.vocab_size < 256:
            raise _Refused(
                f"--model-config {args.model_config}: vocab_size {model.vocab_size} is below "
                "256, and the task trains on bytes"
            )
        context = min(model.context, CONTEXT)
    else:
        shape = _shape(args)
        config = ByteTransformerConfig(
            shape.d_model, shape.n_layers, shape.n_heads, shape.context, shape.mlp_ratio
        )
        model, context = ByteTransformer(config, seed=0), shape.context
    corpus = load_stdlib_corpus(max_bytes=CORPUS_BYTES).train
    seed, optimizer = args.seed, AdamWSettings(grad_clip=args.grad_clip)
    return DispatchStep(
        model, lambda step: batch_for(corpus, seed, step, BATCH, context), optimizer=optimizer
    )


def _dispatched(args: argparse.Namespace) -> bool:
    """Whether the task is a dispatch trace (``verify.dispatch``), not the hand-written graph."""
    return bool(args.model_config) or args.grad_clip > 0


def _traced_step(args: argparse.Namespace) -> Any:
    return _dispatch(args) if _dispatched(args) else _repops(args)


def _first_step(args: argparse.Namespace, step: Any) -> list[Any]:
    """The records of one traced step, run here; ``_Refused`` naming the operator a model's
    step cannot run under RepOps or the trace cannot follow."""
    from verify.dispatch import TraceError, UnmappedOperator

    try:
        return step(step.initial_state(), 0).records
    except (UnmappedOperator, TraceError) as exc:
        raise _Refused(f"--model-config {args.model_config}: {exc}") from None


def _preflight(args: argparse.Namespace) -> Any:
    """Refuse (``_Refused``) what would fail only once the providers run: a model the dispatch
    trace cannot run, a ``--cheat-step``/``--cheat-op`` that tampers with nothing. One traced
    step here lists the records; for the default model only when there is a cheat to check.
    Returns the traced step it built (the referee's), or None."""
    if args.cheat_step is not None and not 0 <= args.cheat_step < args.steps:
        last = args.steps - 1
        raise _Refused(f"--cheat-step {args.cheat_step}: the task's steps are 0 to {last}")
    if args.cheat_step is None and not _dispatched(args):
        return None
    from verify import LEAF_PREFIX
    from verify.dispatch import CONST_OP, tamperable

    step = _traced_step(args)
    records = _first_step(args, step)
    operator = tamperable if _dispatched(args) else (lambda r: not r.is_leaf)
    ops = [i for i, record in enumerate(records) if operator(record)]
    if args.cheat_step is None or args.cheat_op in ops:
        return step
    spans: list[list[int]] = []
    for i in ops:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans]
    if len(shown) > 24:  # the first and the last ones: where a step's operators begin and end
        shown = [*shown[:20], "...", *shown[-4:]]
    listed = f"{', '.join(shown)} ({len(ops)} of {len(records)} records)"
    if not 0 <= args.cheat_op < len(records):
        what = f"a step has {len(records)} records"
    elif records[args.cheat_op].is_leaf:
        label = records[args.cheat_op].name.removeprefix(LEAF_PREFIX)
        what = f"record {args.cheat_op} loads {label} (a parameter, state or data leaf)"
    elif records[args.cheat_op].name == CONST_OP:
        what = f"record {args.cheat_op} is a constant made outside the step"
    else:
        name = records[args.cheat_op].name
        what = f"record {args.cheat_op} is {name}, a view of its input (it computes nothing)"
    raise _Refused(f"--cheat-op {args.cheat_op} names no operator: {what}; operators are {listed}")


def _task(step: Any, steps: int, seed: int | None = None) -> tuple[dict, Any]:
    from verify import TaskSpec, state_hash

    start = step.initial_state()
    return start, TaskSpec(state_hash(start), step.seed if seed is None else seed, steps)


# Provider process ------------------------------------------------------------------------------


def _provider_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="swarmtrain.commands.verify provider")
    _task_arguments(parser)
    parser.add_argument("--cheat-step", type=int)
    parser.add_argument("--cheat-op", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p import HostConfig, open_host
    from verify.dispute import Provider, serve_provider

    torch.set_num_threads(args.threads)
    step = _traced_step(args)
    start, task = _task(step, args.steps, args.seed)
    tamper = None if args.cheat_step is None else (args.cheat_step, args.cheat_op or 0)
    provider = Provider(step, start, task, tamper=tamper)
    began = time.perf_counter()
    commitment = provider.run()
    task_s = time.perf_counter() - began

    async def serve() -> None:
        async with open_host(HostConfig(create_new_key_pair())) as host:
            serve_provider(host, provider)
            ready = {"addr": str(host.addrs()[0]), "task_seconds": task_s,
                     "final_hash": commitment.final_state_hash.hex(),
                     "ops_per_step": provider.leaves[0].n_ops}  # fmt: skip
            print("READY " + json.dumps(ready), flush=True)
            await trio.sleep_forever()

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve)
    return 0


# Referee (this process) ------------------------------------------------------------------------


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any] | None = None
    stderr: bytes = b""


def _spawn(name: str, args: argparse.Namespace, cheat: bool) -> _Child:
    argv = [sys.executable, "-m", "swarmtrain.commands.verify", "provider"]
    argv += ["--steps", str(args.steps), "--threads", str(args.threads), "--seed", str(args.seed)]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--model-config", args.model_config] if args.model_config else []
    argv += ["--grad-clip", repr(args.grad_clip)] if args.grad_clip else []
    if cheat:
        argv += ["--cheat-step", str(args.cheat_step), "--cheat-op", str(args.cheat_op or 0)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    return _Child(name, proc)


def _wait_ready(child: _Child) -> None:
    assert child.proc.stdout is not None and child.proc.stderr is not None
    errors = threading.Thread(target=lambda: setattr(child, "stderr", child.proc.stderr.read()))
    errors.daemon = True
    errors.start()
    for raw in child.proc.stdout:
        line = raw.decode(errors="replace")
        if line.startswith("READY "):
            child.ready = json.loads(line[len("READY ") :])
            return
    errors.join(5)


def _stop(child: _Child) -> None:
    if child.proc.poll() is None:
        os.killpg(child.proc.pid, signal.SIGINT)
        try:
            child.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait(5)


def run(args: argparse.Namespace) -> int:
    if (args.cheat_step is None) != (args.cheat_op is None):
        print("swarmtrain verify: --cheat-step and --cheat-op go together", file=sys.stderr)
        return 2
    if args.steps < 1 or args.threads < 1:
        print("swarmtrain verify: --steps and --threads must be at least 1", file=sys.stderr)
        return 2
    if not args.grad_clip >= 0:  # NaN too
        print(f"swarmtrain verify: --grad-clip {args.grad_clip}: must be 0 (off) or positive",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.model_config and args.tiny:
        print("swarmtrain verify: --tiny is the default model's; not with --model-config",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        step = _preflight(args)
    except _Refused as exc:
        print(f"swarmtrain verify: {exc}", file=sys.stderr)
        return 2
    children = [
        _spawn("A", args, cheat=False),
        _spawn("B", args, cheat=args.cheat_step is not None),
    ]
    try:
        waiters = [threading.Thread(target=_wait_ready, args=(c,), daemon=True) for c in children]
        for w in waiters:
            w.start()
        if not args.json:
            print(f"running {args.steps} steps on providers A and B ...", flush=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        # Fail fast: a provider that exits before its READY line ends the run at once.
        while any(w.is_alive() for w in waiters) and time.monotonic() < deadline:
            if any(
                not w.is_alive() and c.ready is None for w, c in zip(waiters, children, strict=True)
            ):
                break
            waiters[0].join(0.1)
        if any(child.ready is None for child in children):
            # The provider that exited is the one to report; the other is only stopped.
            exited = [c for c in children if c.ready is None and c.proc.poll() is not None]
            failed = exited[0] if exited else next(c for c in children if c.ready is None)
            for child in children:
                _stop(child)
            tail = failed.stderr.decode(errors="replace").strip().splitlines()
            why = tail[-1] if tail else f"no READY line within {READY_TIMEOUT_S:.0f} s"
            print(f"swarmtrain verify: provider {failed.name} failed: {why}", file=sys.stderr)
            return 2
        return _referee(args, children, step)
    finally:
        for child in children:
            _stop(child)


def _referee(args: argparse.Namespace, children: list[_Child], step: Any = None) -> int:
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p import HostConfig, PeerID, open_host
    from verify import tensor_hash
    from verify.dispatch import recompute
    from verify.dispute import DisputeOutcome, Referee, RefereeConfig, run_referee
    from verify.repops import run_op

    step = step or _traced_step(args)
    _, task = _task(step, args.steps, args.seed)
    labels = {"inputs": 0, "targets": 1}

    def data_leaf(index: int, label: str, attrs: bytes) -> bytes | None:
        return tensor_hash(step.batch(index)[labels[label]]) if label in labels else None

    # RepOpsStep's graph is the same every step (the step counter is a state tensor); a
    # dispatch trace's is only for a model that does not branch on its data
    # (verify.dispatch.traced).
    dispatched = _dispatched(args)
    config = RefereeConfig(args.timeout, same_program_every_step=not dispatched)
    referee = Referee(
        task, recompute if dispatched else run_op, leaf_oracle=data_leaf, config=config
    )
    addrs = [multiaddr.Multiaddr(c.ready["addr"]) for c in children]  # type: ignore[index]
    peers = [PeerID.from_base58(a.value_for_protocol("p2p")) for a in addrs]

    async def referee_game() -> DisputeOutcome:
        async with open_host(HostConfig(create_new_key_pair())) as host:
            for peer, addr in zip(peers, addrs, strict=True):
                await host.connect(peer, [addr])
            return await run_referee(host, (peers[0], peers[1]), referee)

    outcome = trio.run(referee_game)
    v = outcome.verdict
    named = [str(peers[p]) for p in v.cheaters]
    honest = [p for p in (0, 1) if p not in v.cheaters]
    finals = v.final_state_hashes
    honest_hash = (
        finals[honest[0]].hex() if finals and len(honest) and (named or v.agreed) else None
    )
    result = {
        "cheater": named[0] if len(named) == 1 else (named or None),
        "step": v.step,
        "op": v.op,
        "op_name": v.op_name,
        "rounds": v.rounds,
        "bytes": outcome.bytes_exchanged,
        "referee_seconds": round(outcome.referee_compute_s, 6),
        "dispute_seconds": round(outcome.seconds, 3),
        "task_seconds": round(children[0].ready["task_seconds"], 3),  # type: ignore[index]
        "honest_final_hash": honest_hash,
        "reason": v.reason,
        "ops_per_step": children[0].ready["ops_per_step"],  # type: ignore[index]
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result, children, peers, v.agreed)
    return 0 if v.agreed or v.cheaters else 1


def _print_human(result: dict, children: list[_Child], peers: list, agreed: bool) -> None:
    for child, peer in zip(children, peers, strict=True):
        print(f"provider {child.name}: {peer}")
    if agreed:
        print("verdict: no dispute, both providers committed to the same task")
    elif result["cheater"]:
        name = "A" if result["cheater"] == str(peers[0]) else "B"
        print(
            f"verdict: provider {name} cheated at step {result['step']}, "
            f"operator {result['op']} ({result['op_name']}): {result['reason']}"
        )
    else:
        print(f"verdict: undecided: {result['reason']}")
    ratio = result["referee_seconds"] / max(result["task_seconds"], 1e-9)
    print(
        f"rounds: {result['rounds']} in {result['dispute_seconds']:.2f} s, bytes exchanged: "
        f"{result['bytes']}, records a step: {result['ops_per_step']}"
    )
    print(
        f"referee compute: {result['referee_seconds']:.3f} s vs {result['task_seconds']:.1f} s "
        f"to run the task ({ratio:.2%})"
    )
    print(f"honest final state hash: {result['honest_final_hash']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["provider"]:
        sys.exit(_provider_main(sys.argv[2:]))
    _parser = argparse.ArgumentParser(prog="swarmtrain.commands.verify")
    _sub = _parser.add_subparsers(dest="command", required=True)
    add_parser(_sub)
    sys.exit(run(_parser.parse_args(sys.argv[1:])))
