"""A Sybil flood for tests: 1,100 throwaway identities write the next rounds' matchmaking keys
of a run (issue 19 point 3).

    python tests/integration/round_flooder.py --join ADDR --run-id ID --identities 1100

Reads the run's progress records for the round its members are in, then signs one entry per
identity (garbage values: the point is the key's 1,024-entry capacity) under the keys of the
next ``--rounds`` rounds and stores them at the key's replicas, 512 per store. Prints
``FLOODED <first round> <last round> <replicas that took each batch>`` and serves until SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p import HostConfig, NodeConfig, open_node
from p2p.dht.kademlia import dht_key
from p2p.dht.records import RecordSigner
from swarm import round_key
from swarmtrain.keys import progress_key
from swarmtrain.membership.progress import decode_all

BATCH = 512  # two fill a key (1,024 entries); the rest come on top


async def main(args: argparse.Namespace) -> None:
    config = NodeConfig(
        HostConfig(create_new_key_pair(), listen_addrs=("/ip4/127.0.0.1/tcp/0",)),
        bootstrap=(args.join,),
    )
    signers = [RecordSigner(os.urandom(32)) for _ in range(args.identities)]
    async with open_node(config) as node:
        records = decode_all(
            {str(k): v for k, v in (await node.dht.get(progress_key(args.run_id))).items()}
        )
        now_round = max((p.round for p in records), default=0)
        first, last = now_round + 1, now_round + args.rounds
        taken = []
        for r in range(first, last + 1):
            key = round_key(args.run_id, r).decode()
            expires = time.time() + 600
            for start in range(0, len(signers), BATCH):
                batch = [
                    s.sign(dht_key(key), b"not a declaration", expires)
                    for s in signers[start : start + BATCH]
                ]
                taken.append(await node.dht.store_records(key, batch))
        print(f"FLOODED {first} {last} {taken}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--identities", type=int, default=1100)
    parser.add_argument("--rounds", type=int, default=3)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main, parser.parse_args())
