"""A coordinator impostor for tests: serves a run spec that is tampered with or unsigned.

    python tests/integration/spec_forger.py --identity PATH --mode tampered|unsigned

Runs a relay-role node (so volunteers can join through it) whose ``/swarmtrain/runspec/1``
answers with a spec the real coordinator code signed and then had its bytes changed (``tampered``:
run.rounds 3 -> 9 under the original signature) or with no signature (``unsigned``). Prints the
join address as its first stdout line, then serves until SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p import join_addr, load_or_create_identity, open_node
from swarmtrain.commands.coordinator import serve_spec
from swarmtrain.commands.relay import RelayOptions, relay_node_config
from swarmtrain.config import RunConfig, RunSection
from swarmtrain.runspec import RunSpec, sign_spec


async def main(identity: Path, mode: str) -> None:
    key_pair = load_or_create_identity(identity)
    options = RelayOptions(listen=("/ip4/127.0.0.1/tcp/0",))
    async with open_node(relay_node_config(key_pair, options)) as node:
        spec = RunSpec(
            RunConfig(run=RunSection(id="forged", rounds=3)), str(node.host.peer_id), time.time()
        )
        data, signature = sign_spec(spec, key_pair)
        if mode == "tampered":
            forged = RunSpec(
                spec.config.replace(run={"rounds": 9}), spec.coordinator, spec.created_at
            )
            data = forged.to_bytes()  # the original signature no longer covers these bytes
        else:
            signature = b""
        serve_spec(node.host, data, signature)
        print(join_addr(node), flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--identity", type=Path, required=True)
    parser.add_argument("--mode", choices=["tampered", "unsigned"], required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main, args.identity, args.mode)
