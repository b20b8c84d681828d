"""All-reduce benchmark: separate peer processes on loopback, measured as hivemind's bench is.

    python -m bench.allreduce --peers N --numel M --rounds R [--warmup 1]
        [--compression none|fp16|bf16|int8|auto|sparse] [--vs-hivemind PYTHON]
        [--sparse-density 0.02 --sparse-bits 2 --sparse-chunk 4096 --sparse-select chunk]

Starts a ``swarmtrain relay`` (bootstrap and DHT) and N ``bench.allreduce_worker`` processes.
Worker k averages ``np.random.default_rng(1000 + k).standard_normal(M, float32)`` (made before
any round) with weight 1; every round names all N peers as expected, so matchmaking ends as soon
as all declared. Per round the workers report wall-clock times (one machine) of the call, of the
group forming and of the return:

    allreduce phase = max(return) - max(group formed)   (hivemind: max(end) - min(trigger),
                                                          its trigger follows a barrier after
                                                          the group formed)
    matchmaking     = max over peers of the time from the call to the group forming

``--warmup`` rounds are excluded. Printed: each round, the median phase time, algorithm bandwidth
(M * 4 bytes / median), bytes each peer sent per round against the bandwidth-optimal
2(N-1)/N x the encoded vector, whether all peers' results are bit-identical (equal digests) and
the max abs error against the float64 mean (at sampled elements every round, and over every
element of rank 0's last result). ``--vs-hivemind PYTHON`` runs
../shared/bench/hivemind/bench_allreduce.py with that interpreter (a venv holding hivemind 1.1.12)
afterwards in the same sitting, with the same N, M and rounds. The last stdout line is one JSON
object: median_s, algbw_MBps, wire_bytes, bit_identical (and hivemind_median_s, ratio = our
bandwidth over hivemind's).

``--compression sparse`` (issue 20; ``SparseCodec.from_density`` with the run spec's defaults)
averages the peers' sparse vectors: each part's slice keeps its top entries per codec chunk, and
a reduced part travels as its contributors' slices (``Layout.gathers``). The mean is then not the
dense float64 mean but ``reduce_part`` over the decoded sparse slices, so the check recomputes
exactly that from the round's parts (which each result reports) and wants it bit for bit
(``sparse_mean_exact``, sampled elements every round, every element of rank 0's last result).
The bytes, per peer per round, on the payloads the averager counts (``bytes_received``, the
mean over peers; item headers and transport framing are not counted):

    I        = one peer's sparse entries' information-theoretic size: over the round's parts,
               per codec chunk of n elements keeping k, log2 C(n, k) bits (which k) + k * bits
               (the codes at the codec's width) + 8 (the chunk's scale exponent); with
               ``--sparse-select part`` the part is one set of n keeping k, 8 bits per chunk
    minimum  = (N - 1) x I / 8 bytes: every peer must receive the other N - 1 peers' entries
    sparse_info_fraction = minimum / measured           (issue 20's target: >= 0.8)
    dense_f32_ratio      = 2(N-1)/N x 4 x numel / measured (dense float32, bandwidth-optimal)

``wire_min_bytes`` is (N - 1) x the encoded sparse vector for sparse: an all-gather of the
encoded vectors, the least any exchange of them receives per peer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.allreduce_worker import add_sparse_arguments, codec_of, make_vector, sample_indices
from bench.common import git_sha
from bench.progress import BenchProgress

REPO = Path(__file__).resolve().parents[1]
# The anchor scripts live in ../shared beside the checkout (as CI and the brief lay it out).
HIVEMIND_DIR = Path(
    os.environ.get("HIVEMIND_BENCH_DIR", REPO.parent / "shared" / "bench" / "hivemind")
)
START_TIMEOUT_S = 120.0
SAMPLE = 4096


# ---------------------------------------------------------------------------- processes


class Proc:
    """A child in its own process group; stdout lines go to a queue, stderr is kept for errors."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def stderr_tail(self, lines: int = 30) -> str:
        return "".join(self._stderr[-lines:])

    def line(self, timeout_s: float) -> str:
        try:
            line = self.lines.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise TimeoutError(f"{self.name}: nothing on stdout within {timeout_s:.0f} s") from None
        if line is None:
            self.lines.put(None)  # stay at end of file for later readers
            code = self.proc.poll()
            raise RuntimeError(f"{self.name} closed stdout (exit {code})")
        return line

    def send(self, record: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(record) + "\n")
        self.proc.stdin.flush()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close stdin (a worker exits), then SIGINT (the relay), then SIGKILL the whole group."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        first = [None] if self.name.startswith("worker") else []
        for sig in (*first, signal.SIGINT, signal.SIGKILL):
            if sig is not None:
                self.signal_group(sig)
            try:
                self.proc.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.signal_group(signal.SIGKILL)  # anything it left behind in its group


def start_relay(tmp: Path) -> tuple[Proc, str]:
    relay = Proc(
        "relay",
        [
            sys.executable,
            "-m",
            "swarmtrain.cli",
            "relay",
            "--identity",
            str(tmp / "relay.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ],
    )
    try:
        return relay, relay.line(START_TIMEOUT_S).strip()
    except BaseException:
        print(relay.stderr_tail(), file=sys.stderr)
        relay.stop()
        raise


class Worker(Proc):
    def __init__(self, rank: int, join: str, numel: int, extra: list[str]) -> None:
        argv = [sys.executable, "-m", "bench.allreduce_worker", "--join", join]
        argv += ["--rank", str(rank), "--numel", str(numel), *extra]
        super().__init__(f"worker {rank}", argv)
        self.rank = rank
        self.peer_hex = ""
        self.config = ""
        self.events: list[dict[str, Any]] = []

    def wait_ready(self, deadline: float) -> None:
        while True:
            line = self.line(deadline - time.monotonic())
            if line.startswith("READY "):
                self.peer_hex = line.split()[1]
                return
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "config":
                    self.config = record["averager"]

    def next_event(self, deadline: float) -> dict[str, Any]:
        while True:
            line = self.line(deadline - time.monotonic())
            if line.startswith("{"):
                record = json.loads(line)
                self.events.append(record)
                return record


def start_workers(n: int, join: str, numel: int, extra: list[str]) -> list[Worker]:
    workers: list[Worker] = []
    try:
        for rank in range(n):
            workers.append(Worker(rank, join, numel, extra))
        deadline = time.monotonic() + START_TIMEOUT_S + 10 * n
        for worker in workers:
            worker.wait_ready(deadline)
    except BaseException:
        report_failure(workers)
        stop_all(workers)
        raise
    return workers


def collect_results(
    workers: list[Worker],
    round_number: int,
    timeout_s: float,
    on_event: Callable[[Worker, dict[str, Any]], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Wait (bounded) for each worker's result of the round; ``on_event`` sees every event. Then
    ask each worker that succeeded for its result's SHA-256, now that nobody is averaging."""
    deadline = time.monotonic() + timeout_s
    results = _await_event(workers, "result", round_number, deadline, on_event)
    asked = [w for w in workers if results[w.rank].get("ok")]
    for worker in asked:
        worker.send({"cmd": "digest", "round": round_number})
    for rank, record in _await_event(asked, "digest", round_number, deadline).items():
        results[rank]["digest"] = record["digest"]
    return results


def _await_event(
    workers: list[Worker],
    kind: str,
    round_number: int,
    deadline: float,
    on_event: Callable[[Worker, dict[str, Any]], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Each worker's first ``kind`` event of the round, by rank (TimeoutError at ``deadline``)."""
    pending = {w.rank: w for w in workers}
    found: dict[int, dict[str, Any]] = {}
    while pending:
        for rank, worker in list(pending.items()):
            try:
                record = worker.next_event(min(deadline, time.monotonic() + 0.05))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"round {round_number}: no {kind} from workers {sorted(pending)}"
                    ) from None
                continue
            if on_event is not None:
                on_event(worker, record)
            if record.get("event") == kind and record.get("round") == round_number:
                found[rank] = record
                del pending[rank]
    return found


def report_failure(workers: list[Proc]) -> None:
    for worker in workers:
        tail = worker.stderr_tail()
        if tail.strip():
            print(f"--- {worker.name} stderr tail ---\n{tail}", file=sys.stderr)


def stop_all(procs: list[Any]) -> None:
    for proc in procs:
        proc.stop()


def wire_minimum(peers: int, numel: int, args: argparse.Namespace) -> int:
    """2(N-1)/N x the encoded vector: what each peer must send in a bandwidth-optimal round; for
    sparse, (N-1) x the encoded vector (an all-gather: sparse vectors do not add part-wise)."""
    from swarm.averaging.payload import Layout

    encoded = Layout.for_sizes([numel], codec_of(args)).wire_bytes(0, numel)
    if args.compression == "sparse":
        return (peers - 1) * encoded
    return 2 * (peers - 1) * encoded // peers


def sparse_information_bits(codec: Any, parts: list[list[int]]) -> float:
    """I (the module docstring): one peer's sparse entries over the round's ``parts``, in bits."""

    def chunk_bits(n: int) -> float:
        k = codec.kept(n)
        choose = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        return choose / math.log(2) + k * codec.bits + 8

    total = 0.0
    for start, stop in parts:
        if codec.pooled:  # one set over the part, a scale per chunk
            n = stop - start
            total += chunk_bits(n) + 8 * (-(-n // codec.chunk) - 1)
            continue
        full, rest = divmod(stop - start, codec.chunk)
        total += full * chunk_bits(codec.chunk) + (chunk_bits(rest) if rest else 0.0)
    return total


def sparse_decoded(rank: int, numel: int, codec: Any, parts: list[list[int]]) -> np.ndarray:
    """Worker ``rank``'s vector as its peers decode it in a round cut into ``parts``."""
    from swarm.averaging.payload import Layout

    bounds = [bound for part in parts for bound in part]
    if not parts or bounds[0] != 0 or bounds[-1] != numel or bounds[1:-1:2] != bounds[2::2]:
        raise RuntimeError(f"a result's parts do not tile the vector: {parts}")
    layout = Layout.for_sizes([numel], codec)
    vector = make_vector(rank, numel)
    out = np.empty(numel, dtype=np.float32)
    for start, stop in parts:
        out[start:stop] = layout.round_trip(vector[start:stop], start)
    return out


def exact_sparse_mean(
    decoded: dict[int, np.ndarray], contributors: dict[str, float], ranks: dict[str, int]
) -> np.ndarray:
    """``reduce_part`` over the contributors' decoded vectors: what every peer computes."""
    from swarm import reduce_part

    return reduce_part(
        {bytes.fromhex(p): (decoded[ranks[p]], float(w)) for p, w in contributors.items()}
    )


def float64_mean(ranks: list[int], numel: int) -> np.ndarray:
    total = np.zeros(numel, dtype=np.float64)
    for rank in ranks:
        total += make_vector(rank, numel)
    return total / len(ranks)


# ---------------------------------------------------------------------------- the bench


def _run_ours(args: argparse.Namespace, tmp: Path, progress: BenchProgress) -> dict[str, Any]:
    extra = ["--compression", args.compression, "--matchmaking-timeout", str(args.match_timeout)]
    if args.compression == "sparse":
        extra += ["--sparse-density", str(args.sparse_density), "--sparse-bits"]
        extra += [str(args.sparse_bits), "--sparse-chunk", str(args.sparse_chunk)]
        extra += ["--sparse-select", args.sparse_select]
    extra += ["--peer-timeout", str(args.peer_timeout)] if args.peer_timeout else []
    progress.phase(f"starting a relay and {args.peers} workers")
    relay, join = start_relay(tmp)
    workers: list[Worker] = []
    rounds: list[dict[int, dict[str, Any]]] = []
    dump = tmp / "rank0.npy"
    try:
        t0 = time.monotonic()
        workers = start_workers(args.peers, join, args.numel, extra)
        progress.line(f"relay + {args.peers} workers ready after {time.monotonic() - t0:.1f} s")
        progress.line(f"averager config: {workers[0].config}")
        expected = [w.peer_hex for w in workers]
        total = args.warmup + args.rounds
        progress.add("allreduce", total, plain_lines=False)  # a line per round already
        for r in range(total):
            for worker in workers:
                worker.send(
                    {
                        "cmd": "average",
                        "round": r,
                        "expected": expected,
                        "sample": SAMPLE,
                        "dump": str(dump) if worker.rank == 0 and r == total - 1 else None,
                    }
                )
            results = collect_results(workers, r, args.round_timeout)
            rounds.append(results)
            progress.line(_round_line(r, r < args.warmup, results, args))
            progress.advance("allreduce")
    except BaseException:
        report_failure([relay, *workers])
        raise
    finally:
        stop_all([*workers, relay])
    failed_ranks = {rank for res in rounds for rank, m in res.items() if not m["ok"]}
    report_failure([w for w in workers if w.rank in failed_ranks])

    # Checks after every worker is gone, so they do not compete for the cores.
    sparse = args.compression == "sparse"
    reference = "the exact mean of the decoded sparse vectors" if sparse else "the float64 mean"
    progress.phase(f"checking the results against {reference}")
    measured = rounds[args.warmup :]
    failed = [(r, rank) for r, res in enumerate(rounds) for rank, m in res.items() if not m["ok"]]
    phases = [_phase(res) for res in measured if all(m["ok"] for m in res.values())]
    matches = [_match(res) for res in measured if all(m["ok"] for m in res.values())]
    sessions = [
        max(m["allreduce_s"] for m in res.values())
        for res in measured
        if all(m["ok"] for m in res.values())
    ]
    # The reference is the float64 mean over the contributors each result reports (all N
    # unless the round lost peers); sampled elements every round, every element of rank 0's last.
    ranks = {w.peer_hex: w.rank for w in workers}
    idx = sample_indices(args.numel, SAMPLE)
    samples = np.zeros((args.peers, len(idx)), dtype=np.float64)
    for rank in range(args.peers):
        samples[rank] = make_vector(rank, args.numel)[idx]
    sample_err = 0.0
    partial = []
    sparse_samples: dict[str, dict[int, np.ndarray]] = {}  # by the round's parts
    last = rounds[-1].get(0) if rounds else None
    full_err = None
    if sparse and dump.exists() and last is not None and last["ok"]:
        # Every peer's decoded vector of the last round, once: the sampled check reuses them.
        decoded = {
            ranks[p]: sparse_decoded(ranks[p], args.numel, codec_of(args), last["parts"])
            for p in last["contributors"]
        }
        sparse_samples[json.dumps(last["parts"])] = {k: v[idx] for k, v in decoded.items()}
        exact = exact_sparse_mean(decoded, last["contributors"], ranks)
        full_err = float(np.abs(np.load(dump).astype(np.float64) - exact).max())
        del decoded, exact
    elif dump.exists() and last is not None and last["ok"]:
        group = sorted(ranks[p] for p in last["contributors"])
        full_err = float(
            np.abs(np.load(dump).astype(np.float64) - float64_mean(group, args.numel)).max()
        )
    for r, res in enumerate(rounds):
        for rank, m in res.items():
            if not m["ok"]:
                continue
            group = sorted(ranks[p] for p in m["contributors"])
            if len(group) < args.peers:
                partial.append((r, rank, len(group)))
            if sparse:
                key = json.dumps(m["parts"])
                if key not in sparse_samples:
                    sparse_samples[key] = {
                        k: sparse_decoded(k, args.numel, codec_of(args), m["parts"])[idx]
                        for k in range(args.peers)
                    }
                ref = exact_sparse_mean(sparse_samples[key], m["contributors"], ranks)
            else:
                ref = samples[group].mean(axis=0)
            error = np.abs(np.asarray(m["sample"], dtype=np.float64) - ref).max()
            sample_err = max(sample_err, float(error))
    bit_identical = all(
        all(m["ok"] for m in res.values()) and len({m["digest"] for m in res.values()}) == 1
        for res in rounds
    )
    agree_ok = all(len({m["digest"] for m in res.values() if m["ok"]}) <= 1 for res in rounds)
    wire = [m["bytes_sent"] for res in measured for m in res.values() if m["ok"]]
    nbytes = args.numel * 4
    minimum = wire_minimum(args.peers, args.numel, args)
    median = statistics.median(phases) if phases else float("nan")
    optimal = "all-gather (N-1) x encoded" if sparse else "bandwidth-optimal 2(N-1)/N x encoded"
    wire_bytes = int(statistics.median(wire)) if wire else 0
    print()
    print(
        f"=== swarm all-reduce ({git_sha()}): N={args.peers} peers, {args.numel} float32 "
        f"({nbytes / 1e6:.1f} MB), compression {args.compression}, loopback, "
        f"{os.cpu_count()} cores ==="
    )
    if failed:
        print(f"FAILED (round, rank): {failed}")
        print(f"peers that returned agree bit for bit within each round: {agree_ok}")
    if partial:
        print(f"results over fewer than N contributors (round, rank, contributors): {partial}")
    if phases:
        print(
            f"allreduce median {median:.3f} s (min {min(phases):.3f}, max {max(phases):.3f}, "
            f"n={len(phases)})  algbw {nbytes / median / 1e6:.1f} MB/s  busbw "
            f"{2 * (args.peers - 1) / args.peers * nbytes / median / 1e6:.1f} MB/s  "
            f"matchmaking median {statistics.median(matches):.3f} s  session allreduce_s "
            f"median {statistics.median(sessions):.3f} s"
        )
    print(
        f"wire: {wire_bytes} bytes sent per peer per round (min {min(wire, default=0)}, "
        f"max {max(wire, default=0)}); {optimal} = {minimum} "
        f"-> {wire_bytes / minimum if minimum else float('nan'):.4f}x"
    )
    figures: dict[str, Any] = {}
    if sparse:
        figures = _sparse_figures(args, measured, phases)
        print(figures.pop("text"))
    print(
        f"bit-identical on all peers in every round: {bit_identical}; max|err| vs {reference} "
        f"over each result's contributors: "
        f"{sample_err:.3g} at {len(idx)} sampled elements (all rounds, all peers), "
        f"{full_err if full_err is None else f'{full_err:.3g}'} over all elements "
        f"(rank 0, last round)"
    )
    return {
        "median_s": median,
        "algbw_MBps": nbytes / median / 1e6 if phases else 0.0,
        "wire_bytes": wire_bytes,
        "wire_min_bytes": minimum,
        "bit_identical": bit_identical,
        "matchmaking_median_s": statistics.median(matches) if matches else None,
        "max_abs_err": full_err if full_err is not None else sample_err,
        "rounds_ok": len(phases),
        "phases_s": [round(p, 4) for p in phases],
        **figures,
    }


def _sparse_figures(
    args: argparse.Namespace, measured: list[dict[int, dict[str, Any]]], phases: list[float]
) -> dict[str, Any]:
    """The sparse exchange's bytes against its information-theoretic minimum (module docstring)
    and against dense float32, over the measured rounds that every peer finished."""
    codec = codec_of(args)
    complete = [res for res in measured if all(m["ok"] for m in res.values())]
    received = [m["bytes_received"] for res in complete for m in res.values()]
    sent = [m["bytes_sent"] for res in complete for m in res.values()]
    if not received:
        return {"text": "sparse: no complete measured round", "sparse_info_fraction": None}
    # Per round: (N - 1) x I over that round's parts and contributors, then the mean.
    minima = []
    for res in complete:
        m = res[min(res)]
        minima.append((len(m["contributors"]) - 1) * sparse_information_bits(codec, m["parts"]) / 8)
    per_peer = statistics.fmean(received)
    minimum = statistics.fmean(minima)
    dense = 2 * (args.peers - 1) / args.peers * 4 * args.numel
    information = sparse_information_bits(codec, [[0, args.numel]]) / 8
    encoded = codec.wire_bytes(args.numel)
    text = (
        f"sparse {codec.name} (density {args.sparse_density}): one peer's vector encoded "
        f"{encoded} bytes, its entries' information-theoretic size {information:.0f} bytes "
        f"({'per part' if codec.pooled else 'per chunk'} log2 C(n, k) + k x {codec.bits} bits + 8"
        f"{' per chunk' if codec.pooled else ''}; encoded/I = "
        f"{encoded / information:.4f})\n"
        f"sparse wire per peer per round: received {per_peer:.0f} bytes (mean; sent "
        f"{statistics.fmean(sent):.0f}); minimum (N-1) x I over the round's parts = "
        f"{minimum:.0f} -> sparse_info_fraction {minimum / per_peer:.4f} (target >= 0.8); "
        f"dense float32 bandwidth-optimal 2(N-1)/N x 4 x numel = {dense:.0f} -> "
        f"{dense / per_peer:.1f}x fewer bytes"
    )
    return {
        "text": text,
        "sparse_encoded_bytes": encoded,
        "sparse_info_bytes": round(information),
        "bytes_received": round(per_peer),
        "sparse_info_min_bytes": round(minimum),
        "sparse_info_fraction": minimum / per_peer,
        "dense_f32_optimal_bytes": round(dense),
        "dense_f32_ratio": dense / per_peer,
    }


def _phase(results: dict[int, dict[str, Any]]) -> float:
    return max(m["t_return"] for m in results.values()) - max(
        m["t_matched"] for m in results.values()
    )


def _match(results: dict[int, dict[str, Any]]) -> float:
    return max(m["t_matched"] - m["t_call"] for m in results.values())


def _round_line(
    r: int, warmup: bool, results: dict[int, dict[str, Any]], args: argparse.Namespace
) -> str:
    tag = "warmup" if warmup else "measured"
    bad = {rank: m["error"] for rank, m in sorted(results.items()) if not m["ok"]}
    if bad:
        return f"round {r} ({tag}): FAILED on {len(bad)} peers: {bad}"
    phase = _phase(results)
    groups = {len(m["contributors"]) for m in results.values()}
    sent = [m["bytes_sent"] for m in results.values()]
    return (
        f"round {r} ({tag}): match {_match(results):6.3f} s  allreduce {phase:7.3f} s  "
        f"algbw {args.numel * 4 / phase / 1e6:8.1f} MB/s  session "
        f"{max(m['allreduce_s'] for m in results.values()):.3f} s  group sizes {groups}  "
        f"distinct results {len({m['digest'] for m in results.values()})}  sent/peer "
        f"{min(sent)}..{max(sent)} B  cpu (all peers) "
        f"{sum(m['cpu_s'] for m in results.values()):.2f} s  uploads (Mbit/s) "
        f"{[round((m.get('upload_bps') or 0) / 1e6) for m in results.values()]}"
    )


def _run_hivemind(python: str, args: argparse.Namespace) -> dict[str, Any]:
    script = HIVEMIND_DIR / "bench_allreduce.py"
    cmd = [python, str(script), "--peers", str(args.peers), "--numel", str(args.numel)]
    cmd += ["--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.hivemind_timeout,
            cwd=script.parent,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        print(out[-3000:])
        raise RuntimeError(f"hivemind bench ran past {args.hivemind_timeout} s") from None
    out = done.stdout
    lines = [line for line in out.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("===")), 0)
    print("\n".join(lines[start:]))
    match = re.search(r"RESULT N=\d+ numel=\d+ bytes=\d+: allreduce median ([\d.]+) s", out)
    if match is None:
        print(done.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"hivemind bench printed no RESULT line (exit {done.returncode})")
    median = float(match.group(1))
    identical = re.search(r"bitwise identical on all peers: (\w+)", out)
    return {
        "hivemind_median_s": median,
        "hivemind_algbw_MBps": args.numel * 4 / median / 1e6,
        "hivemind_bit_identical": identical.group(1) == "True" if identical else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before, not measured")
    parser.add_argument(
        "--compression", choices=["none", "fp16", "bf16", "int8", "auto", "sparse"], default="none"
    )
    add_sparse_arguments(parser)
    parser.add_argument("--match-timeout", type=float, default=30.0, help="matchmaking_timeout_s")
    parser.add_argument(
        "--peer-timeout", type=float, default=None, help="peer_timeout_s [swarm's default]"
    )
    parser.add_argument("--round-timeout", type=float, default=180.0, help="our bound per round")
    parser.add_argument("--vs-hivemind", metavar="PYTHON", default=None)
    parser.add_argument("--hivemind-timeout", type=float, default=1200.0)
    args = parser.parse_args()
    if args.peers < 2 or args.rounds < 1 or args.numel < 1:
        parser.error("need --peers >= 2, --rounds >= 1, --numel >= 1")
    try:
        codec_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    result: dict[str, Any] = {
        "bench": "allreduce",
        "config": {
            "peers": args.peers,
            "numel": args.numel,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "compression": args.compression,
            "peer_timeout_s": args.peer_timeout,
            **(
                {
                    "sparse_density": args.sparse_density,
                    "sparse_bits": args.sparse_bits,
                    "sparse_chunk": args.sparse_chunk,
                    "sparse_select": args.sparse_select,
                }
                if args.compression == "sparse"
                else {}
            ),
        },
        "git_sha": git_sha(),
    }
    with BenchProgress() as progress, tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp:
        result.update(_run_ours(args, Path(tmp), progress))
        if args.vs_hivemind:
            progress.phase("hivemind's all-reduce on the same vectors")
    if args.vs_hivemind:
        result.update(_run_hivemind(args.vs_hivemind, args))
        ours, theirs = result["algbw_MBps"], result["hivemind_algbw_MBps"]
        result["ratio"] = ours / theirs if theirs else None
        print(
            f"\nours {ours:.1f} MB/s vs hivemind {theirs:.1f} MB/s -> ratio {result['ratio']:.2f}x"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
