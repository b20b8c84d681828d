"""One averaging peer in its own process, driven by JSON lines on stdin (the all-reduce tests).

Start: ``python averager_peer.py --join ADDR [options]``. When it serves it prints
``READY <peer id hex>``; then each JSON command line gets one JSON line back:

    {"cmd": "average", "round": R, "numel": N, "seed": S, "weight": W,
     "expected": [hex, ...] | null, "cancel_after": seconds after the group formed | null,
     "stall": seconds to block the event loop once the group formed | null,
     "scale": factor our vector is multiplied by (an outlier's) | null,
     "kill_at": SIGKILL ourselves as a hierarchical round sends its first item of this kind
                (``grid_wire.GridKind`` name, e.g. "ACCUMULATED") | null}
        -> {"ok": true, "digest": hex, "contributors": {hex: w}, "dropped": {hex: why},
            "allreduce_s": .., "matchmaking_s": .., "bytes_sent": .., "regions": [12 short
            digests, one per twelfth of the vector], "parts": [[start, stop], ...],
            "max_abs": largest |value| of the result, "group_size": .., "rows": rows of the
            hierarchical layout (1: flat)}  or {"ok": false, "error": ..}
    {"cmd": "publish_hash", "round": R, "digest": hex}  -> {"stored": n}
    {"cmd": "agreement", "round": R}                    -> {"agrees": .., "peers": .., ...}
    {"cmd": "channels"}  -> {"opened": n, "reused": n, "idle": n, "closed": n}  (data channels)
    {"cmd": "connections"} -> {peer hex: libp2p connections to it}
    {"cmd": "disconnect"}  -> {"closed": n}  (closes every libp2p connection)

The vector of a peer is ``vector(seed, numel)``, so the test can compute the exact mean.

``--fault`` injects a failure at a precise moment of the real protocol (this process then dies
or stalls for real; nothing is simulated on the other peers):
    exit-while-sending   exit after our first slice went out
    exit-while-reducing  exit when our reduced part is ready, before it is sent
    slow-sending:S       sleep S seconds before sending each slice
    slow-reducing:S      stall the round driver S seconds before sending our reduced part
    garbage:KIND         send a bad slice (KIND: nan, short, index) instead of the first real one;
                         ``commit``: its first value off by one, well-formed (with ``--bind``,
                         a slice other than the contribution committed before the round);
                         sparse rounds also code (the unused code), sparse-index (a chunk's
                         indices not ascending): the codec's refusals (``bad_sparse``)
    inflate:W            declare weight W, ignoring ``--max-weight`` (a liar claiming work)
``--max-weight X``: the run's weight bounds are (0, X] (``AveragerConfig.weight_bounds``).
``--bind``: committed contributions (``Averager.slice_root``, issue 19): each ``average`` command
then carries ``"bound": {hex: root hex}``, the roots the peers committed to before the round.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import HostConfig, NodeConfig, PeerID, open_node
from swarm import Averager, AveragerConfig, AveragingFailed, Compression, SparseCodec
from swarm.averaging import grid_session, session_wire, sparse_codec
from swarm.averaging import session as session_module
from swarm.averaging.allreduce import SendPart, SendReduced
from swarm.averaging.matchmaking import RoundSchedule
from swarm.averaging.payload import Layout


def vector(seed: int, numel: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(numel, dtype=np.float32)


def install_fault(spec: str | None) -> None:
    if not spec:
        return
    kind, _, arg = spec.partition(":")
    Session = session_module.Session
    send_item, apply = Session._send_item, Session._apply

    if kind == "exit-while-sending":

        async def exit_after_first(self, rpc, direct, channel, order):  # type: ignore[no-untyped-def]
            channel = await send_item(self, rpc, direct, channel, order)
            if isinstance(order, SendPart):
                os._exit(3)
            return channel

        Session._send_item = exit_after_first
    elif kind == "mute":  # in the group, answers pings and takes our slices, sends nothing

        async def mute(self, peer):  # type: ignore[no-untyped-def]
            await trio.sleep_forever()

        Session._send_loop = mute
    elif kind == "slow-sending":

        async def slow(self, rpc, direct, channel, order):  # type: ignore[no-untyped-def]
            if isinstance(order, SendPart):
                await trio.sleep(float(arg))
            return await send_item(self, rpc, direct, channel, order)

        Session._send_item = slow
    elif kind in ("exit-while-reducing", "slow-reducing"):

        async def at_reduced(self, actions):  # type: ignore[no-untyped-def]
            if any(isinstance(a, SendReduced) for a in actions):
                if kind == "exit-while-reducing":
                    os._exit(3)
                await trio.sleep(float(arg))
            await apply(self, actions)

        Session._apply = at_reduced
    elif kind == "garbage":

        async def bad(self, rpc, direct, channel, order):  # type: ignore[no-untyped-def]
            if not isinstance(order, SendPart) or getattr(self, "_garbage_sent", False):
                return await send_item(self, rpc, direct, channel, order)
            self._garbage_sent = True
            start, stop = order.start, order.stop
            values = self._values.local[start:stop].copy()
            index = order.part_index
            if arg == "nan":
                values[:1] = np.nan
            elif arg == "commit":
                values[:1] += np.float32(1.0)
            elif arg == "short" and not self.layout.gathers:
                values = values[:-1]
            elif arg == "index":
                index = len(self.parts) + 5
            if self.layout.gathers:  # sparse: the real slice's bytes, bent as KIND says
                payload = bad_sparse(self.layout, values, start, arg)
            else:
                payload = values.astype(np.float32).tobytes()
            inline = payload if len(payload) <= session_wire.INLINE_MAX_BYTES else b""
            # "proof": the right bytes under a signature that is not ours (an audited round)
            proof = b"\x01" * 64 if arg == "proof" else b""
            if arg == "commit" and self.config.sign is not None:  # signed as it is: a liar's own
                proof = await self._values.own_proof(index, values, self.machine.weight)
            item = session_wire.Item(
                session_wire.KIND_SLICE,
                index,
                self.machine.weight,
                (),
                (),
                len(payload),
                inline,
                proof,
            )
            await rpc.send(item)
            if not inline:
                if channel is None:
                    channel = await self.sending_channel(order.peer, rpc, direct)
                await channel.send(payload)
            return channel

        Session._send_item = bad
    elif kind == "inflate":
        pass  # ``main`` reads it: the weight is an averaging argument, not a protocol step
    else:
        raise SystemExit(f"unknown fault {spec!r}")


def bad_sparse(layout: Layout, values: np.ndarray, start: int, kind: str) -> bytes:
    """Our sparse slice ``values`` (at ``start``) encoded, then bent: "short" one byte less,
    "code" its first four codes the one no encoder writes, "sparse-index" its first chunk's
    index set with an entry repeated (the right number of ones, not ascending)."""
    (_, _, codec), *_ = layout.segments(start, start + len(values))
    assert isinstance(codec, SparseCodec) and not codec.pooled
    payload = bytearray(layout.encode(values, start))
    if kind == "short":
        return bytes(payload[:-1])
    if kind == "code":  # the codes end the payload; 0b11 in every 2-bit field of a byte
        kept = codec._shape(len(values))[1]
        payload[-sparse_codec._packed(kept, codec.bits)] = 0xFF
        return bytes(payload)
    if kind == "sparse-index":
        chunks = -(-len(values) // codec.chunk)
        n, k = min(codec.chunk, len(values)), codec.kept(min(codec.chunk, len(values)))
        stream = np.unpackbits(np.frombuffer(payload, np.uint8, offset=chunks), bitorder="little")
        repeated = np.concatenate([[0], np.arange(k - 1)]).reshape(1, k)  # 0, 0, 1, ...
        section = sparse_codec._elias_fano(repeated, n)
        stream[: section.size] = section
        payload[chunks:] = np.packbits(stream, bitorder="little").tobytes()
        return bytes(payload)
    return bytes(payload)


def _after_group_forms(averager: Averager, then: Callable[[], None]) -> None:
    """Call ``then()`` once our next group formed, whatever matchmaking took: so a fault lands
    in the all-reduce (a cancel during matchmaking is another case: a half-published
    declaration)."""
    form_group = averager._form_group

    async def form_then(*args: Any) -> Any:
        try:
            group = await form_group(*args)
        finally:
            averager._form_group = form_group  # type: ignore[method-assign]
        then()
        return group

    averager._form_group = form_then  # type: ignore[method-assign]


def _kill_at(kind: str) -> None:
    """SIGKILL this process as its hierarchical round is about to send its first item of
    ``kind`` (a ``grid_wire.GridKind`` name): a death at a precise step of the real round."""
    to_wire = grid_session.to_wire

    def kill_first(item: Any) -> Any:
        message, payload = to_wire(item)
        if message.kind.name == kind:
            os.kill(os.getpid(), signal.SIGKILL)
        return message, payload

    grid_session.to_wire = kill_first  # type: ignore[assignment]


# ``--fault inflate:W``: every round declares this weight.
INFLATED_WEIGHT: float | None = None
BIND = False  # ``--bind``


async def command(averager: Averager, line: str) -> dict[str, Any]:
    request = json.loads(line)
    cmd = request["cmd"]
    if cmd == "average":
        local = vector(request["seed"], request["numel"])
        if request.get("scale") is not None:
            local *= np.float32(request["scale"])
        expected = request.get("expected")
        if BIND:
            roots = {bytes.fromhex(p): bytes.fromhex(h) for p, h in request["bound"].items()}
            averager.slice_root = lambda r, sender: roots.get(sender)
        try:
            with trio.CancelScope() as scope:
                cancel_after = request.get("cancel_after")
                if cancel_after is not None:

                    def arm(seconds: float = cancel_after) -> None:
                        scope.deadline = trio.current_time() + seconds

                    _after_group_forms(averager, arm)
                kill_at = request.get("kill_at")
                if kill_at is not None:
                    _kill_at(kill_at)
                stall = request.get("stall")
                if stall is not None:
                    # Blocks the event loop: a stall (a long GC pause, a blocking call, no CPU)
                    # that the others must wait out, not read as a death.
                    _after_group_forms(averager, lambda: time.sleep(stall))
                # "flat": the vector API (one segment), given away as DiLoCo gives its own
                # (``local`` is never written again here), else the list API with one tensor;
                # "overwrite": given with leave to write the mean into it (DiLoCo's rounds
                # without error feedback or overlap), compared below with a copy kept here
                overwrite = bool(request.get("overwrite"))
                flat = bool(request.get("flat")) or overwrite
                given = local
                local = local.copy() if overwrite else local
                average = (
                    functools.partial(averager.average_vector, give=True, overwrite=overwrite)
                    if flat
                    else averager.average
                )
                result = await average(
                    given if flat else [given],  # type: ignore[arg-type]
                    INFLATED_WEIGHT or request.get("weight", 1.0),
                    round_number=request["round"],
                    expected_peers=None
                    if expected is None
                    else [bytes.fromhex(p) for p in expected],
                )
        except AveragingFailed as exc:
            return {"ok": False, "error": str(exc)}
        if scope.cancelled_caught:
            return {"ok": False, "error": "cancelled"}
        return {
            "ok": True,
            "digest": result.digest,
            "contributors": {_hex(p): w for p, w in result.contributors.items()},
            "dropped": {_hex(p): why for p, why in result.dropped.items()},
            "allreduce_s": result.allreduce_s,
            "matchmaking_s": result.matchmaking_s,
            "bytes_sent": result.bytes_sent,
            # how far our contribution as the peers decoded it is from what we gave (None:
            # lossless, nothing dropped), against the largest value we gave
            "sent_error": None
            if result.sent is None
            else float(np.max(np.abs(result.sent - local))),
            "local_max": float(np.max(np.abs(local))),
            # per twelfth of the vector: which region differs when two peers' digests do
            "regions": [
                hashlib.sha256(piece.tobytes()).hexdigest()[:8]
                for piece in np.array_split(result.vector, 12)
            ],
            "parts": [list(part) for part in result.parts],
            # the mean is the given vector itself (``overwrite`` with a lossy codec)
            "in_place": bool(np.shares_memory(result.vector, given)),
            "max_abs": float(np.max(np.abs(result.vector))),
            "group_size": result.group_size,
            "rows": result.rows,
        }
    if cmd == "disconnect":  # close every libp2p connection we have
        network = averager.node.host.libp2p.get_network()
        conns = [c for group in network.get_connections_map().values() for c in group]
        for conn in conns:
            await conn.close()
        return {"closed": len(conns)}
    if cmd == "connections":
        network = averager.node.host.libp2p.get_network()
        return {
            _hex(str(peer)): len(conns) for peer, conns in network.get_connections_map().items()
        }
    if cmd == "channels":
        return dataclasses.asdict(averager.channel_statistics())
    if cmd == "publish_hash":
        return {
            "stored": await averager.publish_state_hash(
                request["round"], bytes.fromhex(request["digest"])
            )
        }
    if cmd == "agreement":
        agreement = await averager.state_agreement(request["round"])
        return {
            "agrees": agreement.agrees,
            "peers": agreement.peers,
            "agreeing": agreement.agreeing,
            "majority": agreement.majority,
        }
    return {"error": f"unknown command {cmd!r}"}


def _hex(peer_id_text: str) -> str:
    return PeerID.from_base58(peer_id_text).to_bytes().hex()


async def main(args: argparse.Namespace) -> None:
    global INFLATED_WEIGHT, BIND
    BIND = args.bind
    inflated = (args.fault or "").startswith("inflate:")
    if inflated:
        INFLATED_WEIGHT = float(args.fault.split(":", 1)[1])
    compression: Compression | SparseCodec | None = None  # "auto"
    if args.compression == "sparse":
        compression = SparseCodec()  # 2% of every 4096 entries at 2 bits
    elif args.compression != "auto":
        compression = Compression[args.compression.upper()]
    config = NodeConfig(host=HostConfig(create_new_key_pair()), bootstrap=(args.join,))
    async with open_node(config) as node, trio.open_nursery() as nursery:
        averager = Averager(
            node,
            AveragerConfig(
                run_id=args.run_id,
                compression=compression,
                matchmaking_timeout_s=args.matchmaking_timeout,
                allreduce_timeout_s=args.allreduce_timeout,
                peer_timeout_s=args.peer_timeout,
                max_group_size=args.max_group_size,
                audit=args.audit,
                weight_bounds=(0.0, math.inf if inflated else args.max_weight),
                aggregation=args.aggregation,
                # A scheduled round's windows, short for loopback (``RoundSchedule``), waiting
                # for every survivor of the last round.
                schedule=RoundSchedule(
                    args.schedule,
                    quorum_share=1.0,
                    window_s=1.0,
                    spread_factor=1.0,
                    long_window_s=20.0,
                    max_wait_s=30.0,
                    grace_s=0.5,
                    poll_s=0.2,
                )
                if args.schedule
                else None,
                matchmaking_shards=args.shards,
                row_size=args.row_size or None,
            ),
        )
        await nursery.start(averager.run)
        print("READY", node.host.peer_id.to_bytes().hex(), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            if line.strip():
                print(json.dumps(await command(averager, line)), flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", required=True)
    parser.add_argument("--run-id", default="test")
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--matchmaking-timeout", type=float, default=3.0)
    parser.add_argument("--allreduce-timeout", type=float, default=30.0)
    parser.add_argument("--peer-timeout", type=float, default=5.0)
    parser.add_argument("--max-group-size", type=int, default=64)
    parser.add_argument("--fault")
    parser.add_argument("--max-weight", type=float, default=math.inf)
    parser.add_argument("--audit", action="store_true", help="sign slices, check their proofs")
    parser.add_argument("--aggregation", default="mean", help="AveragerConfig.aggregation")
    parser.add_argument("--schedule", type=int, default=0, help="scheduled rounds: expected")
    parser.add_argument("--shards", type=int, default=1, help="round keys (needs --schedule)")
    parser.add_argument("--row-size", type=int, default=32, help="AveragerConfig.row_size; 0: None")
    parser.add_argument("-v", action="store_true")
    arguments = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO if arguments.v else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s:%(name)s:%(message)s",
    )
    install_fault(arguments.fault)
    try:
        trio.run(main, arguments)
    except KeyboardInterrupt:
        sys.exit(130)
