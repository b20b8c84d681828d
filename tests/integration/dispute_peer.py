"""A dispute-game provider in its own process, for tests/integration/test_dispute_p2p.py.

    python tests/integration/dispute_peer.py --steps S [--layers L] [--cheat-step K --cheat-op J]
        [--silent-on QUERY] [--oversize-on QUERY]

Runs the toy task (``verify.dispute.toytask``, data seed 5, start weights from seed 1), commits,
serves the dispute protocols and prints one line ``READY <multiaddr>``. ``--silent-on OpOpenQuery``
makes it never answer that query type (a provider that goes silent mid-dispute);
``--oversize-on`` answers it with a frame header announcing 2 GiB. Logs go to stderr. Runs
until Ctrl+C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import struct
import sys

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2p import HostConfig, Message, PeerID, RpcStream, Stream, open_host, serve_unary
from verify.commit import TaskSpec
from verify.dispute.driver import serve_provider
from verify.dispute.provider import Provider
from verify.dispute.toytask import ToyTask
from verify.dispute.wire import QUERY_TYPES
from verify.trace import state_hash

DATA_SEED = 5


def toy_task(steps: int, layers: int) -> tuple[ToyTask, dict, TaskSpec]:
    toy = ToyTask(layers=layers, data_seed=DATA_SEED)
    start = toy.initial_state(seed=1)
    return toy, start, TaskSpec(state_hash(start), DATA_SEED, steps)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cheat-step", type=int)
    parser.add_argument("--cheat-op", type=int)
    parser.add_argument("--silent-on", choices=[t.__name__ for t in QUERY_TYPES])
    parser.add_argument("--oversize-on", choices=[t.__name__ for t in QUERY_TYPES])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    toy, start, task = toy_task(args.steps, args.layers)
    tamper = None if args.cheat_step is None else (args.cheat_step, args.cheat_op)
    provider = Provider(toy, start, task, tamper=tamper)
    provider.run()
    async with open_host(HostConfig(create_new_key_pair())) as host:
        serve_provider(host, provider)
        if args.silent_on:
            query_type = next(t for t in QUERY_TYPES if t.__name__ == args.silent_on)

            async def silent(peer: PeerID, request: Message) -> Message:
                await trio.sleep_forever()
                raise AssertionError("unreachable")

            serve_unary(host, QUERY_TYPES[query_type], query_type, silent)
        if args.oversize_on:
            query_type = next(t for t in QUERY_TYPES if t.__name__ == args.oversize_on)

            async def oversize(stream: Stream) -> None:
                await RpcStream(stream).receive(query_type)
                await stream.write(struct.pack(">I", 2**31) + b"\0" * 1024)
                await trio.sleep_forever()  # the referee must not wait for the 2 GiB

            host.set_handler(QUERY_TYPES[query_type], oversize)
        print("READY", host.addrs()[0], flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)
