"""One averaging peer for bench.allreduce and bench.allreduce_fault, driven by JSON lines on stdin.

    python -m bench.allreduce_worker --join ADDR --rank K --numel M [--compression none] [...]
        [--sparse-density 0.02 --sparse-bits 2 --sparse-chunk 4096]   (with --compression sparse)
        [--sparse-select chunk|part]

Generates its vector ``np.random.default_rng(1000 + rank).standard_normal(M, float32)`` before it
says ``READY <peer id hex>``, so no round pays for it. Each command line
``{"cmd": "average", "round": r, "expected": [hex, ...], "sample": K, "dump": path | null}``
is answered by event lines, each one JSON object:

    {"event": "start", "round": r, "t": wall}       the average() call is made now
    {"event": "matched", "round": r, "t": wall}     the group formed (matchmaking returned)
    {"event": "result", "round": r, "ok": true, "t_call", "t_matched", "t_return",
     "cpu_s" (this process, call to return), "matchmaking_s", "allreduce_s", "bytes_sent",
     "bytes_received", "digest",
     "contributors": {hex: weight}, "dropped": {hex: why}, "parts": [[start, stop], ...],
     "sample": [K values]}
    {"event": "result", "round": r, "ok": false, "error": "...", "t_call", "t_return"}

Times are ``time.time()`` (all peers run on one machine, so they compare). ``sample`` holds the
result at ``sample_indices(M, K)``; ``dump`` saves the full result there (``np.save``). The worker
exits when stdin closes. Warnings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np


def make_vector(rank: int, numel: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(numel, dtype=np.float32)


def sample_indices(numel: int, count: int) -> np.ndarray:
    """The element indices a worker reports values at (the bench checks them against float64)."""
    if count <= 0 or numel <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.random.default_rng(7).integers(0, numel, size=count, dtype=np.int64))


def codec_of(args: argparse.Namespace) -> Any:
    """The averager's ``compression`` for ``--compression`` (None: chosen per tensor); sparse is
    ``SparseCodec.from_density`` with the run spec's keys."""
    from swarm import Compression, SparseCodec

    if args.compression == "sparse":
        return SparseCodec.from_density(
            args.sparse_density, args.sparse_bits, args.sparse_chunk, args.sparse_select
        )
    return None if args.compression == "auto" else Compression[args.compression.upper()]


def add_sparse_arguments(parser: argparse.ArgumentParser) -> None:
    """``--sparse-*``, the run spec's ``[swarm] sparse_*`` keys with their defaults."""
    parser.add_argument("--sparse-density", type=float, default=0.02, help="[0.02]")
    parser.add_argument("--sparse-bits", type=int, default=2, help="[2]")
    parser.add_argument("--sparse-chunk", type=int, default=4096, help="[4096]")
    parser.add_argument(
        "--sparse-select", default="chunk", choices=["chunk", "part"], help="[chunk]"
    )


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


async def _main(args: argparse.Namespace) -> None:
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p import HostConfig, NodeConfig, PeerID, open_node
    from swarm import Averager, AveragerConfig, AveragingFailed, AveragingResult

    class TimedAverager(Averager):
        """Announces the moment the group forms (swarm has no hook for it; the bench needs it)."""

        async def _form_group(self, r: int, *args: Any) -> Any:
            group = await super()._form_group(r, *args)
            self.matched_at = time.time()
            _emit({"event": "matched", "round": r, "t": self.matched_at})
            return group

    config = AveragerConfig(
        run_id=args.run_id,
        compression=codec_of(args),
        matchmaking_timeout_s=args.matchmaking_timeout,
        **({"allreduce_timeout_s": args.allreduce_timeout} if args.allreduce_timeout else {}),
        **({"peer_timeout_s": args.peer_timeout} if args.peer_timeout else {}),
    )
    vector = make_vector(args.rank, args.numel)
    node_config = NodeConfig(host=HostConfig(create_new_key_pair()), bootstrap=(args.join,))
    async with open_node(node_config) as node, trio.open_nursery() as nursery:
        averager = TimedAverager(node, config)
        await nursery.start(averager.run)
        _emit({"event": "config", "averager": repr(config)})
        print("READY", node.host.peer_id.to_bytes().hex(), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        last: AveragingResult | None = None
        async for line in stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            r = int(request["round"])
            if request.get("cmd") == "digest":
                # Asked for once every peer returned: hashing 100 MB must not slow the peers
                # still finishing the round being measured.
                digest = last.digest if last is not None and last.round == r else None
                _emit({"event": "digest", "round": r, "digest": digest})
                continue
            expected = request.get("expected")
            peers = None if expected is None else [bytes.fromhex(p) for p in expected]
            averager.matched_at = None
            t_call = time.time()
            cpu_start = time.process_time()
            _emit({"event": "start", "round": r, "t": t_call})
            try:
                result = await averager.average_vector(
                    vector,
                    float(request.get("weight", 1.0)),
                    round_number=r,
                    expected_peers=peers,
                )
            except AveragingFailed as exc:
                _emit(
                    {
                        "event": "result",
                        "round": r,
                        "ok": False,
                        "error": str(exc),
                        "t_call": t_call,
                        "t_matched": averager.matched_at,
                        "t_return": time.time(),
                    }
                )
                continue
            t_return = time.time()
            last = result
            out = result.vector
            idx = sample_indices(out.size, int(request.get("sample", 0)))
            if request.get("dump"):
                np.save(request["dump"], out)
            _emit(
                {
                    "event": "result",
                    "round": r,
                    "ok": True,
                    "t_call": t_call,
                    "t_matched": averager.matched_at or t_call + result.matchmaking_s,
                    "t_return": t_return,
                    "cpu_s": time.process_time() - cpu_start,
                    "matchmaking_s": result.matchmaking_s,
                    "allreduce_s": result.allreduce_s,
                    "bytes_sent": result.bytes_sent,
                    "bytes_received": result.bytes_received,
                    "upload_bps": result.upload_bps,
                    "contributors": {
                        PeerID.from_base58(p).to_bytes().hex(): w
                        for p, w in result.contributors.items()
                    },
                    "dropped": result.dropped,
                    "parts": [list(part) for part in result.parts],
                    "sample": out[idx].astype(float).tolist(),
                }
            )
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--join", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--run-id", default="bench")
    parser.add_argument("--compression", default="none")
    add_sparse_arguments(parser)
    parser.add_argument("--matchmaking-timeout", type=float, default=30.0)
    parser.add_argument("--allreduce-timeout", type=float, default=None, help="default: swarm's")
    parser.add_argument("--peer-timeout", type=float, default=None, help="default: swarm's")
    args = parser.parse_args()
    # BENCH_LOG_LEVEL=INFO shows what the node and the session decide (bulk mode, peers lost).
    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "WARNING"), stream=sys.stderr)
    import trio

    try:
        trio.run(_main, args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
